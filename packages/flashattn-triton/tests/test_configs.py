"""Configs and the choice of kernel, on the CPU: what the launcher accepts and refuses before any launch."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from flashattn_triton import _configs, _dispatch, _hopper, triton_impl
from flashattn_triton._configs import HOPPER_BACKWARD, HOPPER_FORWARD, BackwardConfig, ForwardConfig, smaller


def test_hopper_config_must_fit_the_kernel():
    with pytest.raises(ValueError, match="num_warps = block_n / 16"):
        BackwardConfig(64, 128, 4, 2, atomic_dq=True, hopper=True)
    with pytest.raises(ValueError, match="atomic_dq=True"):
        BackwardConfig(64, 128, 8, 2, hopper=True)
    with pytest.raises(ValueError, match="num_stages >= 2"):
        BackwardConfig(64, 128, 8, 1, atomic_dq=True, hopper=True)
    with pytest.raises(ValueError, match="hopper=True"):
        BackwardConfig(64, 128, 8, 2, atomic_dq=True, persistent=True)
    with pytest.raises(ValueError, match="a program a K/V head"):
        BackwardConfig(64, 128, 8, 2, atomic_dq=True, per_kv_head=True)
    with pytest.raises(ValueError, match="not persistent"):
        BackwardConfig(64, 128, 8, 2, atomic_dq=True, hopper=True, persistent=True, per_kv_head=True)
    # two consumer partitions: num_warps each over block_n / 2 keys, in 64-row steps, the Hopper kernel's
    BackwardConfig(64, 128, 4, 2, atomic_dq=True, hopper=True, consumers=2)
    with pytest.raises(ValueError, match="num_warps = block_n / 16 / consumers"):
        BackwardConfig(64, 128, 8, 2, atomic_dq=True, hopper=True, consumers=2)
    with pytest.raises(ValueError, match="consumers=2: 1, or 2 in the Hopper kernel"):
        BackwardConfig(64, 128, 4, 2, atomic_dq=True, consumers=2)
    with pytest.raises(ValueError, match="block_m = block_n / 2"):
        BackwardConfig(32, 128, 4, 2, atomic_dq=True, hopper=True, consumers=2)
    with pytest.raises(ValueError, match="consumers=3"):
        BackwardConfig(64, 128, 4, 2, atomic_dq=True, hopper=True, consumers=3)


def test_hopper_forward_config_must_fit_the_kernel():
    with pytest.raises(ValueError, match="block_n = block_m"):
        ForwardConfig(128, 64, 4, 2, hopper=True)
    with pytest.raises(ValueError, match="num_warps = block_m / 32"):
        ForwardConfig(128, 128, 8, 2, hopper=True)
    with pytest.raises(ValueError, match="hopper=True"):
        ForwardConfig(128, 128, 4, 2, persistent=True)


def test_hopper_configs_step_down_to_the_triton_kernels():
    rows = (*HOPPER_BACKWARD.values(), *_configs.HOPPER_BACKWARD_PER_KV_HEAD.values())
    for backward in (c for row in rows for c in row):
        assert smaller(backward) == BackwardConfig(backward.block_m, backward.block_n, backward.num_warps,
                                                   backward.num_stages, atomic_dq=True)  # fmt: skip
    for forward in HOPPER_FORWARD:
        assert smaller(forward) == ForwardConfig(forward.block_m, forward.block_n, forward.num_warps,
                                                 forward.num_stages)  # fmt: skip


def test_described_configs_name_the_hopper_kernel():
    assert _configs.describe(BackwardConfig(64, 64, 4, 3, atomic_dq=True)) == "64/64/4/3/1"
    assert _configs.describe(HOPPER_BACKWARD[64][0]) == "64/128/8/4/1/168 hopper"
    assert _configs.describe(HOPPER_BACKWARD[128][0]) == "32/128/8/4/1/168 hopper"
    assert _configs.describe(HOPPER_BACKWARD[64][1]) == "64/128/8/4/1/168 hopper persistent"
    assert _configs.describe(HOPPER_BACKWARD[64][3]) == "64/128/4/4/1/168 hopper persistent consumers=2"
    per_kv_head = _configs.HOPPER_BACKWARD_PER_KV_HEAD[128][0]
    assert _configs.describe(per_kv_head) == "64/128/8/2/1/168 hopper per_kv_head"
    assert _configs.describe(HOPPER_FORWARD[0]) == "128/128/4/2/168 hopper"
    assert _configs.describe(HOPPER_FORWARD[1]) == "128/128/4/2/168 hopper persistent"
    config = BackwardConfig(16, 64, 4, 3, transposed_grads=True, split=True)
    assert _configs.describe(config) == "16/64/4/3/0 transposed_grads split"


def test_kv_splits_must_be_a_small_count_and_not_on_the_hopper_kernel():
    for bad in (0, _configs.MAX_KV_SPLITS + 1, 2.0):
        with pytest.raises(ValueError, match=f"kv_splits={bad}"):
            ForwardConfig(64, 64, 4, 2, kv_splits=bad)
    with pytest.raises(ValueError, match="kv_splits=1"):
        ForwardConfig(128, 128, 4, 2, hopper=True, kv_splits=2)
    assert _configs.describe(ForwardConfig(64, 128, 4, 3, kv_splits=4)) == "64/128/4/3 kv_splits=4"


def test_key_tiles_are_split_where_query_tiles_leave_the_gpu_short_of_work():
    base = _configs.forward_candidates(64, 2, False)
    short = _configs.with_split_key_tiles(base, 4096, 4096, 1, 132)  # 64 query tiles, 32 key tiles a chain
    assert short[: len(base)] == base
    assert {(replace(c, kv_splits=1), c.kv_splits) for c in short[len(base):]} == {
        (c, n) for c in base for n in _configs.KV_SPLITS
    }
    chain = _configs.SPLIT_MIN_KEY_TILES
    for seqlen, batch_heads in ((64 * 264, 1), (4096, 5), (chain * 128 - 1, 1)):  # a full GPU, a short chain
        splits = _configs.with_split_key_tiles(base, seqlen, seqlen, batch_heads, 132)
        assert [c for c in splits if c.kv_splits > 1 and c.block_n == 128] == [], (seqlen, batch_heads)
    hopper = _configs.HOPPER_FORWARD
    assert _configs.with_split_key_tiles(hopper, 4096, 4096, 1, 132) == hopper


def test_transposed_gradients_and_split_need_the_dq_phase():
    for flags in ({"transposed_grads": True}, {"split": True}):
        with pytest.raises(ValueError, match="atomic_dq skips"):
            BackwardConfig(64, 64, 4, 2, atomic_dq=True, **flags)


def test_gluon_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("FLASHATTN_TRITON_GLUON", "0")
    assert not _hopper.available()


def test_gluon_availability_is_read_without_importing_gluon():
    """A warm process whose tuned choices are Triton-language kernels never pays Gluon's import (~0.15 s):
    available() reads Triton's files; the kernels module loads when a Gluon kernel first runs."""
    triton = pytest.importorskip("triton")
    gluon_hopper = pathlib.Path(triton.__file__).parent / "experimental/gluon/language/nvidia/hopper"
    code = ("import sys; from flashattn_triton import _hopper; "
            "print(_hopper.available(), 'triton.experimental.gluon' in sys.modules)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "FLASHATTN_TRITON_GLUON": "1"})  # fmt: skip
    assert result.stdout.split() == [str(gluon_hopper.is_dir()), "False"]


def test_hopper_kernel_refused_where_it_does_not_apply():
    pytest.importorskip("triton")
    q, k, v, out, grad_out = (torch.randn(1, 2, 256, 64, dtype=torch.bfloat16) for _ in range(5))
    description = _dispatch.describe("bwd", q, k, (q, k, v, out, grad_out), window=(-1, 0))
    assert _dispatch.choose(description) != _dispatch.GLUON  # CPU tensors
    lse = torch.zeros(1, 2, 256)
    with pytest.raises(ValueError, match="the Gluon kernels do not run this problem"):
        triton_impl.triton_backward(q, k, v, out, lse, grad_out, True, 0.125, HOPPER_BACKWARD[64][0])
    with pytest.raises(ValueError, match="the Gluon kernels do not run this problem"):
        triton_impl.triton_forward(q, k, v, True, 0.125, HOPPER_FORWARD[0])


def test_head_dims_below_64_count_as_64_toward_the_small_problem_size(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(triton_impl, "_plans", {})
    assert _configs.problem_work(1, 32768, 32768, 32) == _configs.SMALL_PROBLEM_WORK
    assert _configs.problem_work(2, 16384, 32768, 128) == 2 * _configs.SMALL_PROBLEM_WORK
    small = {}
    for seqlen in (16384, 32768):
        q = torch.zeros(1, 1, seqlen, 32, dtype=torch.bfloat16)
        small[seqlen] = triton_impl._plan("fwd", q, (q, q, q), True, None, None).problem.small
    assert small == {16384: True, 32768: False}


def test_many_heads_fill_the_gpu_and_take_the_large_problem_path(monkeypatch):
    """The xl model's attention, (100, 2048, 64), is little work per head but 1600 query tiles: the GPU is
    full, so it takes the large path (preprocessed D, atomic dQ allowed). Up to SMALL_PROBLEM_TILES query
    tiles of 128 rows (16 heads of 2048, 2 of 16384) a problem of little work stays small."""
    pytest.importorskip("triton")
    monkeypatch.setattr(triton_impl, "_plans", {})
    small = {}
    for heads, seqlen in ((100, 2048), (1, 2048), (16, 2048), (17, 2048), (2, 16384)):
        q = torch.zeros(1, heads, seqlen, 64, dtype=torch.bfloat16)
        small[heads, seqlen] = triton_impl._plan("bwd", q, (q, q, q, q, q), True, None, None).problem.small
    assert small == {(100, 2048): False, (1, 2048): True, (16, 2048): True, (17, 2048): False,
                     (2, 16384): True}  # fmt: skip


def test_split_backward_dq_launch_takes_its_own_steps():
    """A split backward's dQ launch steps dq_block_m keys at a time with dq_stages stages; without a split
    there is no dQ launch to give them to; a GPU short of shared memory first drops them."""
    config = BackwardConfig(32, 64, 4, 2, transposed_grads=True, split=True, dq_block_m=16, dq_stages=3)
    assert _configs.dq_launch(config) == BackwardConfig(16, 64, 4, 3, transposed_grads=True, split=True)
    assert _configs.dq_launch(replace(config, dq_block_m=None, dq_stages=None)) == replace(
        config, dq_block_m=None, dq_stages=None
    )
    assert smaller(config) == BackwardConfig(32, 64, 4, 2, transposed_grads=True, split=True)
    assert _configs.describe(config) == "32/64/4/2/0 transposed_grads split dq_block_m=16 dq_stages=3"
    with pytest.raises(ValueError, match="split=True"):
        BackwardConfig(32, 64, 4, 2, transposed_grads=True, dq_block_m=16)
    with pytest.raises(ValueError, match="dq_block_m=24"):
        replace(config, dq_block_m=24)
    with pytest.raises(ValueError, match="dq_stages=0"):
        replace(config, dq_stages=0)


def test_candidate_lists_are_the_callers_own():
    """A caller that extends its candidate list (as a test adding split variants does) leaves the table,
    and every later caller's list, as it was."""
    for table in (_configs.forward_candidates, _configs.backward_candidates):
        first = table(64, 2, False)
        before = list(first)
        first += first
        assert table(64, 2, False) == before


def test_shipped_kernels_seed_an_empty_triton_cache_once(tmp_path, monkeypatch):
    """The shipped archive's kernels land in Triton's cache with their group files naming them where they now
    are; kernels already there are kept, and a second process reads nothing (the marker)."""
    import io
    import json
    import tarfile

    from flashattn_triton import _launcher

    pytest.importorskip("triton")
    group = json.dumps({"child_paths": {"k.cubin": _launcher.PORTABLE_ROOT + "abc/k.cubin"}}).encode()
    archive = tmp_path / "kernels.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("abc/k.cubin", b"binary"), ("abc/__grp__k.json", group), ("abc/k.json", b"{}"),
                           ("old/k.json", b"shipped")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cache = tmp_path / "cache"
    (cache / "old").mkdir(parents=True)
    (cache / "old" / "k.json").write_text("mine")
    monkeypatch.setattr(_launcher, "shipped_archive", lambda capability: archive)
    monkeypatch.setattr(_launcher, "triton_cache_dir", lambda: cache)
    assert _launcher.seed_triton_cache((9, 0)) == 1
    assert (cache / "abc" / "k.cubin").read_bytes() == b"binary"
    assert (cache / "old" / "k.json").read_text() == "mine"
    paths = json.loads((cache / "abc" / "__grp__k.json").read_text())["child_paths"]
    assert paths == {"k.cubin": str(cache / "abc" / "k.cubin")}
    (cache / "abc" / "k.cubin").unlink()
    assert _launcher.seed_triton_cache((9, 0)) == 0 and not (cache / "abc" / "k.cubin").exists()
    monkeypatch.setenv("FLASHATTN_TRITON_SHIPPED_KERNELS", "0")
    assert _launcher.seed_triton_cache((9, 0)) == 0
