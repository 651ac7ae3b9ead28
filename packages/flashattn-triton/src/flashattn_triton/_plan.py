"""A plan: how one problem layout runs, worked out on its first call and reused by every later call with the
same layout (triton_impl._plan makes them and keeps them by layout).

It holds the problem and its candidate configs (_planning), the config chosen (_tuning) and its launchers
(_launcher), and makes the tensors of a call what its kernels read: views (dense (Z, H, T, d), or packed
sequences' (total, H, d)) and, under tf32x3, float32's TF32 parts.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from flashattn_triton import _inputs, _launcher
from flashattn_triton._configs import BackwardConfig, ForwardConfig, smaller
from flashattn_triton._launcher import Launcher, LaunchPair
from flashattn_triton._planning import Problem
from flashattn_triton._tuning import TUNING

Config = TypeVar("Config", ForwardConfig, BackwardConfig)


class GroupSum:
    """Grouped-query attention's dK and dV of one layout: the backward's gradients of each query head, (Z, H,
    T, d) views sharing their strides, summed over each group of H / Hkv query heads into (Z, Hkv, T, d)
    views of any strides (unit along d), both in one launch of _kernels.group_sum. Its grid and every
    argument but the tensors are worked out once: a plan's key fixes all shapes and strides. tile_rows: the
    rows of a program's tiles (default: default_rows)."""

    # A program's loads of dK (and as many of dV), all issued before the first add (its group's tiles), and
    # its tile of the float32 sums: at most 64 KiB of 16-bit loads in flight and 32 KiB of sums, 42 to 112
    # registers a thread on sm_90 (4 warps), no spills.
    LOADS = 16384
    TILE = 4096

    @classmethod
    def default_rows(cls, group: int, block_d: int) -> int:
        """Rows of a program's tiles: the largest power of two within LOADS and TILE (16 rows at group 8
        and d = 128, 64 at group 4 and d = 64, 32 at group 2 and d = 128)."""
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
    """How one problem layout runs: the descriptor mode, the problem and its candidate configs, the config
    chosen and its launchers. A forward's plan is made only for inputs that pass check_inputs; its key
    holds everything those checks read, so the checks are not repeated."""

    scale: float  # the softmax scale, checked (and defaulted) when the forward's plan was made
    # The host builds the descriptors of inputs and outputs (_inputs.host_descriptors); never for packed
    # sequences, whose kernels describe each sequence's rows (a host-built descriptor would span them all).
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
    # The kernels' mask and dropout arguments that the key fixes (CAUSAL, the band's, dropout's threshold
    # and scale): made once, not on every call; a call adds its Rng.
    mask_args: dict = dataclasses.field(default_factory=dict)
    # A forward's plans of the backward, by what their keys add to the forward's: the incoming gradient's
    # strides and alignment (autograd gives it the output's shape, dtype and device), the precision and
    # whether the backward is deterministic.
    backward_plans: dict = dataclasses.field(default_factory=dict)

    def backward_plan(self, grad_out: torch.Tensor, deterministic: bool, make: Callable[[], Plan]) -> Plan:
        """The plan of this forward's backward, from backward_plans (made by make() the first time): the
        forward's key already holds q, k and v (and the band, dropout_p and packed sequences), and out and
        lse follow from it (a small problem's host time notices the lookup of five layouts)."""
        key = (grad_out.stride(), grad_out.data_ptr() % 16 == 0, _inputs.input_precision(grad_out.dtype),
               deterministic)  # fmt: skip
        plan = self.backward_plans.get(key)
        if plan is None:
            plan = self.backward_plans[key] = make()
        return plan

    def sizes(self, q: torch.Tensor) -> tuple[int, int, int, int]:
        """(batch, heads, seqlen_q, seqlen_k) of a call whose query's view is q ((Z, H, T, d), or packed
        (total, H, d), whose seqlens are the max_seqlens)."""
        heads = q.shape[1]
        return self.problem.batch_heads // heads, heads, self.problem.seqlen_q, self.problem.seqlen_k

    def views(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The tensors as the kernels address them (_inputs.kernel_view): as they are where the plan says
        they already are; packed sequences as (total, H, d), contiguous."""
        return self._kernel_tensors(_inputs.kernel_view, tensors)

    def outputs(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """What the kernels write each of tensors (output_like's) through (_inputs.kernel_output)."""
        return self._kernel_tensors(_inputs.kernel_output, tensors)

    def _kernel_tensors(self, make: Callable[[torch.Tensor, int, bool], torch.Tensor],
                        tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """make(t, head_dim, host) of each tensor, unless the plan says they already are what it makes;
        packed sequences' (1, total, H, d) as (total, H, d)."""
        if self.as_is:
            return tensors
        made = tuple(make(t, self.problem.head_dim, self.host) for t in tensors)
        return tuple(x[0] for x in made) if self.problem.varlen else made

    def inputs(self, *views: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, ...]:
        """The views as the kernels read them: as they are, or as TF32 parts under tf32x3 (made by each
        pass: saving the forward's for the backward would hold twice the inputs in between). Their
        TF32Splits are the plan's, one for each place of a pass's inputs: the plan's key fixes their
        layouts."""
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
        """Launch the plan's kernel with args(config), after prologue() (a launch it depends on, which may
        also clear what args made) once its arguments are built: the two then reach the GPU back to back,
        not a host's argument building apart (a large backward's descriptors took longer than its D
        preprocess ran). On the plan's first run the config is chosen (the plan's own, else the tuned
        choice among its candidates) and its launcher made; a config that does not fit this GPU's shared
        memory steps down through smaller(). Returns the config that ran."""
        if self.launch is None:
            if prologue is not None:  # the tuner's runs read what it makes (and run again before the launch)
                prologue()
            # One launcher per candidate, so that the timed calls after the first launch directly, as every
            # later call of the plan will: small problems would otherwise time the JIT's host work.
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
