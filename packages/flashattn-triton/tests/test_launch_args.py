"""The direct launch's arguments on the CPU: host-built descriptors encoded once per address, buffers kept
per stream."""

from __future__ import annotations

import warnings

import pytest
import torch

from flashattn_triton import _launcher
from flashattn_triton._launcher import Tiles

pytest.importorskip("triton.backends.nvidia.driver")


@pytest.fixture
def launch_args(monkeypatch):
    """LaunchArgs for a kernel whose arguments 1 and 3 are descriptors, encoding them as
    ["desc", address, rows, layout] and keeping a record of the addresses encoded."""
    encoded = []

    def encode(descriptor, layout):
        encoded.append(descriptor.base.data_ptr())
        return ["desc", descriptor.base.data_ptr(), descriptor.block_shape[2], layout]

    args = _launcher.LaunchArgs({1: "layout-1", 3: "layout-3"})
    monkeypatch.setattr(args, "encode", encode)
    return args, encoded


def test_descriptors_are_encoded_once_per_address(launch_args):
    args, encoded = launch_args
    x, y, z = (torch.zeros(1, 1, 64, 16) for _ in range(3))
    call = (x, _launcher.tiles(y, 32, 16, True), 7, _launcher.tiles(x, 64, 16, True), "tf32", None)
    expected = [x.data_ptr(), "desc", y.data_ptr(), 32, "layout-1", 7,
                "desc", x.data_ptr(), 64, "layout-3", "tf32", None]  # fmt: skip
    assert args(call) == expected
    assert args(call) == expected
    assert encoded == [y.data_ptr(), x.data_ptr()]
    moved = (x, _launcher.tiles(z, 32, 16, True), 7, _launcher.tiles(x, 64, 16, True), "tf32", None)
    assert args(moved)[1:5] == ["desc", z.data_ptr(), 32, "layout-1"]
    assert encoded == [y.data_ptr(), x.data_ptr(), z.data_ptr(), x.data_ptr()]


def test_any_builder_of_descriptors_is_cached_by_address(launch_args):
    """Tiles with a builder of their own (the Gluon kernels' 1-D and 2-D descriptors) cache alike."""
    args, encoded = launch_args
    x = torch.zeros(4, 16)
    built = []

    def build(tensor, block):
        built.append(block)
        return _launcher.tensor_descriptor(tensor.view(1, 1, 4, 16), (1, 1) + block)

    call = (x, Tiles(x, (2, 16), build), 1, Tiles(x, (4, 16), build))
    for _ in range(2):
        assert args(call)[1:5] == ["desc", x.data_ptr(), 2, "layout-1"]
    assert built == [(2, 16), (4, 16)] and encoded == [x.data_ptr()] * 2


def test_the_cache_starts_over_when_full(launch_args, monkeypatch):
    args, encoded = launch_args
    monkeypatch.setattr(args, "MAX_ENTRIES", 2)
    tensors = [torch.zeros(1, 1, 64, 16) for _ in range(3)]
    for t in tensors:
        args((t, _launcher.tiles(t, 32, 16, True), 0, _launcher.tiles(t, 64, 16, True)))
    assert len(args.expanded) == 1


def test_size_one_dims_get_valid_strides():
    """A descriptor's strides must be 16-byte multiples even along dims of size 1, which are never stepped."""
    x = torch.zeros(3, 1, 5, 8)[:1]  # shape (1, 1, 5, 8), strides (40, 40, 8, 1)
    descriptor = _launcher.tiles(x, 16, 8, True).descriptor()
    assert descriptor.strides == [40, 40, 8, 1] and descriptor.block_shape == [1, 1, 16, 8]


def test_launch_hooks_are_seen_however_they_are_set(monkeypatch):
    """A profiler's launch hook sends direct launches back through Triton's runner, which calls it: hooks
    added to Triton's HookChains, and hooks set as plain functions in their place."""
    from triton import knobs

    runtime = knobs.runtime
    assert not _launcher.launch_hooked()

    def hook(metadata):
        return None

    runtime.launch_exit_hook.add(hook)
    try:
        assert _launcher.launch_hooked()
    finally:
        runtime.launch_exit_hook.remove(hook)
    assert not _launcher.launch_hooked()
    monkeypatch.setattr(runtime, "launch_enter_hook", hook)
    assert _launcher.launch_hooked()
    monkeypatch.setattr(runtime, "launch_enter_hook", None)
    assert not _launcher.launch_hooked()


@pytest.mark.parametrize(("version", "direct"), [("3.6.0", True), ("3.7.1", False), ("3.5.0", False)])
def test_direct_launches_only_on_the_tested_triton_else_one_warning(monkeypatch, version, direct):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    _launcher._direct_launch_supported.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _launcher._direct_launch_supported() == direct
            assert _launcher._direct_launch_supported() == direct  # asked again: no second warning
        assert len(caught) == (0 if direct else 1)
        if not direct:
            assert f"Triton {version}" in str(caught[0].message) and "JIT" in str(caught[0].message)
    finally:
        _launcher._direct_launch_supported.cache_clear()
