"""FlashAttention-2 with Triton kernels: the plan of each problem layout, its launches, the autograd Function.

Triton is imported on first use, so ``import flashattn_triton`` works without it. The kernels run on
CUDA tensors; with ``TRITON_INTERPRET=1`` in the environment before they are first used, Triton's
interpreter runs them on CPU tensors instead (slowly: for testing).

A call's plan (made on the first call with its layout) holds the candidate configs (_planning), the one
chosen (_tuning) and its launchers (_launcher); later calls with the same layout only build the kernels'
arguments, by name, and launch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.autograd.function import once_differentiable

from flashattn_triton import _hopper, _inputs, _launcher
from flashattn_triton._autograd import AttentionFunction
from flashattn_triton._configs import BackwardConfig, ForwardConfig, dq_launch, smaller
from flashattn_triton._dropout import check_rng, kept_scale, threshold
from flashattn_triton._inputs import check_device, check_head_dim
from flashattn_triton._launcher import Launcher, LaunchPair, tiles
from flashattn_triton._planning import (
    Band,
    Problem,
    band_of,
    band_span,
    candidates,
    is_small_problem,
    kernel_band,
)
from flashattn_triton._tuning import TUNING
from flashattn_triton._validation import check_inputs, check_scale

COMBINE_ROWS = 32  # query rows a program of attn_fwd_combine
# The kernels' arguments of packed sequences, where there are none.
_NOT_PACKED = {"CuSeqlensQ": None, "CuSeqlensK": None, "VARLEN": False}


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


Config = TypeVar("Config", ForwardConfig, BackwardConfig)


@dataclasses.dataclass
class _Plan:
    """How one problem layout runs, worked out on its first call and reused by every later call with
    the same key: the descriptor mode, the problem and its candidate configs, the config chosen and its
    launchers. A forward's plan is made only for inputs that pass check_inputs; its key holds everything
    those checks read, so the checks are not repeated."""

    scale: float  # the softmax scale, checked (and defaulted) when the forward's plan was made
    host: bool
    as_is: bool  # every tensor is already what _inputs.kernel_view makes of it
    problem: Problem
    candidates: list
    config: Any = None
    launch: Launcher | LaunchPair | None = None
    preprocess: dict[bool, Launcher] = dataclasses.field(default_factory=dict)  # by whether it zeroes dQ
    splits: dict[tuple[int, bool], _inputs.TF32Split] = dataclasses.field(default_factory=dict)
    delta_from_o: bool = False  # the backward computes D = rowsum(dO * O) in its kernel
    # The kernels' mask and dropout arguments that the key fixes (CAUSAL, the band's, dropout's threshold
    # and scale): made once, not on every call; a call adds its Rng.
    mask_args: dict = dataclasses.field(default_factory=dict)
    # A forward's plans of the backward, by what their keys add to the forward's: the incoming gradient's
    # strides and alignment (autograd gives it the output's shape, dtype and device), the precision and
    # whether the backward is deterministic.
    backward_plans: dict = dataclasses.field(default_factory=dict)


_plans: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096  # a process seeing ever new lengths starts over rather than growing without bound


def _plan(pass_name: str, q: torch.Tensor, tensors: tuple[torch.Tensor, ...], is_causal: bool,
          scale: float | None, config: Any, deterministic: bool = False, grad_lse: bool = False,
          band: Band | None = None, dropout_p: float = 0.0, grouped: bool = False,
          varlen: tuple[int, int, int] | None = None) -> _Plan:  # fmt: skip
    """The plan of this call's layout: created, not yet run, on the first call with it (the forward's
    after checking its inputs). tensors starts with q and k (and v); grad_lse: whether the backward gets
    a gradient of L; band: band_of's. dropout_p is in the key as the scale is: its threshold and scale are
    arguments that the JIT specializes (by their size), which a plan's direct launches must keep.
    grouped: whether k and v may have fewer heads than q (checked with the inputs, so in the key:
    FlashAttentionTriton's calls refuse what triton_forward's accept). varlen: packed sequences' (batch,
    max_seqlen_q, max_seqlen_k), q (total_q, Hq, d) and k (total_k, Hkv, d), checked by the caller
    (_validation.varlen_op_arguments); tensors then end with cu_seqlens_q and cu_seqlens_k."""
    try:
        precision = _inputs.input_precision(q.dtype)
        layouts = ((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0) for t in tensors)
        key = (pass_name, is_causal, type(is_causal), scale, config, precision, deterministic, grad_lse, band,
               dropout_p, grouped, varlen, *layouts)  # fmt: skip
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not tensors, an unhashable scale: check_inputs says which
        check_inputs(q, *tensors[1:3], is_causal, scale, enable_gqa=grouped)
        raise
    if plan is None:
        if pass_name == "fwd" and varlen is None:
            scale = check_inputs(q, *tensors[1:3], is_causal, scale, enable_gqa=grouped)
        if pass_name == "fwd":
            scale = check_scale(scale, q.shape[-1])
            check_head_dim(q)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        head_dim = _inputs.padded_head_dim(q.shape[-1], q.element_size())
        if varlen is None:
            batch_heads, seqlen_q, seqlen_k = q.shape[:-2].numel(), q.shape[-2], tensors[1].shape[-2]
            heads, kv_heads = q.shape[-3], tensors[1].shape[-3]
        else:  # (total, H, d)
            (batch, seqlen_q, seqlen_k), heads, kv_heads = varlen, q.shape[1], tensors[1].shape[1]
            batch_heads = batch * heads
        group = 1 if heads == kv_heads else heads // kv_heads  # query heads per K/V head (none: 1)
        # (small problems never run the Gluon kernels: their first call need not import Gluon)
        hopper = (varlen is None and not is_small_problem(batch_heads, seqlen_q, seqlen_k, head_dim)
                  and _hopper.supports(pass_name, q, tensors, head_dim, band))  # fmt: skip
        problem = Problem(pass_name, batch_heads, seqlen_q, seqlen_k, head_dim, q.dtype, is_causal, precision,
                          _sm_count(q.device) if q.is_cuda else 0, _launcher.interpreted(), hopper,
                          deterministic, band_span(band, seqlen_q, seqlen_k), dropout_p > 0.0,
                          group, varlen is not None)  # fmt: skip
        if config is not None and config.hopper and not problem.uses_hopper:
            dims = " or ".join(map(str, _hopper.HEAD_DIMS[pass_name]))
            raise ValueError(
                f"config {config}: the Hopper kernel runs 16-bit problems with head dim {dims}, Tq = Tk a "
                "multiple of 128, K/V heads dividing the query heads, inputs in (B, H, T, d) or (B, T, H, d) "
                "memory, no window but a causal one, on sm_90 with Gluon, above the small-problem size, "
                "without dropout; "
                f"not q {tuple(q.shape)} {q.dtype} on {q.device}"
                + ("" if band is None else f" with window {band}")
                + f" with dropout_p={dropout_p}" * (dropout_p > 0.0)
            )
        as_is = all(_inputs.is_kernel_view(t, head_dim) for t in tensors)
        # D from O in the backward kernel for small problems (not from tf32x3's parts, which would spill;
        # not where a gradient of L joins D, which the preprocess path adds).
        delta_from_o = problem.small and precision != "tf32x3" and not grad_lse
        mask_args = {**kernel_band(band, seqlen_q, seqlen_k), "CAUSAL": is_causal and band is None,
                     "dropout_threshold": threshold(dropout_p), "dropout_scale": kept_scale(dropout_p),
                     "DROPOUT": dropout_p > 0.0}  # fmt: skip
        plan = _plans[key] = _Plan(scale, _inputs.host_descriptors(q.device), as_is, problem,
                                   candidates(problem), config, delta_from_o=delta_from_o,
                                   mask_args=mask_args)  # fmt: skip
    return plan


def _backward_plan(forward_plan: _Plan | None, tensors: tuple[torch.Tensor, ...], is_causal: bool,
                   scale: float, config: BackwardConfig | None, deterministic: bool, grad_lse: bool,
                   band: Band | None, dropout_p: float) -> _Plan:  # fmt: skip
    """_plan of the backward, looked up through the forward's plan where there is one: the forward's
    key already holds q, k and v (and the band and dropout_p), and out and lse follow from it (a small
    problem's host time notices the lookup of five layouts)."""
    q, grad_out = tensors[0], tensors[-1]
    if forward_plan is None or config is not None or grad_lse:
        return _plan("bwd", q, tensors, is_causal, scale, config, deterministic, grad_lse, band, dropout_p)
    key = (grad_out.stride(), grad_out.data_ptr() % 16 == 0, _inputs.input_precision(q.dtype), deterministic)
    plan = forward_plan.backward_plans.get(key)
    if plan is None:
        plan = _plan("bwd", q, tensors, is_causal, scale, None, deterministic, band=band, dropout_p=dropout_p)
        forward_plan.backward_plans[key] = plan
    return plan


def _kernel_views(plan: _Plan, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors as _inputs.kernel_view makes them: as they are where the plan says they already are."""
    if plan.as_is:
        return tensors
    return tuple(_inputs.kernel_view(t, plan.problem.head_dim, plan.host) for t in tensors)


def _kernel_inputs(plan: _Plan, *tensors: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, ...]:
    """The inputs as the kernels read them: as they are, or as TF32 parts under tf32x3 (made by each
    pass: saving the forward's for the backward would hold twice the inputs in between). Their TF32Splits
    are the plan's, one for each place of a pass's inputs: the plan's key fixes their layouts."""
    if plan.problem.precision != "tf32x3":
        return tensors
    parts = []
    with _launcher.device_guard(tensors[0]):
        for place, x4 in enumerate(tensors):
            split = plan.splits.get((place, transposed))
            if split is None:
                split = plan.splits[place, transposed] = _inputs.TF32Split(x4, transposed)
            parts.append(split(x4))
    return tuple(parts)


def _run(plan: _Plan, launcher: Callable[[Config], Launcher | LaunchPair], args: Callable[[Config], Any],
         device: torch.device, prologue: Callable[[], None] | None = None) -> Config:
    """Launch the plan's kernel with args(config), after prologue() (a launch it depends on, which may
    also clear what args made) once its arguments are built: the two then reach the GPU back to back, not
    a host's argument building apart (a large backward's descriptors took longer than its D preprocess
    ran). On the plan's first run the config is chosen (the plan's own, else the tuned choice among its
    candidates) and its launcher made; a config that does not fit this GPU's shared memory steps down
    through smaller(). Returns the config that ran."""
    if plan.launch is None:
        if prologue is not None:  # the tuner's runs read what it makes (and run again before the launch)
            prologue()
        # One launcher per candidate, so that the timed calls after the first launch directly, as every
        # later call of the plan will: small problems would otherwise time the JIT's host work.
        launchers: dict[Config, Launcher | LaunchPair] = {}

        def run(c: Config) -> None:
            launchers.setdefault(c, launcher(c))(args(c))

        if plan.config is None:
            plan.config = TUNING.choose(run, plan.candidates, plan.problem, device)
        plan.launch = launchers.get(plan.config) or launcher(plan.config)
    while True:
        try:
            kernel_args = args(plan.config)
            if prologue is not None:
                prologue()
            plan.launch(kernel_args)
            return plan.config
        except _launcher.out_of_resources():
            plan.config = smaller(plan.config)
            if plan.config is None:
                raise
            plan.launch = launcher(plan.config)


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                   config: ForwardConfig | None = None, *, window: tuple[int, int] | None = None,
                   dropout_p: float = 0.0,
                   rng_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O, L) from the Triton forward kernel (`config`, or the tuned choice); O dense in q's order of
    dims (_inputs.output_like: q's strides where q is dense, as SDPA's), L float32 of shape
    q.shape[:-1], the logsumexp of the scores without dropout. k and v may have fewer heads than q:
    grouped-query attention, q (..., Hq, Tq, d) and k, v (..., Hkv, Tk, d) with Hkv dividing Hq, query
    head h reading K/V head h // (Hq / Hkv). window=(left, right), -1 unbounded: query i sees keys
    i - left .. i + right only (and right = 0 under is_causal), top-left aligned; a row that sees no key
    gets O 0, L -inf. dropout_p > 0 drops probabilities as _dropout says, from rng_state
    (_dropout.draw_rng's (seed, offset) on q's device; a row's counters are its query head's)."""
    out, lse, _ = _forward(q, k, v, is_causal, scale, config, grouped=True, band=band_of(window, is_causal),
                           dropout_p=dropout_p, rng_state=rng_state)  # fmt: skip
    return out, lse


def _hopper_window(mask_args: dict[str, Any]) -> int | None:
    """The Gluon kernels' window: the left side of the band (its right is 0: _hopper.supports)."""
    return mask_args["window_left"] if mask_args["BAND"] else None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
             config: ForwardConfig | None, grouped: bool, band: Band | None = None, dropout_p: float = 0.0,
             rng_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, _Plan]:  # fmt: skip
    """triton_forward's (O, L) and the plan that made them (its scale is the one used); grouped: k and v
    may have fewer heads than q."""
    check_rng(dropout_p, rng_state)
    # (_plan checks a layout's first inputs)
    plan = _plan("fwd", q, (q, k, v), is_causal, scale, config, band=band, dropout_p=dropout_p,
                 grouped=grouped)  # fmt: skip
    check_device(q)
    kernels = _launcher.kernels()
    scale = plan.scale
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    out = _inputs.output_like(q)
    if q.numel() == 0:
        return out, lse, plan
    host, head_dim, block_d = plan.host, plan.problem.head_dim, plan.problem.block_d
    precision = plan.problem.precision
    q4, k4, v4 = _kernel_views(plan, (q, k, v))
    o4 = out if plan.as_is else _inputs.kernel_output(out, head_dim, host)
    batch, heads, seqlen_q, _ = q4.shape
    seqlen_k = k4.shape[2]
    group = plan.problem.group
    q_in, k_in = _kernel_inputs(plan, q4, k4)
    (v_in,) = _kernel_inputs(plan, v4, transposed=True)  # tf32x3 reads V transposed (see _kernels)
    v_transposed = precision == "tf32x3"
    mask_args = plan.mask_args

    def launcher(c: ForwardConfig) -> Launcher | LaunchPair:
        query_tiles = -(-seqlen_q // c.block_m) * batch * heads
        if c.kv_splits > 1:
            combine_tiles = -(-seqlen_q // COMBINE_ROWS) * batch * heads
            return LaunchPair(Launcher(kernels.attn_fwd, (query_tiles, c.kv_splits), c),
                              Launcher(kernels.attn_fwd_combine, (combine_tiles,)))  # fmt: skip
        return Launcher(_hopper.kernel("fwd") if c.hopper else kernels.attn_fwd, (query_tiles,), c)

    def args(c: ForwardConfig) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
        if c.hopper:  # (_hopper.supports: contiguous inputs, T a multiple of 128)
            return _hopper.forward_args(q_in, k_in, v_in, o4, lse, c.block_m, c.block_n, c.num_stages,
                                        is_causal, scale, _hopper_window(mask_args))  # fmt: skip
        split = c.kv_splits > 1
        partials = None
        if split:  # float32 O and lse of each split, of whole query tiles (stored unmasked), for the combine
            rows = -(-seqlen_q // c.block_m) * c.block_m
            partials = torch.empty(c.kv_splits * batch * heads * rows * (block_d + 1), dtype=torch.float32,
                                   device=q.device)
        v_tile = (block_d, c.block_n) if v_transposed else (c.block_n, block_d)
        # (dict literals: a call's host time notices dict(...) building its keyword arguments first)
        main = {
            "Q": tiles(q_in, c.block_m, block_d, host), "K": tiles(k_in, c.block_n, block_d, host),
            "V": tiles(v_in, *v_tile, host), "Out": None if split else tiles(o4, c.block_m, block_d, host),
            "L": lse, "Partials": partials, "batch": batch, "heads": heads, "group": group,
            "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "head_dim": head_dim,
            "qk_scale": scale * kernels.LOG2E, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_D": block_d,
            "INPUT_PRECISION": precision, "SPLIT_KV": split, "Rng": rng_state, **mask_args, **_NOT_PACKED,
        }  # fmt: skip
        if not split:
            return main
        return main, {
            "Partials": partials, "Out": o4, "L": lse, "batch_heads": batch * heads, "heads": heads,
            "seqlen_q": seqlen_q, "partial_rows": rows, "head_dim": head_dim, "stride_oz": o4.stride(0),
            "stride_oh": o4.stride(1), "stride_om": o4.stride(2), "SPLITS": c.kv_splits,
            "BLOCK_M": COMBINE_ROWS, "BLOCK_D": block_d,
        }  # fmt: skip

    with _launcher.device_guard(q):
        _run(plan, launcher, args, q.device)
    # (a copy only where the kernels could not write out in place: a head dim padded up to 16 bytes a row,
    # or a layout that kernel-built descriptors cannot describe)
    return _inputs.copy_back(out, o4), lse, plan


def triton_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, is_causal: bool, scale: float,
                    config: BackwardConfig | None = None, *, grad_lse: torch.Tensor | None = None,
                    deterministic: bool = False, forward_plan: _Plan | None = None,
                    share_allocation: bool = True, window: tuple[int, int] | None = None,
                    dropout_p: float = 0.0,
                    rng_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) from the Triton backward: D = rowsum(dO * O) (in a launch of its own unless the
    problem is small), then dK/dV and dQ in one launch (two for a split config); with fewer K/V heads than
    query heads (grouped-query attention), dK and dV per query head, summed over each group after.
    grad_lse, the gradient of L where it is used too, is subtracted from D (dS = P (dP - D + dL));
    deterministic leaves out the atomic dQ. forward_plan: the plan of the forward that made out and lse
    from these q, k, v, which keeps this backward's plan for the layout of grad_out. share_allocation: dQ,
    dK, dV may be slices of one allocation (not for a custom op, whose outputs must not alias one
    another). window: the forward's; dropout_p and rng_state: the forward's, whose mask the kernels draw
    again."""
    check_rng(dropout_p, rng_state)
    kernels = _launcher.kernels()
    band = band_of(window, is_causal)
    if k.numel() == 0 or q.numel() == 0:  # no query sees any key: zero gradients
        return tuple(_inputs.output_like(t).zero_() for t in (q, k, v))
    plan = _backward_plan(forward_plan, (q, k, v, out, grad_out), is_causal, scale, config, deterministic,
                          grad_lse is not None, band, dropout_p)  # fmt: skip
    host, head_dim, block_d = plan.host, plan.problem.head_dim, plan.problem.block_d
    precision, delta_from_o = plan.problem.precision, plan.delta_from_o
    q4, k4, v4, o4, do4 = _kernel_views(plan, (q, k, v, out, grad_out))
    batch, heads, seqlen_q, _ = q4.shape
    seqlen_k = k4.shape[2]
    group = plan.problem.group
    # The gradients in their inputs' layouts (_inputs.output_like), written in place where the kernels can
    # address them (as_is: contiguous 4-D inputs, so contiguous gradients).
    if share_allocation and plan.as_is and q.shape == k.shape:  # an allocation is host time a small problem
        grads = torch.empty((3, *q.shape), dtype=q.dtype, device=q.device).unbind()  # notices
    else:
        grads = tuple(_inputs.output_like(t) for t in (q, k, v))
    dq4, dk4, dv4 = grads if plan.as_is else (_inputs.kernel_output(g, head_dim, host) for g in grads)
    if group > 1:  # dK and dV of each query head until summed over the groups into dk4 and dv4
        sums = dk4, dv4
        dk4, dv4 = (torch.empty((batch, heads, *t.shape[2:]), dtype=t.dtype, device=t.device) for t in sums)
    delta = None if delta_from_o else torch.empty_like(lse)
    q_in, do_in, k_in, v_in = _kernel_inputs(plan, q4, do4, k4, v4)
    # dQ of the atomic variant: a float32 sum, zeroed before each run (by the preprocess where there is
    # one), padded to whole tiles of up to 128 rows so that its updates need no masks.
    dq_acc_rows = -(-seqlen_q // 128) * 128
    dq_acc = None
    mask_args = plan.mask_args

    def launcher(c: BackwardConfig) -> Launcher | LaunchPair:
        key_tiles, query_tiles = -(-seqlen_k // c.block_n), -(-seqlen_q // c.block_n)
        if c.split:
            dq = Launcher(kernels.attn_bwd, (query_tiles * batch * heads,), dq_launch(c))
            return LaunchPair(Launcher(kernels.attn_bwd, (key_tiles * batch * heads,), c), dq)
        programs = key_tiles if c.atomic_dq else max(key_tiles, query_tiles)
        kernel = _hopper.kernel("bwd") if c.hopper else kernels.attn_bwd
        return Launcher(kernel, (programs * batch * heads,), c)

    def args(c: BackwardConfig) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
        nonlocal dq_acc
        dq_acc = None
        if c.atomic_dq:
            dq_acc = (torch.zeros if delta is None else torch.empty)(batch, heads, dq_acc_rows, block_d,
                                                                      dtype=torch.float32, device=q.device)
        if c.hopper:  # (_hopper.supports: T a multiple of 128 and d = block_d, so dq_acc is (Z, H, T, d))
            return _hopper.backward_args(q_in, k_in, v_in, do_in, dk4, dv4, dq_acc, lse, delta, c.block_m,
                                         c.block_n, c.num_stages, is_causal, scale,
                                         _hopper_window(mask_args))  # fmt: skip
        if c.split:
            return phase_args(c, "dkdv"), phase_args(dq_launch(c), "dq")
        return phase_args(c, "both")

    def phase_args(c: BackwardConfig, phase: str) -> dict[str, Any]:
        steps, own = c.block_m, c.block_n
        return {
            "Q_S": tiles(q_in, steps, block_d, host), "DO_S": tiles(do_in, steps, block_d, host),
            "K_S": tiles(k_in, steps, block_d, host), "V_S": tiles(v_in, steps, block_d, host),
            "Q_T": tiles(q_in, own, block_d, host), "DO_T": tiles(do_in, own, block_d, host),
            "K_T": tiles(k_in, own, block_d, host), "V_T": tiles(v_in, own, block_d, host),
            "DQ": tiles(dq4, own, block_d, host), "DK": tiles(dk4, own, block_d, host),
            "DV": tiles(dv4, own, block_d, host), "L": lse, "Delta": delta,
            "O_S": tiles(o4, steps, block_d, host) if delta_from_o else None,
            "O_T": tiles(o4, own, block_d, host) if delta_from_o else None,
            # Hopper reduces dQ tiles with TMA; the interpreter and older GPUs with element atomics.
            "DQ_ACC": tiles(dq_acc, steps, block_d, host and q.is_cuda) if c.atomic_dq else None,
            "batch": batch, "heads": heads, "group": group, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
            "head_dim": head_dim, "dq_acc_rows": dq_acc_rows, "qk_scale": scale * kernels.LOG2E,
            "scale": scale, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_D": block_d,
            "ATOMIC_DQ": c.atomic_dq, "DELTA_FROM_O": delta_from_o, "INPUT_PRECISION": precision,
            "TRANSPOSED_GRADS": c.transposed_grads, "PHASE": phase, "Rng": rng_state, **mask_args,
            **_NOT_PACKED,
        }  # fmt: skip

    def preprocess() -> None:  # D (less the gradient of L), and the atomic variant's dQ sum zeroed
        rows = 64
        clears = dq_acc is not None
        launch = plan.preprocess.get(clears)
        if launch is None:
            grid = (batch * heads, -(-dq_acc_rows // rows))
            launch = plan.preprocess[clears] = Launcher(kernels.attn_bwd_preprocess, grid)
        stride_oz, stride_oh, stride_om = o4.stride()[:3]
        stride_dz, stride_dh, stride_dm = do4.stride()[:3]
        launch({
            "Out": o4, "DO": do4, "Delta": delta, "DQ_ACC": dq_acc, "stride_oz": stride_oz,
            "stride_oh": stride_oh, "stride_om": stride_om, "stride_dz": stride_dz, "stride_dh": stride_dh,
            "stride_dm": stride_dm, "heads": heads, "seqlen_q": seqlen_q, "head_dim": head_dim,
            "dq_acc_rows": dq_acc_rows, "BLOCK_D": block_d, "BLOCK_M": rows,
        })  # fmt: skip
        if grad_lse is not None:
            delta.sub_(grad_lse)

    with _launcher.device_guard(q):
        used = _run(plan, launcher, args, q.device, preprocess if delta is not None else None)
    if used.atomic_dq:
        dq4.copy_(dq_acc[:, :, :seqlen_q, :head_dim])
    if group > 1:
        dk4, dv4 = (_group_sums(g, group, s) for g, s in zip((dk4, dv4), sums, strict=True))
    if plan.as_is:
        return grads
    return tuple(_inputs.copy_back(g, g4) for g, g4 in zip(grads, (dq4, dk4, dv4), strict=True))


def supports_varlen(q: torch.Tensor, window: tuple[int, int] | None) -> bool:
    """Whether the tuned kernels take packed sequences of q's dtype: without a window, and not float32 at
    full accuracy (tf32x3's parts are laid out by batch; the feature kernels take those)."""
    return window is None and _inputs.input_precision(q.dtype) != "tf32x3"


def _packed_view(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Packed (total, H, d) x as the VARLEN kernels read it: contiguous, padded with zeros to head_dim."""
    if x.shape[-1] < head_dim:
        x = torch.nn.functional.pad(x, (0, head_dim - x.shape[-1]))
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _packed_output(out: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The contiguous (total, H, head_dim) that the VARLEN kernels write `out` (output_like's) through: out
    itself where it is contiguous and unpadded, else one that _inputs.copy_back copies into out."""
    return _inputs.kernel_output(out, head_dim, host=False)[0]  # (kernel-built descriptors: packed rows)


def _varlen_args(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> dict[str, Any]:
    return {"CuSeqlensQ": cu_seqlens_q, "CuSeqlensK": cu_seqlens_k, "VARLEN": True}


def triton_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                          scale: float | None, config: ForwardConfig | None = None, *, dropout_p: float = 0.0,
                          rng_state: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O, L) of packed sequences from attn_fwd's VARLEN path: flash-attn's layout, q (total_q, Hq, d), k
    and v (total_k, Hkv, d) with Hkv dividing Hq, sequence b the rows cu_seqlens[b]:cu_seqlens[b + 1]
    (int32, checked by the caller: _validation.varlen_op_arguments), max_seqlen_q/_k at least its longest.
    O (total_q, Hq, d) in q's layout (_inputs.output_like, as the fake implementation's), L float32
    (total_q, Hq); is_causal top-left within each sequence;
    dropout's counters those of _dropout.Dropout.packed. Only where supports_varlen; never split key
    tiles or the Gluon kernels. A sequence without keys gets O 0 and L -inf."""
    check_rng(dropout_p, rng_state)
    batch = cu_seqlens_q.numel() - 1
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # (indexed by z)
    plan = _plan("fwd", q, (q, k, v, cu_seqlens_q, cu_seqlens_k), is_causal, scale, config,
                 dropout_p=dropout_p, grouped=True, varlen=(batch, max_seqlen_q, max_seqlen_k))  # fmt: skip
    check_device(q)
    kernels = _launcher.kernels()
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    out = _inputs.output_like(q)
    if q.numel() == 0 or k.numel() == 0:  # no query sees any key
        return out.zero_(), lse.fill_(float("-inf"))
    head_dim, block_d = plan.problem.head_dim, plan.problem.block_d
    q3, k3, v3 = (_packed_view(t, head_dim) for t in (q, k, v))
    o3 = _packed_output(out, head_dim)
    heads = q.shape[1]
    shared = {"L": lse, "Partials": None, "batch": batch, "heads": heads, "group": plan.problem.group,
              "seqlen_q": max_seqlen_q, "seqlen_k": max_seqlen_k, "head_dim": head_dim,
              "qk_scale": plan.scale * kernels.LOG2E, "BLOCK_D": block_d,
              "INPUT_PRECISION": plan.problem.precision, "SPLIT_KV": False, "Rng": rng_state,
              **plan.mask_args, **_varlen_args(cu_seqlens_q, cu_seqlens_k)}  # fmt: skip

    def launcher(c: ForwardConfig) -> Launcher:
        return Launcher(kernels.attn_fwd, (-(-max_seqlen_q // c.block_m) * batch * heads,), c)

    def args(c: ForwardConfig) -> dict[str, Any]:
        # (the kernels build each sequence's descriptors: a host-built one would span every sequence)
        return {"Q": q3, "K": k3, "V": v3, "Out": o3, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, **shared}

    with _launcher.device_guard(q):
        _run(plan, launcher, args, q.device)
    return _inputs.copy_back(out, o3), lse


def triton_varlen_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, grad_out: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool,
                           scale: float, config: BackwardConfig | None = None, *,
                           grad_lse: torch.Tensor | None = None, deterministic: bool = False,
                           dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dQ, dK, dV) of triton_varlen_forward's problem, from attn_bwd's VARLEN path (as triton_backward:
    D = rowsum(dO * O) and grad_lse, the atomic dQ unless deterministic, dK and dV per query head summed
    over each group after), each in its input's layout as triton_varlen_forward's O."""
    check_rng(dropout_p, rng_state)
    batch = cu_seqlens_q.numel() - 1
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # (indexed by z)
    if k.numel() == 0 or q.numel() == 0 or batch == 0:  # no query sees any key: zero gradients
        return tuple(_inputs.output_like(t).zero_() for t in (q, k, v))
    plan = _plan("bwd", q, (q, k, v, out, grad_out, cu_seqlens_q, cu_seqlens_k), is_causal, scale, config,
                 deterministic, grad_lse is not None, dropout_p=dropout_p, grouped=True,
                 varlen=(batch, max_seqlen_q, max_seqlen_k))  # fmt: skip
    kernels = _launcher.kernels()
    head_dim, block_d, delta_from_o = plan.problem.head_dim, plan.problem.block_d, plan.delta_from_o
    q3, k3, v3, o3, do3 = (_packed_view(t, head_dim) for t in (q, k, v, out, grad_out))
    (total_q, heads, _), total_k = q3.shape, k3.shape[0]
    group = plan.problem.group
    grads = tuple(_inputs.output_like(t) for t in (q, k, v))
    dq3, dk3, dv3 = (_packed_output(g, head_dim) for g in grads)
    if group > 1:  # dK and dV of each query head until summed over the groups into dk3 and dv3
        sums = dk3, dv3
        dk3, dv3 = (torch.empty((total_k, heads, head_dim), dtype=t.dtype, device=t.device) for t in sums)
    lse_t = lse.t().contiguous()  # (H, total_q): each head's rows in a run, as the kernels read L and D
    delta = None if delta_from_o else torch.empty_like(lse_t)
    # The atomic dQ's float32 sum, (1, H, rows, block_d), rows those of the packed queries: a tile past a
    # sequence's end adds zeros up to 128 rows further.
    dq_acc_rows = -(-total_q // 128) * 128 + 128
    dq_acc = None
    shared = {"Q_S": q3, "DO_S": do3, "K_S": k3, "V_S": v3, "Q_T": q3, "DO_T": do3, "K_T": k3, "V_T": v3,
              "DQ": dq3, "DK": dk3, "DV": dv3, "L": lse_t, "Delta": delta,
              "O_S": o3 if delta_from_o else None, "O_T": o3 if delta_from_o else None,
              "batch": batch, "heads": heads, "group": plan.problem.group, "seqlen_q": max_seqlen_q,
              "seqlen_k": max_seqlen_k, "head_dim": head_dim, "dq_acc_rows": dq_acc_rows,
              "qk_scale": scale * kernels.LOG2E, "scale": scale, "BLOCK_D": block_d,
              "DELTA_FROM_O": delta_from_o, "INPUT_PRECISION": plan.problem.precision, "Rng": rng_state,
              **plan.mask_args, **_varlen_args(cu_seqlens_q, cu_seqlens_k)}  # fmt: skip

    def launcher(c: BackwardConfig) -> Launcher | LaunchPair:
        key_tiles, query_tiles = -(-max_seqlen_k // c.block_n), -(-max_seqlen_q // c.block_n)
        if c.split:
            dq = Launcher(kernels.attn_bwd, (query_tiles * batch * heads,), dq_launch(c))
            return LaunchPair(Launcher(kernels.attn_bwd, (key_tiles * batch * heads,), c), dq)
        programs = key_tiles if c.atomic_dq else max(key_tiles, query_tiles)
        return Launcher(kernels.attn_bwd, (programs * batch * heads,), c)

    def phase_args(c: BackwardConfig, phase: str) -> dict[str, Any]:
        # (Hopper reduces dQ tiles with TMA; the interpreter and older GPUs with element atomics)
        acc = tiles(dq_acc, c.block_m, block_d, plan.host and q.is_cuda) if c.atomic_dq else None
        return {"DQ_ACC": acc, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "ATOMIC_DQ": c.atomic_dq,
                "TRANSPOSED_GRADS": c.transposed_grads, "PHASE": phase, **shared}  # fmt: skip

    def args(c: BackwardConfig) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
        nonlocal dq_acc
        dq_acc = None
        if c.atomic_dq:
            dq_acc = (torch.zeros if delta is None else torch.empty)(1, heads, dq_acc_rows, block_d,
                                                                      dtype=torch.float32, device=q.device)
        if c.split:
            return phase_args(c, "dkdv"), phase_args(dq_launch(c), "dq")
        return phase_args(c, "both")

    def preprocess() -> None:  # D (less the gradient of L), and the atomic variant's dQ sum zeroed
        rows = 64
        clears = dq_acc is not None
        launch = plan.preprocess.get(clears)
        if launch is None:
            launch = plan.preprocess[clears] = Launcher(kernels.attn_bwd_preprocess,
                                                        (heads, -(-dq_acc_rows // rows)))  # fmt: skip
        row = heads * head_dim  # O and dO as (1, H, total_q, d): rows `row` apart
        launch({
            "Out": o3, "DO": do3, "Delta": delta, "DQ_ACC": dq_acc, "stride_oz": 0, "stride_oh": head_dim,
            "stride_om": row, "stride_dz": 0, "stride_dh": head_dim, "stride_dm": row,
            "heads": heads, "seqlen_q": total_q, "head_dim": head_dim, "dq_acc_rows": dq_acc_rows,
            "BLOCK_D": block_d, "BLOCK_M": rows,
        })  # fmt: skip
        if grad_lse is not None:
            delta.sub_(grad_lse.t())

    with _launcher.device_guard(q):
        used = _run(plan, launcher, args, q.device, preprocess if delta is not None else None)
    if used.atomic_dq:
        dq3.copy_(dq_acc[0, :, :total_q, :head_dim].transpose(0, 1))
    if group > 1:
        dk3, dv3 = (_group_sums(g, group, s) for g, s in zip((dk3, dv3), sums, strict=True))
    return tuple(_inputs.copy_back(g, g3) for g, g3 in zip(grads, (dq3, dk3, dv3), strict=True))


def _group_sums(grad: torch.Tensor, group: int, out: torch.Tensor) -> torch.Tensor:
    """dK or dV per query head, (Z, H, T, d) (or packed, (total, H, d)), summed over each group of `group`
    heads into out, (Z, H / group, T, d) (or (total, H / group, d)) of any strides (torch accumulates
    16-bit sums in float32 and rounds once)."""
    batch, heads, *rest = grad.shape
    return torch.sum(grad.view(batch, heads // group, group, *rest), 2, out=out)


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
        out, lse, plan = _forward(q, k, v, is_causal, scale, None, grouped=False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.plan = plan
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        # once_differentiable only under create_graph=True, where its gradients must refuse a second
        # differentiation; elsewhere its wrapper is host time a small problem notices
        # (decisions.md#once-differentiable).
        return (_gradients_once if torch.is_grad_enabled() else _gradients)(ctx, grad_out)


def _gradients(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    plan = ctx.plan
    grads = triton_backward(q, k, v, out, lse, grad_out, ctx.is_causal, plan.scale, forward_plan=plan,
                            deterministic=torch.are_deterministic_algorithms_enabled())  # fmt: skip
    return *grads, None, None


_gradients_once = once_differentiable(_gradients)
