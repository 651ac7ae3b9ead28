"""FlashAttention-2 with Triton kernels: launchers and the autograd Function.

Triton is imported on first use, so ``import flashattn_triton`` works without it. The kernels run on
CUDA tensors; with ``TRITON_INTERPRET=1`` in the environment before they are first used, Triton's
interpreter runs them on CPU tensors instead (slowly: for testing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from flashattn_triton import _hopper
from flashattn_triton._autograd import AttentionFunction
from flashattn_triton._configs import (
    HOPPER_BACKWARD,
    HOPPER_FORWARD,
    BackwardConfig,
    ForwardConfig,
    backward_candidates,
    dq_launch,
    forward_candidates,
    smaller,
    with_split_key_tiles,
)
from flashattn_triton._tiles import Tiles
from flashattn_triton._validation import check_inputs

MAX_HEAD_DIM = 256
_TRUE = ("1", "true", "on", "yes")


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


@functools.cache
def _kernels() -> ModuleType:
    from flashattn_triton import _kernels as kernels

    return kernels


def _interpreted() -> bool:
    """Whether the kernels were built for the interpreter (decided when they were first imported)."""
    return type(_kernels().attn_fwd).__name__ == "InterpretedFunction"


def check_head_dim(q: torch.Tensor) -> None:
    """The Triton path's limit on the head dim (after check_inputs has passed)."""
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {head_dim} (q.shape[-1]) is not supported by the Triton kernels "
            f"(1..{MAX_HEAD_DIM}); use FlashAttentionTorch for larger head dims"
        )


def check_device(q: torch.Tensor) -> None:
    """Errors for a device the Triton kernels cannot run on (CPU only in the interpreter)."""
    if q.device.type == "cuda":
        return
    if q.device.type != "cpu" or not interpret_requested():
        raise RuntimeError(
            f"FlashAttentionTriton got q on {q.device}; its kernels need CUDA tensors. On this device use "
            "flashattn_triton.flash_attention(...) or FlashAttentionTorch.apply(...), or set "
            "TRITON_INTERPRET=1 before the first call to run the Triton kernels in Triton's (slow) CPU "
            "interpreter"
        )
    if not _interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after flashattn_triton's Triton kernels were built for the GPU, so "
            "they cannot run on CPU tensors in this process; set it before the first call (or use "
            "FlashAttentionTorch)"
        )
    if q.dtype == torch.bfloat16:  # its dot products come out wrong there (seen with Triton 3.9)
        raise TypeError(
            "bfloat16 is not supported by Triton's CPU interpreter (TRITON_INTERPRET=1), whose bfloat16 "
            "dot products are wrong; use float32 or float16 there, or unset TRITON_INTERPRET to run the "
            "PyTorch path"
        )


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """(..., T, d) as (Z, H, T, d): a view for 3-D and 4-D tensors of any strides."""
    return x.unsqueeze(0) if x.dim() == 3 else x.reshape(-1, *x.shape[-3:])


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def _padded_head_dim(head_dim: int, element_size: int) -> int:
    """Rows of a tensor descriptor must span a multiple of 16 bytes: d rounded up to that."""
    step = 16 // element_size
    return -(-head_dim // step) * step


def _input_precision(dtype: torch.dtype) -> str:
    # float32 keeps float32 accuracy (3 TF32 products) unless the user allowed TF32 for matmuls.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


class _TF32Split:
    """The TF32 parts of inputs of one layout, as the tf32x3 kernels read them: a float32 (Z, H, T, d)
    tensor (unit stride along d) as a (2Z, H, T, d) pair of x with its 13 low mantissa bits cleared
    (exactly TF32), then the remainders x - high; transposed: as (2Z, H, d, T), its rows padded to 16
    bytes. One allocation and one launch of _kernels.tf32_parts a call, their shapes worked out once."""

    ROWS = 32

    def __init__(self, x4: torch.Tensor, transposed: bool):
        batch, heads, seqlen, head_dim = x4.shape
        if transposed:
            row = -(-seqlen // 4) * 4
            self.shape = (2 * batch, heads, head_dim, seqlen)
            self.strides = (heads * head_dim * row, head_dim * row, row, 1)
            part_strides = (batch * self.strides[0], *self.strides[:2], 1, row)  # as (2, Z, H, T, d)
        else:
            self.shape = (2 * batch, heads, seqlen, head_dim)
            self.strides = (heads * seqlen * head_dim, seqlen * head_dim, head_dim, 1)
            part_strides = (batch * self.strides[0], *self.strides)
        self.args = (heads, seqlen, head_dim, *x4.stride()[:3], *part_strides, self.ROWS, _block_d(head_dim))
        self.launch = _Launcher(_kernels().tf32_parts, (-(-seqlen // self.ROWS) * batch * heads,), None)

    def __call__(self, x4: torch.Tensor) -> torch.Tensor:
        parts = torch.empty_strided(self.shape, self.strides, dtype=x4.dtype, device=x4.device)
        if parts.numel():
            self.launch(x4, parts, *self.args)
        return parts


def _tf32_parts(x4: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """x4's TF32 parts (see _TF32Split)."""
    return _TF32Split(x4, transposed)(x4)


def _kernel_views(plan: _Plan, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors as _kernel_view makes them: as they are where the plan's layout says they already are."""
    if plan.as_is:
        return tensors
    return tuple(_kernel_view(t, plan.head_dim, plan.host) for t in tensors)


def _kernel_inputs(plan: _Plan, *tensors: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, ...]:
    """The inputs as the kernels read them: as they are, or as TF32 parts under tf32x3 (made by each
    pass: saving the forward's for the backward would hold twice the inputs in between). Their _TF32Splits
    are the plan's, one for each place of a pass's inputs: the plan's key fixes their layouts."""
    if plan.precision != "tf32x3":
        return tensors
    parts = []
    with _device_guard(tensors[0]):
        for place, x4 in enumerate(tensors):
            split = plan.splits.get((place, transposed))
            if split is None:
                split = plan.splits[place, transposed] = _TF32Split(x4, transposed)
            parts.append(split(x4))
    return tuple(parts)


# Problems below this much work (problem_work: T = 32768 at B * H = 1 and d <= 64) are host-bound or
# close to it: a call's Python and launches take about as long as its kernels. Their backward adds dQ up
# without atomics (whose float32 sum costs two more tensor ops) and computes D = rowsum(dO * O) in its
# kernel, saving the preprocess launch; their forward may split its key tiles among programs; the Gluon
# kernels, tuned for throughput, are left to larger problems.
SMALL_PROBLEM_WORK = 32768 * 32768 * 64


def problem_work(batch_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> int:
    """Query-key pairs times the head dim, counted as at least 64: below it a kernel's time per pair stops
    falling with d (the softmax's exponentials, each tile's fixed costs; at (1, 32768, 32) the large
    problems' backward took 0.62 ms, the small problems' 0.99, PERF.md v22)."""
    return batch_heads * seqlen_q * seqlen_k * max(head_dim, 64)


def is_small_problem(batch_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int) -> bool:
    """Whether a problem takes the small-problem path (its problem_work below SMALL_PROBLEM_WORK)."""
    return problem_work(batch_heads, seqlen_q, seqlen_k, head_dim) < SMALL_PROBLEM_WORK


COMBINE_ROWS = 32  # query rows a program of attn_fwd_combine


def _host_descriptors(device: torch.device) -> bool:
    """Whether the host builds the tensor descriptors: on Hopper and later, and for the interpreter.
    Otherwise the kernels get pointers to contiguous tensors and build them (on GPUs before Hopper, as
    ordinary loads). A kernel-built descriptor costs every program a write and a fence: about 4 us of a
    forward on an H100 and 14 us of a backward (PERF.md v23), while the host encodes its own once per
    address (_LaunchArgs)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] >= 9


def _is_kernel_view(x: torch.Tensor, head_dim: int) -> bool:
    """Whether x is already what _kernel_view makes of it (the common case)."""
    return x.dim() == 4 and x.shape[-1] == head_dim and x.is_contiguous() and x.data_ptr() % 16 == 0


def _kernel_view(x: torch.Tensor, head_dim: int, host: bool) -> torch.Tensor:
    """x as (Z, H, T, head_dim) that the kernels can address: padded with zeros along d if head_dim
    is larger, and copied only if its layout is one a descriptor cannot describe."""
    if _is_kernel_view(x, head_dim):
        return x
    x4 = _as_4d(x)
    if x4.shape[-1] < head_dim:
        x4 = F.pad(x4, (0, head_dim - x4.shape[-1]))
    size = x4.element_size()
    addressable = x4.data_ptr() % 16 == 0 and (
        x4.is_contiguous()
        if not host
        else x4.stride(-1) == 1
        and all(
            n == 1 or (stride > 0 and stride * size % 16 == 0)
            for n, stride in zip(x4.shape[:-1], x4.stride()[:-1], strict=True)
        )
    )
    return x4 if addressable else x4.clone(memory_format=torch.contiguous_format)


def _tensor_descriptor(x4: torch.Tensor, block: tuple[int, ...]) -> Any:
    """Triton's TensorDescriptor over (Z, H, T, d) x4, moving `block` tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    strides = list(x4.stride())
    for i in (2, 1, 0):  # a dim of size 1 is never stepped along; give it any valid stride
        if x4.shape[i] == 1:
            strides[i] = strides[i + 1] * x4.shape[i + 1]
    return TensorDescriptor(x4, list(x4.shape), strides, list(block))


def _tiles(x4: torch.Tensor, rows: int, cols: int, host: bool) -> Tiles | torch.Tensor:
    """(rows, cols) tiles of x4 for the host to describe, or x4 itself for the kernels to describe."""
    return Tiles(x4, (1, 1, rows, cols), _tensor_descriptor) if host else x4


def _descriptors(args: tuple) -> tuple:
    """args with each Tiles built as its descriptor (for the JIT and its runner)."""
    return tuple(a.descriptor() if type(a) is Tiles else a for a in args)


_stream_buffers: dict[tuple[str, torch.device, int | None], torch.Tensor] = {}


def _stream_buffer(use: str, numel: int, dtype: torch.dtype, device: torch.device,
                   stream: int | None) -> torch.Tensor:  # fmt: skip
    """A buffer kept per (use, device, stream) and grown as needed, for memory that one launch writes and
    the next reads: an allocation a launch is host time. Sharing it is safe because the launches of one
    stream run one after another."""
    key = (use, device, stream)
    buffer = _stream_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _stream_buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer


def _current_stream(device: torch.device) -> int | None:
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Scratch memory of one launch (Triton's allocator protocol): kernel-built descriptors live there."""
    device = torch.device("cuda", torch.cuda.current_device())
    return _stream_buffer("scratch", size, torch.int8, device, stream)


def _set_allocator() -> None:
    """Kernel-built descriptors live in scratch memory that Triton asks the host to allocate. Set on
    every such call: Triton keeps the allocator in a context variable, and autograd runs the backward
    in a thread of its own."""
    import triton

    triton.set_allocator(_scratch)


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _autotune_enabled() -> bool:
    return os.environ.get("FLASHATTN_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off", "no")


def _size_class(n: int) -> int:
    """n rounded up to a power of two: problems in one class share their tuned config."""
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


Config = TypeVar("Config", ForwardConfig, BackwardConfig)


def _describe(config: ForwardConfig | BackwardConfig) -> str:
    """The numbers of a config joined by '/', then its flags, its kv_splits beyond 1 and the dQ launch's own
    steps and stages by name."""
    flags = ("hopper", "transposed_grads", "split")
    dq_steps = ("dq_block_m", "dq_stages")
    numbers = [x for name, x in dataclasses.asdict(config).items()
               if name not in (*flags, "kv_splits", *dq_steps) and x is not None]  # fmt: skip
    named = [name for name in flags if getattr(config, name, False)]
    splits = getattr(config, "kv_splits", 1)
    named += [f"kv_splits={splits}"] * (splits > 1)
    named += [f"{name}={getattr(config, name)}" for name in dq_steps if getattr(config, name, None)]
    return " ".join(["/".join(str(int(x)) for x in numbers), *named])


class _Launcher:
    """One kernel with one config and grid. The first call goes through Triton's JIT, which compiles
    (or finds) the specialization for its arguments; later calls launch that compiled kernel directly
    (_direct_launch), skipping the JIT's per-call work of binding and specializing every argument (most
    of a small problem's host time). Sound only for arguments the JIT would specialize the same way: a
    _Launcher belongs to one _Plan, whose key holds every tensor's shape, strides, dtype and 16-byte
    alignment."""

    def __init__(self, kernel: Any, grid: tuple[int, ...], config: ForwardConfig | BackwardConfig | None):
        self.kernel = kernel
        self.grid = (*grid, 1, 1)[:3]
        self.options = {"num_warps": config.num_warps, "num_stages": config.num_stages} if config else {}
        if config and config.max_registers:
            self.options["maxnreg"] = config.max_registers
        self.compiled: Callable[..., None] | None = None

    def __call__(self, *args: Any) -> None:
        if self.compiled is not None:
            self.compiled(*args)
            return
        _set_allocator()
        compiled = self.kernel[self.grid](*_descriptors(args), **self.options)
        if hasattr(compiled, "function"):  # under the interpreter there is no compiled kernel to keep
            self.compiled = _direct_launch(compiled, self.grid)


@functools.cache
def _launcher_abi_known() -> bool:
    """Whether this Triton's C launcher takes the arguments _direct_launch passes (checked with 3.6)."""
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2]) == (3, 6)


@functools.cache
def _runtime_knobs() -> Any:
    from triton import knobs

    return knobs.runtime  # one object for the process; a hook set later shows up in its attributes


def _launch_hooked() -> bool:
    """Whether anyone (a profiler such as Proton) hooked Triton's kernel launches: a HookChain with calls,
    or a hook set as a plain function. Asked on every direct launch."""
    runtime = _runtime_knobs()
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


class _LaunchArgs:
    """The arguments of one compiled kernel's C launch function, kept by the addresses of the call's tensors
    and Tiles: tensors as addresses, Tiles as host-built descriptors, encoded as the launcher takes them
    (the CUtensorMap, then the shape and strides). A descriptor follows from its tensor's address, shape,
    strides and dtype and the tile, and a _Launcher's plan and config fix all else (every shape, stride and
    scalar argument, see _Launcher), so repeated addresses skip the TensorDescriptors and their encoding
    (about 10 us of host time each, 4 a forward and 11 a backward)."""

    MAX_ENTRIES = 256  # new addresses without end (ever new tensors) start it over rather than grow it

    def __init__(self, descriptor_layouts: dict[int, Any]):
        from triton.backends.nvidia.driver import make_tensordesc_arg

        self.encode = make_tensordesc_arg
        self.descriptor_layouts = descriptor_layouts  # argument position -> the kernel's TMA layout of it
        self.expanded: dict[tuple, list] = {}
        # Argument positions of the tensors and of the Tiles, found on the first call: the same in every call
        # of a _Launcher.
        self.positions: tuple[list[int], list[int]] | None = None

    def __call__(self, args: tuple) -> list:
        if self.positions is None:
            self.positions = ([i for i, a in enumerate(args) if isinstance(a, torch.Tensor)],
                              [i for i, a in enumerate(args) if type(a) is Tiles])  # fmt: skip
        tensors, tiles = self.positions
        key = (*[args[i].data_ptr() for i in tensors], *[args[i].tensor.data_ptr() for i in tiles])
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


def _direct_launch(kernel: Any, grid: tuple[int, int, int]) -> Callable[..., None]:
    """A launch of compiled `kernel` on `grid`: straight into Triton's C launch function, with tensors
    passed as addresses and host-built descriptors encoded once (_LaunchArgs), where this Triton's launcher
    is the one _launcher_abi_known checked and no launch hook is set; else through the JIT's own runner.
    Triton's runner builds launch metadata and calls its hook chains on every launch, asks the allocator
    for scratch memory through Python, and its C launcher calls data_ptr() and cuPointerGetAttribute on
    every tensor: about half of a small problem's host time a pass (PERF.md v16)."""
    runner = kernel[grid]

    def through_runner(*args: Any) -> None:
        _set_allocator()  # per call: Triton keeps it per thread, and autograd's backward has its own
        runner(*_descriptors(args))

    run = kernel.run
    if not _launcher_abi_known() or type(run).__name__ != "CudaLauncher" or run.profile_scratch_size:
        return through_runner
    # Triton wraps its C launch function to encode descriptor arguments on every call; take the function.
    wrapped = inspect.getclosurevars(run.launch).nonlocals if inspect.isfunction(run.launch) else {}
    launch = wrapped.get("launcher", run.launch)
    descriptor_args = sorted(wrapped.get("tensordesc_indices", ()))
    metadata = wrapped.get("tensordesc_meta") or [None] * len(descriptor_args)
    if None in metadata:  # not lowered to TMA: Triton's wrapper passes those as pointers, shapes, strides
        return through_runner
    launch_args = _LaunchArgs(dict(zip(descriptor_args, metadata, strict=True)))
    function, packed_metadata = kernel.function, kernel.packed_metadata
    flags = (run.launch_cooperative_grid, run.launch_pdl)
    scratch_bytes = run.global_scratch_size * grid[0] * grid[1] * grid[2] * run.num_ctas
    alignment, device = run.global_scratch_align, torch.cuda.current_device()
    raw_stream = torch._C._cuda_getCurrentRawStream

    def direct(*args: Any) -> None:
        if _launch_hooked():
            through_runner(*args)
            return
        stream = raw_stream(device)
        scratch = _scratch(scratch_bytes, alignment, stream).data_ptr() if scratch_bytes else None
        launch(*grid, stream, function, *flags, scratch, None, packed_metadata, None, None, None,
               *launch_args(args))  # fmt: skip

    return direct


class _LaunchPair:
    """Two launches of one plan, the second depending on the first: the first on the call's arguments but
    the last, the second on the last (a tuple). The split forward (ForwardConfig.kv_splits): attn_fwd's
    partials, then attn_fwd_combine; the split backward (BackwardConfig.split): attn_bwd for dK/dV, then
    for dQ (with its own steps, _configs.dq_launch)."""

    def __init__(self, first: _Launcher, second: _Launcher):
        self.first = first
        self.second = second

    def __call__(self, *args: Any) -> None:
        self.first(*args[:-1])
        self.second(*args[-1])


@dataclasses.dataclass
class _Plan:
    """How one problem layout runs, worked out on its first call and reused by every later call with
    the same key: the descriptor mode, the candidate configs and the tuning key of its size class,
    the config chosen and its launchers. A forward's plan is made only for inputs that pass
    check_inputs; its key holds everything those checks read, so the checks are not repeated."""

    scale: float  # the softmax scale, checked (and defaulted) when the forward's plan was made
    host: bool
    small: bool  # below SMALL_PROBLEM_WORK
    as_is: bool  # every tensor is already what _kernel_view makes of it
    head_dim: int
    block_d: int
    precision: str
    candidates: list
    tune_key: tuple
    config: Any = None
    launch: _Launcher | _LaunchPair | None = None
    preprocess: dict[bool, _Launcher] = dataclasses.field(default_factory=dict)  # by whether it zeroes dQ
    # A forward's plans of the backward, by what its key adds to the forward's: the incoming gradient's
    # strides and alignment (autograd gives it the output's shape, dtype and device) and the precision.
    backward_plans: dict = dataclasses.field(default_factory=dict)
    splits: dict[tuple[int, bool], _TF32Split] = dataclasses.field(default_factory=dict)  # (_kernel_inputs)


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096  # a process seeing ever new lengths starts over rather than growing without bound
_chosen: dict[Any, ForwardConfig | BackwardConfig] = {}


def _plan(pass_name: str, q: torch.Tensor, tensors: tuple[torch.Tensor, ...], is_causal: bool,
          scale: float | None, config: Any) -> _Plan:
    """The plan of this call's layout: created, not yet run, on the first call with it (the forward's
    after checking its inputs). tensors starts with q and k (and v)."""
    try:
        precision = _input_precision(q.dtype)
        layouts = ((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)
        key = (pass_name, is_causal, type(is_causal), scale, config, precision, *layouts)
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not tensors, an unhashable scale: check_inputs says which
        check_inputs(q, *tensors[1:3], is_causal, scale)
        raise
    if plan is None:
        if pass_name == "fwd":
            scale = check_inputs(q, *tensors[1:3], is_causal, scale)
            check_head_dim(q)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        head_dim = _padded_head_dim(q.shape[-1], q.element_size())
        block_d = _block_d(head_dim)
        seqlen_q, seqlen_k, batch_heads = q.shape[-2], tensors[1].shape[-2], q.shape[:-2].numel()
        table = forward_candidates if pass_name == "fwd" else backward_candidates
        candidates = table(block_d, q.element_size(), _interpreted())
        small = is_small_problem(batch_heads, seqlen_q, seqlen_k, q.shape[-1])
        seqlen_class, batch_heads_class = _size_class(max(seqlen_q, seqlen_k)), _size_class(batch_heads)
        if pass_name == "bwd" and small:  # host-bound: no atomic dQ (see there)
            candidates = [c for c in candidates if not c.atomic_dq] or candidates
        if pass_name == "fwd" and small and q.is_cuda:  # decided by the tuning key's size class
            candidates = with_split_key_tiles(candidates, seqlen_class, seqlen_class, batch_heads_class,
                                              _sm_count(q.device))  # fmt: skip
        hopper = not small and _hopper.supports(pass_name, q, tensors, head_dim)
        if hopper:  # after the default: untuned runs (FLASHATTN_TRITON_AUTOTUNE=0) keep the portable kernel,
            # and the tuner skips a Gluon build that another Triton version refuses
            candidates = candidates + (HOPPER_FORWARD if pass_name == "fwd" else HOPPER_BACKWARD)
        elif config is not None and config.hopper:
            dims = " or ".join(map(str, _hopper.HEAD_DIMS[pass_name]))
            raise ValueError(
                f"config {config}: the Hopper kernel runs 16-bit problems with head dim {dims}, Tq = Tk a "
                "multiple of 128, contiguous inputs, on sm_90 with Gluon, above the small-problem size; "
                f"not q {tuple(q.shape)} {q.dtype} on {q.device}"
            )
        tune_key = (pass_name, q.device, block_d, q.dtype, is_causal, precision, seqlen_class,
                    batch_heads_class, hopper)  # fmt: skip
        host = _host_descriptors(q.device)
        as_is = all(_is_kernel_view(t, head_dim) for t in tensors)
        plan = _plans[key] = _Plan(scale, host, small, as_is, head_dim, block_d, precision, candidates,
                                   tune_key, config)  # fmt: skip
    return plan


def _choose(run: Callable[[Config], None], candidates: list[Config], key: Any) -> Config:
    """The fastest candidate for `key` (timed with run(c) on first use, once per process, unless
    FLASHATTN_TRITON_AUTOTUNE=0 or under CUDA graph capture; the timings go to stderr with
    FLASHATTN_TRITON_AUTOTUNE_LOG=1), else the first."""
    config = _chosen.get(key)
    if config is not None:
        return config
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if len(candidates) > 1 and _autotune_enabled() and not capturing:
        from triton.testing import do_bench

        times = {}
        for candidate in candidates:
            try:
                times[candidate] = do_bench(lambda c=candidate: run(c), warmup=2, rep=10,
                                            return_mode="median")  # fmt: skip
            except Exception as exc:  # too big for this GPU, or a build this Triton refuses: not a candidate
                if not isinstance(exc, _out_of_resources()):  # anything else is a bug to show, not to stop on
                    message = f"{type(exc).__name__}: {str(exc)[:300]}"
                    warnings.warn(f"flashattn_triton: config {_describe(candidate)} failed while tuning, "
                                  f"skipped: {message}", RuntimeWarning, stacklevel=2)  # fmt: skip
                continue
        if times:
            config = _chosen[key] = min(times, key=times.get)
            if os.environ.get("FLASHATTN_TRITON_AUTOTUNE_LOG"):
                timings = ", ".join(f"{_describe(c)} {ms:.4f} ms" for c, ms in times.items())
                print(f"flashattn_triton tuned {key}: {timings} -> {_describe(config)}", file=sys.stderr)
    return config or candidates[0]


def _run(plan: _Plan, launcher: Callable[[Config], _Launcher | _LaunchPair],
         args: Callable[[Config], tuple], prologue: Callable[[], None] | None = None) -> Config:
    """Launch the plan's kernel with args(config), after prologue() (a launch it depends on, which may
    also clear what args made) once its arguments are built: the two then reach the GPU back to back, not
    a host's argument building apart (a large backward's descriptors took longer than its D preprocess
    ran). On the plan's first run the config is chosen (the plan's own, else tuned among its candidates)
    and its launcher made; a config that does not fit this GPU's shared memory steps down through
    smaller(). Returns the config that ran."""
    if plan.launch is None:
        if prologue is not None:  # the tuner's runs read what it makes (and run again before the launch)
            prologue()
        # One launcher per candidate, so that the timed calls after the first launch directly, as every
        # later call of the plan will: small problems would otherwise time the JIT's host work.
        launchers: dict[Config, _Launcher | _LaunchPair] = {}

        def run(c: Config) -> None:
            launchers.setdefault(c, launcher(c))(*args(c))

        if plan.config is None:
            plan.config = _choose(run, plan.candidates, plan.tune_key)
        plan.launch = launchers.get(plan.config) or launcher(plan.config)
    while True:
        try:
            kernel_args = args(plan.config)
            if prologue is not None:
                prologue()
            plan.launch(*kernel_args)
            return plan.config
        except _out_of_resources():
            plan.config = smaller(plan.config)
            if plan.config is None:
                raise
            plan.launch = launcher(plan.config)


@functools.cache
def _out_of_resources() -> type[Exception]:
    from triton.runtime.errors import OutOfResources

    return OutOfResources


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                   config: ForwardConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, L) from the Triton forward kernel (`config`, or the tuned choice); O is contiguous, L float32
    of shape q.shape[:-1]."""
    out, lse, _ = _forward(q, k, v, is_causal, scale, config)
    return out, lse


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
             config: ForwardConfig | None) -> tuple[torch.Tensor, torch.Tensor, _Plan]:
    """triton_forward's (O, L) and the plan that made them (its scale is the one used)."""
    kernels = _kernels()
    plan = _plan("fwd", q, (q, k, v), is_causal, scale, config)  # (checks a layout's first inputs)
    check_device(q)
    scale = plan.scale
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format), lse, plan
    host, head_dim, block_d = plan.host, plan.head_dim, plan.block_d
    q4, k4, v4 = _kernel_views(plan, (q, k, v))
    o4 = torch.empty(q4.shape, dtype=q.dtype, device=q.device)
    batch, heads, seqlen_q, _ = q4.shape
    seqlen_k = k4.shape[2]
    q_in, k_in = _kernel_inputs(plan, q4, k4)
    (v_in,) = _kernel_inputs(plan, v4, transposed=True)  # tf32x3 reads V transposed (see _kernels)
    v_transposed = plan.precision == "tf32x3"

    def launcher(c: ForwardConfig) -> _Launcher | _LaunchPair:
        tiles = -(-seqlen_q // c.block_m) * batch * heads
        if c.kv_splits > 1:
            combine_tiles = -(-seqlen_q // COMBINE_ROWS) * batch * heads
            return _LaunchPair(_Launcher(kernels.attn_fwd, (tiles, c.kv_splits), c),
                               _Launcher(kernels.attn_fwd_combine, (combine_tiles,), None))  # fmt: skip
        return _Launcher(_hopper.kernel("fwd") if c.hopper else kernels.attn_fwd, (tiles,), c)

    def args(c: ForwardConfig) -> tuple:
        if c.hopper:  # (_hopper.supports: contiguous inputs, T a multiple of 128)
            return _hopper.forward_args(q_in, k_in, v_in, o4, lse, c.block_m, c.block_n, c.num_stages,
                                        is_causal, scale)  # fmt: skip
        split = c.kv_splits > 1
        if split:  # float32 O and lse of each split, of whole query tiles (stored unmasked), for the combine
            rows = -(-seqlen_q // c.block_m) * c.block_m
            partials = _stream_buffer("partials", c.kv_splits * batch * heads * rows * (block_d + 1),
                                      torch.float32, q.device, _current_stream(q.device))  # fmt: skip
        main = (_tiles(q_in, c.block_m, block_d, host), _tiles(k_in, c.block_n, block_d, host),
                _tiles(v_in, *((block_d, c.block_n) if v_transposed else (c.block_n, block_d)), host),
                None if split else _tiles(o4, c.block_m, block_d, host), lse, partials if split else None,
                batch, heads, seqlen_q, seqlen_k, head_dim, scale * kernels.LOG2E,
                c.block_m, c.block_n, block_d, is_causal, plan.precision, split)  # fmt: skip
        if not split:
            return main
        return (*main, (partials, o4, lse, batch * heads, seqlen_q, rows, head_dim, c.kv_splits, COMBINE_ROWS,
                        block_d))  # fmt: skip

    with _device_guard(q):
        _run(plan, launcher, args)
    if plan.as_is or o4.shape == q.shape:
        return o4, lse, plan
    return o4[..., : q.shape[-1]].reshape(q.shape), lse, plan


def _gradient_buffers(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty dQ, dK, dV, each an allocation of its own: they are a custom op's outputs, which must not
    alias one another."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q4, k4, v4))


def _backward_plan(forward_plan: _Plan | None, tensors: tuple[torch.Tensor, ...], is_causal: bool,
                   scale: float, config: BackwardConfig | None) -> _Plan:
    """_plan of the backward, looked up through the forward's plan where there is one: the forward's
    key already holds q, k and v, and out and lse follow from it."""
    q, grad_out = tensors[0], tensors[-1]
    if forward_plan is None or config is not None:
        return _plan("bwd", q, tensors, is_causal, scale, config)
    key = (grad_out.stride(), grad_out.data_ptr() % 16 == 0, _input_precision(q.dtype))
    plan = forward_plan.backward_plans.get(key)
    if plan is None:
        plan = forward_plan.backward_plans[key] = _plan("bwd", q, tensors, is_causal, scale, None)
    return plan


def triton_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, is_causal: bool, scale: float,
                    config: BackwardConfig | None = None, *,
                    forward_plan: _Plan | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) from the Triton backward: D = rowsum(dO * O) (in a launch of its own unless the
    problem is small), then dK/dV and dQ in one launch (two for a split config). forward_plan: the plan
    of the forward that made out and lse from these q, k, v, which keeps this backward's plan for the
    layout of grad_out."""
    kernels = _kernels()
    if k.numel() == 0 or q.numel() == 0:  # no query sees any key: zero gradients
        return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    plan = _backward_plan(forward_plan, (q, k, v, out, grad_out), is_causal, scale, config)
    host, head_dim, block_d = plan.host, plan.head_dim, plan.block_d
    q4, k4, v4, o4, do4 = _kernel_views(plan, (q, k, v, out, grad_out))
    dq4, dk4, dv4 = _gradient_buffers(q4, k4, v4)
    batch, heads, seqlen_q, _ = q4.shape
    seqlen_k = k4.shape[2]
    # D = rowsum(dO * O): computed by the kernel itself for small problems (not from tf32x3's parts, which
    # would spill), else by a preprocess launch into `delta`.
    delta_from_o = plan.small and plan.precision != "tf32x3"
    delta = None if delta_from_o else torch.empty_like(lse)
    q_in, do_in, k_in, v_in = _kernel_inputs(plan, q4, do4, k4, v4)
    # dQ of the atomic variant: a float32 sum, zeroed before each run (by the preprocess where there is
    # one), padded to whole tiles of up to 128 rows so that its updates need no masks.
    dq_acc_rows = -(-seqlen_q // 128) * 128
    dq_acc = None

    def launcher(c: BackwardConfig) -> _Launcher | _LaunchPair:
        key_tiles, query_tiles = -(-seqlen_k // c.block_n), -(-seqlen_q // c.block_n)
        if c.split:
            dq = _Launcher(kernels.attn_bwd, (query_tiles * batch * heads,), dq_launch(c))
            return _LaunchPair(_Launcher(kernels.attn_bwd, (key_tiles * batch * heads,), c), dq)
        tiles = key_tiles if c.atomic_dq else max(key_tiles, query_tiles)
        return _Launcher(_hopper.kernel("bwd") if c.hopper else kernels.attn_bwd, (tiles * batch * heads,), c)

    def args(c: BackwardConfig) -> tuple:
        nonlocal dq_acc
        dq_acc = None
        if c.atomic_dq:
            dq_acc = (torch.zeros if delta is None else torch.empty)(batch, heads, dq_acc_rows, block_d,
                                                                      dtype=torch.float32, device=q.device)
        if c.hopper:  # (_hopper.supports: T a multiple of 128 and d = block_d, so dq_acc is (Z, H, T, d))
            return _hopper.backward_args(q_in, k_in, v_in, do_in, dk4, dv4, dq_acc, lse, delta, c.block_m,
                                         c.block_n, c.num_stages, is_causal, scale)  # fmt: skip
        if c.split:
            return (*phase_args(c, "dkdv"), phase_args(dq_launch(c), "dq"))
        return phase_args(c, "both")

    def phase_args(c: BackwardConfig, phase: str) -> tuple:
        step = [_tiles(t, c.block_m, block_d, host) for t in (q_in, do_in, k_in, v_in)]
        own = [_tiles(t, c.block_n, block_d, host) for t in (q_in, do_in, k_in, v_in, dq4, dk4, dv4)]
        # Hopper reduces dQ tiles with TMA; the interpreter and older GPUs with element atomics.
        accumulator = _tiles(dq_acc, c.block_m, block_d, host and q.is_cuda) if c.atomic_dq else None
        outs = [_tiles(o4, rows, block_d, host) if delta_from_o else None for rows in (c.block_m, c.block_n)]
        return (*step, *own, lse, delta, *outs, accumulator, batch, heads, seqlen_q, seqlen_k, head_dim,
                dq_acc_rows, scale * kernels.LOG2E, scale, c.block_m, c.block_n, block_d, is_causal,
                c.atomic_dq, delta_from_o, plan.precision, c.transposed_grads, phase)  # fmt: skip

    def preprocess() -> None:  # D, and the atomic variant's dQ sum zeroed
        rows = 64
        clears = dq_acc is not None
        launch = plan.preprocess.get(clears)
        if launch is None:
            grid = (batch * heads, -(-dq_acc_rows // rows))
            launch = plan.preprocess[clears] = _Launcher(kernels.attn_bwd_preprocess, grid, None)
        launch(o4, do4, delta, dq_acc, *o4.stride()[:3], *do4.stride()[:3], heads, seqlen_q, head_dim,
               dq_acc_rows, block_d, rows)  # fmt: skip

    with _device_guard(q):
        used = _run(plan, launcher, args, preprocess if delta is not None else None)
    if used.atomic_dq:
        dq4.copy_(dq_acc[:, :, :seqlen_q, :head_dim])
    if plan.as_is:
        return dq4, dk4, dv4
    return tuple(g if g.shape == t.shape else g[..., : t.shape[-1]].reshape(t.shape)
                 for g, t in zip((dq4, dk4, dv4), (q, k, v), strict=True))  # fmt: skip


class FlashAttentionTriton(AttentionFunction):
    """FlashAttention-2 forward and backward as Triton kernels: ``FlashAttentionTriton.apply(q, k, v)``.

    q: (..., Tq, d), k and v: (..., Tk, d) CUDA tensors with the same leading dims and dtype (float16,
    bfloat16 or float32), head dim up to 256. Saves Q, K, V, O and L (float32, shape q.shape[:-1]).
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        out, lse, plan = _forward(q, k, v, is_causal, scale, None)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.plan = plan
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        # once_differentiable only under create_graph=True, where its gradients must refuse a second
        # differentiation; elsewhere its wrapper is host time a small problem notices (PERF.md v16).
        return (_gradients_once if torch.is_grad_enabled() else _gradients)(ctx, grad_out)


def _gradients(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    plan = ctx.plan
    grads = triton_backward(q, k, v, out, lse, grad_out, ctx.is_causal, plan.scale, forward_plan=plan)
    return *grads, None, None


_gradients_once = once_differentiable(_gradients)
