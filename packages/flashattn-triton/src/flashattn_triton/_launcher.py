"""The launcher seam: the one module that touches Triton's and torch's private internals, and that imports
Triton and the kernel modules (on first use, so that ``import flashattn_triton`` works without Triton).

A ``Launcher`` is one kernel with one config and grid, called with its arguments by name. Its first call goes
through Triton's JIT; later calls launch the compiled kernel directly (most of a small problem's host time is
the JIT's per-call binding), into Triton's C launch function with host-built descriptors encoded by
``make_tensordesc_arg`` and torch's raw stream: private interfaces, used only with the Triton version the
tests check (``DIRECT_LAUNCH_TRITON``); any other version, or a launch hook (a profiler's), goes through the
JIT.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import inspect
import operator
import os
import tarfile
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch

DIRECT_LAUNCH_TRITON = (3, 6)  # the Triton whose C launcher the direct launch calls (tested with 3.6.0)


class Tiles(NamedTuple):
    """A descriptor moving `block` tiles of `tensor`, built by build(tensor, block) on a JIT launch, or once
    per address on a direct one (LaunchArgs)."""

    tensor: torch.Tensor
    block: tuple[int, ...]
    build: Callable[[torch.Tensor, tuple[int, ...]], Any]

    def descriptor(self) -> Any:
        return self.build(self.tensor, self.block)


@functools.cache
def kernels() -> ModuleType:
    """The tuned Triton kernels, imported on first use; on an sm_90 GPU, after seeding Triton's cache with the
    compiled kernels shipped for this Triton."""
    try:
        if not interpret_requested() and torch.cuda.is_available():
            seed_triton_cache(torch.cuda.get_device_capability())
        from flashattn_triton import _kernels
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "triton":
            raise
        raise ModuleNotFoundError(
            "FlashAttentionTriton needs Triton, which is not installed: CUDA builds of torch bring it; on "
            "CPU install flashattn-triton[interpret] (and set TRITON_INTERPRET=1), or use flash_attention() "
            "or FlashAttentionTorch.apply(), which run without it", name=exc.name) from exc
    return _kernels


SHIPPED_KERNELS = Path(__file__).parent / "kernels"
# Triton's cache keeps a compiled kernel as <cache>/<hash>/<files>, with a group file naming its files by
# absolute path: shipped archives name them relative to the cache (PORTABLE_ROOT), made absolute here.
PORTABLE_ROOT = "$TRITON_CACHE/"


def shipped_archive(capability: tuple[int, int]) -> Path:
    """The archive of compiled kernels shipped for this Triton and capability
    (lab/flashattn-triton/scripts/ship_kernels.py)."""
    return SHIPPED_KERNELS / f"triton-{triton_version()}-sm{capability[0]}{capability[1]}.tar.gz"


def triton_cache_dir() -> Path:
    """The directory of Triton's kernel cache (TRITON_CACHE_DIR, else its default)."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def seed_triton_cache(capability: tuple[int, int]) -> int:
    """Add the compiled kernels shipped for this Triton and GPU that Triton's cache lacks (a marker file
    records an archive added), so that a fresh machine's first calls load kernels rather than compile them;
    kernels of other sources or builds hash differently and compile as usual.
    FLASHATTN_TRITON_SHIPPED_KERNELS=0 turns it off. Returns how many were added."""
    if not env_flag("FLASHATTN_TRITON_SHIPPED_KERNELS", True):
        return 0
    archive = shipped_archive(capability) if triton_available() else None
    if archive is None or not archive.is_file():
        return 0
    cache = triton_cache_dir()
    marker = cache / f"flashattn_triton-{archive.name}-{archive.stat().st_size}.seeded"
    if marker.exists():
        return 0
    added = 0
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and len(Path(m.name).parts) == 2]
            for member in members:
                target = cache / member.name
                if target.exists():
                    continue
                data = tar.extractfile(member).read()
                if Path(member.name).name.startswith("__grp__"):
                    data = data.replace(PORTABLE_ROOT.encode(), (str(cache) + os.sep).encode())
                write_atomically(target, data)
                added += target.name.endswith(".json") and not target.name.startswith("__grp__")
        marker.touch()
    except (OSError, tarfile.TarError) as exc:  # a read-only cache, a torn archive: kernels compile instead
        warnings.warn(f"flashattn_triton: could not add the shipped kernels to Triton's cache {cache}: {exc}",
                      RuntimeWarning, stacklevel=2)  # fmt: skip
    return added


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` whole through a temporary file of its own, renamed over it: no reader, and no other
    process writing it at the same time, sees half a file. Raises OSError (and leaves no temporary file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as file:
        temporary = Path(file.name)
        file.write(data)
    try:
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)
        raise


def env_flag(name: str, default: bool) -> bool:
    """The switch that environment variable ``name`` sets: 1/true/on/yes, 0/false/off/no (any case), else
    ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    return default


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return env_flag("TRITON_INTERPRET", False)


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether the kernels were built for the interpreter (when first imported); False without Triton."""
    return triton_available() and type(kernels().attn_fwd).__name__ == "InterpretedFunction"


@functools.cache
def feature_kernels() -> ModuleType:
    """The feature kernels (feature_impl's), imported on first use."""
    from flashattn_triton import _feature_kernels

    return _feature_kernels


@functools.cache
def gluon_kernels() -> ModuleType:
    """The Gluon kernels (_hopper's), imported when one first runs: a Gluon whose API differs from Triton
    3.6's fails here, and the tuner skips them."""
    from flashattn_triton import _hopper_kernels

    return _hopper_kernels


def triton_version() -> str:
    import triton

    return triton.__version__


@functools.cache
def out_of_resources() -> type[Exception]:
    from triton.runtime.errors import OutOfResources

    return OutOfResources


def tensor_descriptor(x4: torch.Tensor, block: tuple[int, ...]) -> Any:
    """Triton's TensorDescriptor over (Z, H, T, d) x4, moving `block` tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    strides = list(x4.stride())
    for i in (2, 1, 0):  # a dim of size 1 is never stepped along; give it any valid stride
        if x4.shape[i] == 1:
            strides[i] = strides[i + 1] * x4.shape[i + 1]
    return TensorDescriptor(x4, list(x4.shape), strides, list(block))


def tiles(x4: torch.Tensor | None, rows: int, cols: int, host: bool) -> Tiles | torch.Tensor | None:
    """(rows, cols) tiles of x4 for the host to describe, or x4 itself for the kernels to describe."""
    return Tiles(x4, (1, 1, rows, cols), tensor_descriptor) if host and x4 is not None else x4


def _descriptors(args: tuple) -> list:
    """args with each Tiles built as its descriptor (for the JIT and its runner)."""
    return [a.descriptor() if type(a) is Tiles else a for a in args]


def scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Scratch memory of one launch (Triton's allocator protocol), fresh each launch: a kept buffer made in a
    warm-up of torch.compile's CUDA graph trees would hold the graph pool's memory."""
    return torch.empty(size, dtype=torch.int8, device=torch.device("cuda", torch.cuda.current_device()))


def _set_allocator() -> None:
    """Set on every call: Triton keeps the allocator per context, and autograd runs the backward in its own
    thread."""
    import triton

    triton.set_allocator(scratch)


def intercepted() -> bool:
    """Whether a dispatch mode (FakeTensorMode, FlopCounterMode, ...) or a functorch transform
    (torch.func.grad, vmap) must see the ops' calls."""
    return bool(torch._C._len_torch_dispatch_stack()) or torch._C._are_functorch_transforms_active()


def transformed() -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active (not while compiling, where the
    op is traced)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0


def plain_eager(t: torch.Tensor) -> bool:
    """Whether a call on t may skip the dispatcher (ops.eager_attention): a plain CUDA tensor in eager mode,
    with no compile or export tracing it and nothing intercepting it."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda and not torch.compiler.is_compiling()
            and not intercepted())  # fmt: skip


def assert_async(condition: torch.Tensor, message: str) -> None:
    """A device-side assertion: stops the kernels queued after it where condition is False, with no wait."""
    torch._assert_async(condition, message)


# GPU clock cycles a millisecond, rounded up from an H100's boost clock: a sleep lasts at least as planned.
_CYCLES_PER_MS = 2_000_000
_QUEUE_TRIES = 3


def gpu_milliseconds(fn: Callable[[], None], rep_ms: float) -> float:
    """fn's GPU time a call, host time excluded: about rep_ms worth of calls queued behind a sleep kernel, so
    that the GPU runs them back to back (timed as ordinary calls, small problems would time the host)."""
    fn()  # (compiles, fills caches)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    host = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_ms = (time.perf_counter() - host) * 1e3
    end.synchronize()
    calls = max(2, min(1000, int(rep_ms / max(start.elapsed_time(end), 1e-3))))
    for _ in range(_QUEUE_TRIES):
        torch.cuda._sleep(int(2 * (calls + 1) * host_ms * _CYCLES_PER_MS))
        host = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        # Where the sleep ended before the last call was queued, the time may be partly the host's: queue
        # again behind a sleep sized from the calls just queued (a tuned choice is kept on disk).
        drained = start.query()
        host_ms = max(2 * host_ms, (time.perf_counter() - host) * 1e3 / calls)
        end.synchronize()
        if not drained:
            break
    return start.elapsed_time(end) / calls


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


class Launcher:
    """One kernel with one config (None for a kernel without) and grid, called with its arguments by name.
    Direct launches are sound only for arguments the JIT would specialize as on the first call: a Launcher
    belongs to one plan, whose key holds every tensor's shape, strides, dtype and alignment."""

    def __init__(self, kernel: Any, grid: tuple[int, ...], config: Any = None):
        self.kernel = kernel
        self.grid = (*grid, 1, 1)[:3]
        self.options = {"num_warps": config.num_warps, "num_stages": config.num_stages} if config else {}
        if config and config.max_registers:
            self.options["maxnreg"] = config.max_registers
        # The arguments in the kernel's order, picked from a call's dict in C, not a Python loop.
        self.positional = operator.itemgetter(*inspect.signature(kernel.fn).parameters)
        self.compiled: Callable[[tuple], None] | None = None

    def __call__(self, args: dict[str, Any]) -> None:
        positional = self.positional(args)
        if self.compiled is not None:
            self.compiled(positional)
            return
        cuda = [t.device.index for t in (a.tensor if type(a) is Tiles else a for a in positional)
                if isinstance(t, torch.Tensor) and t.is_cuda]
        if cuda:
            ensure_context(cuda[0])
        _set_allocator()
        compiled = self.kernel[self.grid](*_descriptors(positional), **self.options)
        if hasattr(compiled, "function"):  # under the interpreter there is no compiled kernel to keep
            self.compiled = _direct_launch(compiled, self.grid)


class LaunchPair:
    """Two dependent launches of one plan, called with a pair of argument dicts: a split forward's partials
    and combine, or a split backward's dK/dV and dQ."""

    def __init__(self, first: Launcher, second: Launcher):
        self.first = first
        self.second = second

    def __call__(self, args: tuple[dict[str, Any], dict[str, Any]]) -> None:
        self.first(args[0])
        self.second(args[1])


@functools.cache
def _direct_launch_supported() -> bool:
    """Whether this Triton's C launcher is the one the direct launch was tested against; warns once where not.
    """
    version = tuple(int(x) for x in triton_version().split(".")[:2])
    if version != DIRECT_LAUNCH_TRITON:
        warnings.warn(f"flashattn_triton: Triton {triton_version()} is not the version its direct kernel "
                      f"launches were tested with ({'.'.join(map(str, DIRECT_LAUNCH_TRITON))}); every launch "
                      "goes through Triton's JIT (correct, with more host time a call)",
                      RuntimeWarning, stacklevel=4)  # fmt: skip
    return version == DIRECT_LAUNCH_TRITON


@functools.cache
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime  # one object for the process; a hook set later shows up in its attributes


def launch_hooked() -> bool:
    """Whether anyone (a profiler such as Proton) hooked Triton's launches; asked on every direct launch."""
    runtime = _runtime_knobs()
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


class LaunchArgs:
    """A compiled kernel's C launch arguments by the addresses of the call's tensors and Tiles (tensors as
    addresses, Tiles as encoded descriptors): the plan fixes all else."""

    MAX_ENTRIES = 256  # new addresses without end (ever new tensors) start it over rather than grow it

    def __init__(self, descriptor_layouts: dict[int, Any]):
        from triton.backends.nvidia.driver import make_tensordesc_arg

        self.encode = make_tensordesc_arg
        self.descriptor_layouts = descriptor_layouts  # argument position -> the kernel's TMA layout of it
        self.expanded: dict[tuple, list] = {}
        # Argument positions of the tensors and of the Tiles: found on the first call, the same in all.
        self.positions: tuple[list[int], list[int]] | None = None

    def __call__(self, args: tuple) -> list:
        if self.positions is None:
            self.positions = ([i for i, a in enumerate(args) if isinstance(a, torch.Tensor)],
                              [i for i, a in enumerate(args) if type(a) is Tiles])  # fmt: skip
        tensors, tile_args = self.positions
        key = (*[args[i].data_ptr() for i in tensors], *[args[i].tensor.data_ptr() for i in tile_args])
        expanded = self.expanded.get(key)
        if expanded is None:
            if len(self.expanded) >= self.MAX_ENTRIES:
                self.expanded.clear()
            expanded = self.expanded[key] = self.expand(args)
        return expanded

    def expand(self, args: tuple) -> list:
        expanded = []
        for position, a in enumerate(args):
            layout = self.descriptor_layouts.get(position)
            if layout is not None:
                expanded += self.encode(a.descriptor(), layout)
            else:
                expanded.append(a.data_ptr() if isinstance(a, torch.Tensor) else a)
        return expanded


@functools.cache
def _libcuda() -> ctypes.CDLL:
    from triton.backends.nvidia.driver import libcuda_dirs

    for path in ("libcuda.so.1", *(f"{d}/libcuda.so.1" for d in libcuda_dirs())):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise RuntimeError("flashattn_triton: cannot load libcuda.so.1 (the CUDA driver)")


_thread = threading.local()


def ensure_context(device: int) -> None:
    """Make ``device``'s primary CUDA context current in this thread if none is: descriptors and the C launch
    need one, and torch starts autograd's device thread without one."""
    if getattr(_thread, "device", None) == device:
        return
    libcuda, context = _libcuda(), ctypes.c_void_p()
    if libcuda.cuCtxGetCurrent(ctypes.byref(context)) == 0 and not context.value:
        handle = ctypes.c_int()
        steps = (lambda: libcuda.cuDeviceGet(ctypes.byref(handle), device),
                 lambda: libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
                 lambda: libcuda.cuCtxSetCurrent(context))  # fmt: skip
        for step in steps:
            status = step()
            if status != 0:
                raise RuntimeError(f"flashattn_triton: could not make CUDA device {device}'s context current "
                                   f"(CUresult {status})")
    _thread.device = device


def _direct_launch(kernel: Any, grid: tuple[int, int, int]) -> Callable[[tuple], None]:
    """A launch of compiled `kernel` on `grid` straight into Triton's C launch function (tensors as addresses,
    descriptors encoded once: LaunchArgs) where the direct launch is supported and no launch hook is set, else
    through the JIT's runner, whose per-launch metadata, hooks and pointer queries were about half a small
    problem's host time."""
    runner = kernel[grid]
    device = torch.cuda.current_device()

    def through_runner(args: tuple) -> None:
        ensure_context(device)
        _set_allocator()  # per call: Triton keeps it per thread, and autograd's backward has its own
        runner(*_descriptors(args))

    run = kernel.run
    if not _direct_launch_supported() or type(run).__name__ != "CudaLauncher" or run.profile_scratch_size:
        return through_runner
    # Triton wraps its C launch function to encode descriptor arguments on every call; take the function.
    wrapped = inspect.getclosurevars(run.launch).nonlocals if inspect.isfunction(run.launch) else {}
    launch = wrapped.get("launcher", run.launch)
    descriptor_args = sorted(wrapped.get("tensordesc_indices", ()))
    metadata = wrapped.get("tensordesc_meta") or [None] * len(descriptor_args)
    if None in metadata:  # not lowered to TMA: Triton's wrapper passes those as pointers, shapes, strides
        return through_runner
    launch_args = LaunchArgs(dict(zip(descriptor_args, metadata, strict=True)))
    function, packed_metadata = kernel.function, kernel.packed_metadata
    flags = (run.launch_cooperative_grid, run.launch_pdl)
    scratch_bytes = run.global_scratch_size * grid[0] * grid[1] * grid[2] * run.num_ctas
    alignment = run.global_scratch_align
    raw_stream = torch._C._cuda_getCurrentRawStream

    def direct(args: tuple) -> None:
        if launch_hooked():
            through_runner(args)
            return
        ensure_context(device)
        stream = raw_stream(device)
        scratch_address = scratch(scratch_bytes, alignment, stream).data_ptr() if scratch_bytes else None
        launch(*grid, stream, function, *flags, scratch_address, None, packed_metadata, None, None, None,
               *launch_args(args))  # fmt: skip

    return direct
