"""The tuned Triton backend: the plan of each problem layout (``Plan``, made on its first call: candidate
configs from _configs, the choice from _tuning, launchers from _launcher), its launches, and the autograd
Function. Later calls with a layout only build the kernels' arguments and launch. One forward and one backward
serve (..., T, d) tensors and packed sequences (``Packed``). The kernels run on CUDA, or on CPU tensors in
Triton's interpreter with ``TRITON_INTERPRET=1`` set before first use.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch.autograd.function import once_differentiable

from flashattn_triton import _dispatch, _hopper, _inputs, _launcher
from flashattn_triton._configs import (
    BackwardConfig,
    Band,
    ForwardConfig,
    Problem,
    band_of,
    band_span,
    candidates,
    dq_launch,
    kernel_band,
    smaller,
)
from flashattn_triton._dropout import check_rng, kept_scale, threshold
from flashattn_triton._inputs import check_device, check_head_dim
from flashattn_triton._launcher import Launcher, LaunchPair, tiles
from flashattn_triton._tuning import TUNING
from flashattn_triton._validation import AttentionFunction, check_inputs, check_scale

COMBINE_ROWS = 32  # query rows a program of attn_fwd_combine


class Packed(NamedTuple):
    """Packed sequences (flash-attn's varlen layout, checked by _validation.varlen_op_arguments): sequence b
    the rows cu_seqlens[b]:cu_seqlens[b + 1], max_seqlen_q/_k at least its longest."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


_NOT_PACKED = {"CuSeqlensQ": None, "CuSeqlensK": None, "VARLEN": False}


def plan_parts(packed: Packed | None) -> tuple[tuple[torch.Tensor, ...], tuple[int, int, int] | None,
                                               dict[str, Any]]:  # fmt: skip
    """What packed sequences (or None) add to a plan: its tensors (the cu_seqlens, contiguous), its key's
    varlen (batch, max_seqlen_q, max_seqlen_k) and the kernels' arguments."""
    if packed is None:
        return (), None, _NOT_PACKED
    cu_seqlens_q, cu_seqlens_k = packed.cu_seqlens_q.contiguous(), packed.cu_seqlens_k.contiguous()
    varlen = (cu_seqlens_q.numel() - 1, packed.max_seqlen_q, packed.max_seqlen_k)
    return (cu_seqlens_q, cu_seqlens_k), varlen, {"CuSeqlensQ": cu_seqlens_q, "CuSeqlensK": cu_seqlens_k,
                                                  "VARLEN": True}  # fmt: skip


Config = TypeVar("Config", ForwardConfig, BackwardConfig)


class GroupSum:
    """Grouped-query attention's dK and dV of one layout, each query head's (Z, H, T, d), summed over each
    group into (Z, Hkv, T, d) views (unit stride along d) by one launch of _kernels.group_sum."""

    # A program's dK and dV loads in flight (16-bit elements) and its float32 sums: no spills on sm_90.
    LOADS = 16384
    TILE = 4096

    @classmethod
    def default_rows(cls, group: int, block_d: int) -> int:
        """Rows of a program's tiles: the largest power of two within LOADS and TILE."""
        return 1 << (max(1, min(cls.LOADS // group, cls.TILE) // block_d).bit_length() - 1)

    def __init__(self, per_head: torch.Tensor, sums: tuple[torch.Tensor, torch.Tensor], block_d: int,
                 tile_rows: int | None = None):  # fmt: skip
        batch, heads, seqlen, head_dim = per_head.shape
        kv_heads = sums[0].shape[1]
        rows = tile_rows or self.default_rows(heads // kv_heads, block_d)
        stride_z, stride_h, stride_t = per_head.stride()[:3]
        (stride_kz, stride_kh, stride_kt), (stride_vz, stride_vh, stride_vt) = (s.stride()[:3] for s in sums)
        self.args = dict(kv_heads=kv_heads, seqlen=seqlen, head_dim=head_dim, stride_z=stride_z,
                         stride_h=stride_h, stride_t=stride_t, stride_kz=stride_kz, stride_kh=stride_kh,
                         stride_kt=stride_kt, stride_vz=stride_vz, stride_vh=stride_vh, stride_vt=stride_vt,
                         GROUP=heads // kv_heads, BLOCK_T=rows, BLOCK_D=block_d)  # fmt: skip
        grid = (-(-seqlen // rows) * batch * kv_heads,)
        self.launch = _launcher.Launcher(_launcher.kernels().group_sum, grid)

    def __call__(self, per_head: tuple[torch.Tensor, torch.Tensor], sums: tuple[torch.Tensor, torch.Tensor],
                 ) -> None:  # fmt: skip
        """sums (dK, dV) = each group's sum of per_head (dK, dV)."""
        dk, dv = per_head
        dk_sum, dv_sum = sums
        self.launch({"DK": dk, "DV": dv, "DK_SUM": dk_sum, "DV_SUM": dv_sum, **self.args})


@dataclasses.dataclass
class Plan:
    """How one problem layout runs: descriptor mode, problem, candidates, the config chosen and its launchers.
    A forward's key holds all that check_inputs read."""

    scale: float  # the softmax scale, checked (and defaulted) when the forward's plan was made
    # The host builds the descriptors (_inputs.host_descriptors), never for packed sequences' (per sequence).
    host: bool
    tma_dq: bool  # the atomic dQ's float32 sum is reduced in TMA tiles (Hopper), else with element atomics
    as_is: bool  # every tensor is already what _inputs.kernel_view makes of it
    problem: Problem
    candidates: list
    config: Any = None
    launch: Launcher | LaunchPair | None = None
    preprocess: dict[bool, Launcher] = dataclasses.field(default_factory=dict)  # by whether it zeroes dQ
    splits: dict[tuple[int, bool], _inputs.TF32Split] = dataclasses.field(default_factory=dict)
    group_sum: GroupSum | None = None  # grouped-query attention's sums of dK and dV (the first backward's)
    delta_from_o: bool = False  # the backward computes D = rowsum(dO * O) in its kernel
    # The kernels' mask and dropout arguments, which the key fixes: made once (a call adds its Rng).
    mask_args: dict = dataclasses.field(default_factory=dict)
    # A forward's plans of the backward, by grad_out's strides and alignment, precision and determinism.
    backward_plans: dict = dataclasses.field(default_factory=dict)

    def backward_plan(self, grad_out: torch.Tensor, deterministic: bool, make: Callable[[], Plan]) -> Plan:
        """The plan of this forward's backward by grad_out's layout, made by make() the first time: the
        forward's key already fixes q, k, v, out and lse."""
        key = (grad_out.stride(), grad_out.data_ptr() % 16 == 0, _inputs.input_precision(grad_out.dtype),
               deterministic)  # fmt: skip
        plan = self.backward_plans.get(key)
        if plan is None:
            plan = self.backward_plans[key] = make()
        return plan

    def sizes(self, q: torch.Tensor) -> tuple[int, int, int, int]:
        """(batch, heads, seqlen_q, seqlen_k) of a call whose query's view is q (packed: the max_seqlens)."""
        heads = q.shape[1]
        return self.problem.batch_heads // heads, heads, self.problem.seqlen_q, self.problem.seqlen_k

    def views(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The tensors as the kernels address them (_inputs.kernel_view); packed sequences as (total, H, d).
        """
        return self._kernel_tensors(_inputs.kernel_view, tensors)

    def outputs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """What the kernels write each of tensors (output_like's) through (_inputs.kernel_output)."""
        return self._kernel_tensors(_inputs.kernel_output, tensors)

    def _kernel_tensors(self, make: Callable[[torch.Tensor, int, bool], torch.Tensor],
                        tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """make(t, head_dim, host) of each tensor unless the plan says they already are that; packed ones as
        (total, H, d)."""
        if self.as_is:
            return tensors
        made = tuple(make(t, self.problem.head_dim, self.host) for t in tensors)
        return tuple(x[0] for x in made) if self.problem.varlen else made

    def inputs(self, *views: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, ...]:
        """The views as the kernels read them: as they are, or as TF32 parts under tf32x3 (made by each pass,
        one TF32Split of the plan a place: saved, they would double the memory between the passes)."""
        if self.problem.precision != "tf32x3":
            return views
        parts = []
        with _launcher.device_guard(views[0]):
            for place, x4 in enumerate(views):
                split = self.splits.get((place, transposed))
                if split is None:
                    split = self.splits[place, transposed] = _inputs.TF32Split(x4, transposed)
                parts.append(split(x4))
        return tuple(parts)

    def run(self, launcher: Callable[[Config], Launcher | LaunchPair], args: Callable[[Config], Any],
            device: torch.device, prologue: Callable[[], None] | None = None) -> Config:  # fmt: skip
        """Launch the plan's kernel with args(config), after prologue() (a launch it depends on) once the
        arguments are built, so that the two reach the GPU back to back. On the first run the config is chosen
        (the plan's own, else the tuned choice) and its launcher made; a config too big for this GPU's shared
        memory steps down through smaller(). Returns the config that ran."""
        if self.launch is None:
            if prologue is not None:  # the tuner's runs read what it makes (and run again before the launch)
                prologue()
            # One launcher per candidate: timed calls then launch directly, as the plan's later calls will.
            launchers: dict[Config, Launcher | LaunchPair] = {}

            def run(c: Config) -> None:
                launchers.setdefault(c, launcher(c))(args(c))

            if self.config is None:
                self.config = TUNING.choose(run, self.candidates, self.problem, device)
            self.launch = launchers.get(self.config) or launcher(self.config)
        while True:
            try:
                kernel_args = args(self.config)
                if prologue is not None:
                    prologue()
                self.launch(kernel_args)
                return self.config
            except _launcher.out_of_resources():
                self.config = smaller(self.config)
                if self.config is None:
                    raise
                self.launch = launcher(self.config)
            except Exception as exc:  # a Gluon build another Triton refuses: the Triton-language kernels
                if not (self.config.hopper and self.candidates and not self.candidates[0].hopper):
                    raise
                warnings.warn(f"flashattn_triton: the Gluon kernel failed ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); running the Triton-language kernels", RuntimeWarning,
                              stacklevel=4)  # fmt: skip
                self.config = self.candidates[0]
                self.launch = launcher(self.config)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_plans: dict[tuple, Plan] = {}
_MAX_PLANS = 4096  # a process seeing ever new lengths starts over rather than growing without bound


def describe_problem(pass_name: str, q: torch.Tensor, tensors: tuple[torch.Tensor, ...], is_causal: bool,
                     band: Band | None, dropout_p: float, deterministic: bool,
                     varlen: tuple[int, int, int] | None, capability: tuple[int, int] | None | bool = False,
                     ) -> tuple[_dispatch.Description, Problem]:  # fmt: skip
    """The dispatch's Description of a tuned pass and the Problem its configs are chosen for. capability: a
    described device's (_dispatch.describe; its SM count an H100's)."""
    precision = _inputs.input_precision(q.dtype)
    head_dim = _inputs.padded_head_dim(q.shape[-1], q.element_size())
    layouts = tensors[:3] if pass_name == "fwd" else tensors[:5]  # (not cu_seqlens)
    window = _dispatch.window_of(band, is_causal)
    description = _dispatch.describe(pass_name, q, tensors[1], layouts, window=window,
                                     dropout=dropout_p > 0.0, varlen=varlen, deterministic=deterministic,
                                     capability=capability)  # fmt: skip
    seqlen_q, seqlen_k = description.seqlen_q, description.seqlen_k
    batch_heads = q.shape[:-2].numel() if varlen is None else varlen[0] * q.shape[1]  # (packed: total, H, d)
    hopper = _dispatch.choose(description) == _dispatch.GLUON
    if capability is False:
        sm_count, interpret = (_sm_count(q.device) if q.is_cuda else 0), _launcher.interpreted()
    else:
        sm_count, interpret = H100_SMS, False
    problem = Problem(pass_name, batch_heads, seqlen_q, seqlen_k, head_dim, q.dtype, is_causal, precision,
                      sm_count, interpret, hopper, deterministic, band_span(band, seqlen_q, seqlen_k),
                      dropout_p > 0.0, description.group, varlen is not None)  # fmt: skip
    return description, problem


H100_SMS = 132  # (an H200's too)


def _plan(pass_name: str, q: torch.Tensor, tensors: tuple[torch.Tensor, ...], is_causal: bool,
          scale: float | None, config: Any, deterministic: bool = False, grad_lse: bool = False,
          band: Band | None = None, dropout_p: float = 0.0, grouped: bool = False,
          varlen: tuple[int, int, int] | None = None) -> Plan:  # fmt: skip
    """The plan of this call's layout, made (not run) on its first call, the forward's after checking its
    inputs. tensors: q, k (and v, out, dO), then packed sequences' cu_seqlens; grad_lse: whether the backward
    gets a gradient of L; band: band_of's; dropout_p is in the key as the scale is (the JIT specializes their
    arguments); grouped: whether k and v may have fewer heads than q; varlen: plan_parts'."""
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
        description, problem = describe_problem(pass_name, q, tensors, is_causal, band, dropout_p,
                                                deterministic, varlen)  # fmt: skip
        head_dim = problem.head_dim
        if config is not None and config.hopper and not problem.hopper:
            raise ValueError(f"config {config}: the Gluon kernels do not run this problem: "
                             f"{_dispatch.why_not(_dispatch.GLUON, description)}")
        as_is = all(_inputs.is_kernel_view(t, head_dim) for t in tensors)
        # D from O in the backward kernel for small problems (not from tf32x3's parts; not with dL).
        delta_from_o = problem.small and precision != "tf32x3" and not grad_lse
        mask_args = {**kernel_band(band, problem.seqlen_q, problem.seqlen_k),
                     "CAUSAL": is_causal and band is None,
                     "dropout_threshold": threshold(dropout_p), "dropout_scale": kept_scale(dropout_p),
                     "DROPOUT": dropout_p > 0.0}  # fmt: skip
        host = _inputs.host_descriptors(q.device)
        plan = _plans[key] = Plan(scale, host and varlen is None, host and q.is_cuda, as_is, problem,
                                  candidates(problem), config, delta_from_o=delta_from_o,
                                  mask_args=mask_args)  # fmt: skip
    return plan


def triton_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
                   config: ForwardConfig | None = None, *, window: tuple[int, int] | None = None,
                   dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                   packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(O, L) from the Triton forward (`config`, or the tuned choice): O laid out as _inputs.output_like, L
    float32 of shape q.shape[:-1] (the logsumexp without dropout). k and v may have fewer heads than q
    (grouped-query attention). window=(left, right), -1 unbounded, top-left; dropout_p > 0 drops as _dropout
    says, from rng_state. packed: q, k, v are packed sequences (Packed; L (total_q, Hq)), run without split
    key tiles or the Gluon kernels."""
    out, lse, _ = _forward(q, k, v, is_causal, scale, config, grouped=True, band=band_of(window, is_causal),
                           dropout_p=dropout_p, rng_state=rng_state, packed=packed)  # fmt: skip
    return out, lse


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
             config: ForwardConfig | None, grouped: bool, band: Band | None = None, dropout_p: float = 0.0,
             rng_state: torch.Tensor | None = None,
             packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor, Plan]:  # fmt: skip
    """triton_forward's (O, L) and the plan that made them (its scale is the one used)."""
    check_rng(dropout_p, rng_state)
    cu_seqlens, varlen, packed_args = plan_parts(packed)
    # (_plan checks a layout's first inputs)
    plan = _plan("fwd", q, (q, k, v, *cu_seqlens), is_causal, scale, config, band=band, dropout_p=dropout_p,
                 grouped=grouped, varlen=varlen)  # fmt: skip
    check_device(q)
    kernels = _launcher.kernels()
    scale = plan.scale
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    out = _inputs.output_like(q)
    if q.numel() == 0 or k.numel() == 0:  # no query sees any key (packed sequences' only)
        return out.zero_(), lse.fill_(float("-inf")), plan
    host, head_dim, block_d = plan.host, plan.problem.head_dim, plan.problem.block_d
    precision = plan.problem.precision
    q4, k4, v4 = plan.views((q, k, v))
    (o4,) = plan.outputs((out,))
    batch, heads, seqlen_q, seqlen_k = plan.sizes(q4)
    group = plan.problem.group
    q_in, k_in = plan.inputs(q4, k4)
    (v_in,) = plan.inputs(v4, transposed=True)  # tf32x3 reads V transposed (see _kernels)
    v_transposed = precision == "tf32x3"
    mask_args = plan.mask_args

    def launcher(c: ForwardConfig) -> Launcher | LaunchPair:
        query_tiles = -(-seqlen_q // c.block_m) * batch * heads
        if c.kv_splits > 1:
            combine_tiles = -(-seqlen_q // COMBINE_ROWS) * batch * heads
            return LaunchPair(Launcher(kernels.attn_fwd, (query_tiles, c.kv_splits), c),
                              Launcher(kernels.attn_fwd_combine, (combine_tiles,)))  # fmt: skip
        if c.hopper:
            return _hopper.launcher("fwd", query_tiles, c, plan.problem.sm_count)
        return Launcher(kernels.attn_fwd, (query_tiles,), c)

    def args(c: ForwardConfig) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
        if c.hopper:  # (_dispatch: T a multiple of 128, heads where _hopper.head_layout finds them)
            sm_count = plan.problem.sm_count if c.persistent else None
            return _hopper.forward_args(q_in, k_in, v_in, o4, lse, c.block_m, c.block_n, c.num_stages,
                                        is_causal, scale, mask_args, sm_count)  # fmt: skip
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
            "INPUT_PRECISION": precision, "SPLIT_KV": split, "Rng": rng_state, **mask_args, **packed_args,
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
        plan.run(launcher, args, q.device)
    # (a copy only where the kernels could not write out in place)
    return _inputs.copy_back(out, o4), lse, plan


def triton_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    grad_out: torch.Tensor, is_causal: bool, scale: float,
                    config: BackwardConfig | None = None, *, grad_lse: torch.Tensor | None = None,
                    deterministic: bool = False, forward_plan: Plan | None = None,
                    share_allocation: bool = True, window: tuple[int, int] | None = None,
                    dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                    packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) from the Triton backward: D = rowsum(dO * O) (its own launch unless the problem is small),
    then dK/dV and dQ in one launch (two for a split config), grouped-query attention's dK, dV summed over
    each group after. grad_lse is subtracted from D (dS = P (dP - D + dL)); deterministic: no atomic dQ;
    forward_plan keeps this backward's plan; share_allocation: one allocation for the gradients (not in a
    custom op). window, dropout_p, rng_state, packed: the forward's."""
    check_rng(dropout_p, rng_state)
    kernels = _launcher.kernels()
    band = band_of(window, is_causal)
    if k.numel() == 0 or q.numel() == 0:  # no query sees any key: zero gradients
        return tuple(_inputs.output_like(t).zero_() for t in (q, k, v))
    cu_seqlens, varlen, packed_args = plan_parts(packed)
    make_plan = functools.partial(_plan, "bwd", q, (q, k, v, out, grad_out, *cu_seqlens), is_causal, scale,
                                  config, deterministic, grad_lse is not None, band, dropout_p, varlen=varlen)
    kept = forward_plan is not None and config is None and grad_lse is None  # (Plan.backward_plan)
    plan = forward_plan.backward_plan(grad_out, deterministic, make_plan) if kept else make_plan()
    host, head_dim, block_d = plan.host, plan.problem.head_dim, plan.problem.block_d
    precision, delta_from_o = plan.problem.precision, plan.delta_from_o
    q4, k4, v4, o4, do4 = plan.views((q, k, v, out, grad_out))
    batch, heads, seqlen_q, seqlen_k = plan.sizes(q4)
    group = plan.problem.group
    # The gradients in their inputs' layouts, written in place where the kernels can address them.
    if share_allocation and plan.as_is and q.shape == k.shape:  # an allocation is host time a small problem
        grads = torch.empty((3, *q.shape), dtype=q.dtype, device=q.device).unbind()  # notices
    else:
        grads = tuple(_inputs.output_like(t) for t in (q, k, v))
    dq4, dk4, dv4 = plan.outputs(grads)
    per_head = None  # with a group, dK and dV of each query head until summed over the groups into dk4, dv4

    def kv_targets(c: BackwardConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Where config c's kernel writes dK and dV: dk4 and dv4, or per query head (a group's sum after)."""
        nonlocal per_head
        if group == 1 or c.per_kv_head:
            return dk4, dv4
        if per_head is None:
            per_head = tuple(t.new_empty((t.shape[0], heads, *t.shape[2:])) for t in (dk4, dv4))
        return per_head
    # L, D and the atomic dQ's float32 sum as (runs, H, rows, ...): a run a batch element, or one for all
    # packed sequences. The sum is padded to whole 128-row tiles (packed: 128 more) so that its updates need
    # no masks.
    if packed is None:
        runs, rows, padding, dq_rows = batch, seqlen_q, 0, dq4
        o_strides, do_strides = o4.stride()[:3], do4.stride()[:3]
    else:
        runs, rows, padding, dq_rows = 1, q4.shape[0], 128, dq4.transpose(0, 1)[None]
        o_strides = do_strides = (0, head_dim, heads * head_dim)
        lse = lse.t().contiguous()  # (H, total_q)
        grad_lse = None if grad_lse is None else grad_lse.t()
    dq_acc_rows = -(-rows // 128) * 128 + padding
    delta = None if delta_from_o else torch.empty_like(lse)
    q_in, do_in, k_in, v_in = plan.inputs(q4, do4, k4, v4)
    dq_acc = None
    mask_args = plan.mask_args

    def launcher(c: BackwardConfig) -> Launcher | LaunchPair:
        key_tiles, query_tiles = -(-seqlen_k // c.block_n), -(-seqlen_q // c.block_n)
        if c.split:
            dq = Launcher(kernels.attn_bwd, (query_tiles * batch * heads,), dq_launch(c))
            return LaunchPair(Launcher(kernels.attn_bwd, (key_tiles * batch * heads,), c), dq)
        programs = (key_tiles if c.atomic_dq else max(key_tiles, query_tiles)) * batch * heads
        if c.hopper:
            if c.per_kv_head:  # a program a K/V head's tile
                programs //= group
            return _hopper.launcher("bwd", programs, c, plan.problem.sm_count)
        return Launcher(kernels.attn_bwd, (programs,), c)

    def args(c: BackwardConfig) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
        nonlocal dq_acc
        dq_acc = None
        if c.atomic_dq:
            dq_acc = (torch.zeros if delta is None else torch.empty)(runs, heads, dq_acc_rows, block_d,
                                                                      dtype=torch.float32, device=q.device)
        if c.hopper:  # (_dispatch: T a multiple of 128 and d = block_d, so dq_acc is (Z, H, T, d))
            sm_count = plan.problem.sm_count if c.persistent else None
            return _hopper.backward_args(q_in, k_in, v_in, do_in, *kv_targets(c), dq_acc, lse, delta,
                                         c.block_m, c.block_n, c.num_stages, is_causal, scale, mask_args,
                                         sm_count, c.per_kv_head, c.consumers)  # fmt: skip
        if c.split:
            return phase_args(c, "dkdv"), phase_args(dq_launch(c), "dq")
        return phase_args(c, "both")

    def phase_args(c: BackwardConfig, phase: str) -> dict[str, Any]:
        steps, own = c.block_m, c.block_n
        dk_out, dv_out = kv_targets(c)
        return {
            "Q_S": tiles(q_in, steps, block_d, host), "DO_S": tiles(do_in, steps, block_d, host),
            "K_S": tiles(k_in, steps, block_d, host), "V_S": tiles(v_in, steps, block_d, host),
            "Q_T": tiles(q_in, own, block_d, host), "DO_T": tiles(do_in, own, block_d, host),
            "K_T": tiles(k_in, own, block_d, host), "V_T": tiles(v_in, own, block_d, host),
            "DQ": tiles(dq4, own, block_d, host), "DK": tiles(dk_out, own, block_d, host),
            "DV": tiles(dv_out, own, block_d, host), "L": lse, "Delta": delta,
            "O_S": tiles(o4, steps, block_d, host) if delta_from_o else None,
            "O_T": tiles(o4, own, block_d, host) if delta_from_o else None,
            # Hopper reduces dQ tiles with TMA; the interpreter and older GPUs with element atomics.
            "DQ_ACC": tiles(dq_acc, steps, block_d, plan.tma_dq) if c.atomic_dq else None,
            "batch": batch, "heads": heads, "group": group, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
            "head_dim": head_dim, "dq_acc_rows": dq_acc_rows, "qk_scale": scale * kernels.LOG2E,
            "scale": scale, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_D": block_d,
            "ATOMIC_DQ": c.atomic_dq, "DELTA_FROM_O": delta_from_o, "INPUT_PRECISION": precision,
            "TRANSPOSED_GRADS": c.transposed_grads, "PHASE": phase, "Rng": rng_state, **mask_args,
            **packed_args,
        }  # fmt: skip

    def preprocess() -> None:  # D (less the gradient of L), and the atomic variant's dQ sum zeroed
        block_m = 64
        clears = dq_acc is not None
        launch = plan.preprocess.get(clears)
        if launch is None:
            grid = (runs * heads, -(-dq_acc_rows // block_m))
            launch = plan.preprocess[clears] = Launcher(kernels.attn_bwd_preprocess, grid)
        stride_oz, stride_oh, stride_om = o_strides
        stride_dz, stride_dh, stride_dm = do_strides
        launch({
            "Out": o4, "DO": do4, "Delta": delta, "DQ_ACC": dq_acc, "stride_oz": stride_oz,
            "stride_oh": stride_oh, "stride_om": stride_om, "stride_dz": stride_dz, "stride_dh": stride_dh,
            "stride_dm": stride_dm, "heads": heads, "seqlen_q": rows, "head_dim": head_dim,
            "dq_acc_rows": dq_acc_rows, "BLOCK_D": block_d, "BLOCK_M": block_m,
        })  # fmt: skip
        if grad_lse is not None:
            delta.sub_(grad_lse)

    with _launcher.device_guard(q):
        used = plan.run(launcher, args, q.device, preprocess if delta is not None else None)
        if group > 1 and not used.per_kv_head:  # each group's sum, in one launch
            summed, sums = per_head, (dk4, dv4)
            if packed is not None:  # (total_k, H, d) as (1, H, total_k, d)
                summed, sums = (tuple(t.transpose(0, 1)[None] for t in pair) for pair in (summed, sums))
            if plan.group_sum is None:
                plan.group_sum = GroupSum(summed[0], sums, block_d)
            plan.group_sum(summed, sums)
    if used.atomic_dq:
        dq_rows.copy_(dq_acc[:, :, :rows, :head_dim])
    if plan.as_is:
        return grads
    return tuple(_inputs.copy_back(g, g4) for g, g4 in zip(grads, (dq4, dk4, dv4), strict=True))


class FlashAttentionTriton(AttentionFunction):
    """FlashAttention-2 as Triton kernels: ``FlashAttentionTriton.apply(q, k, v)``, q (..., Tq, d), k and v
    (..., Tk, d) CUDA tensors with q's leading dims and dtype, head dim up to 256."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                scale: float | None = None) -> torch.Tensor:  # fmt: skip
        out, lse, plan = _forward(q, k, v, is_causal, scale, None, grouped=False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:  # fmt: skip
        # once_differentiable only where its gradients must refuse a second derivative (its wrapper costs).
        return (_gradients_once if torch.is_grad_enabled() else _gradients)(ctx, grad_out)


def _gradients(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    plan = ctx.plan
    grads = triton_backward(q, k, v, out, lse, grad_out, ctx.is_causal, plan.scale, forward_plan=plan,
                            deterministic=torch.are_deterministic_algorithms_enabled())  # fmt: skip
    return *grads, None, None


_gradients_once = once_differentiable(_gradients)
