"""Memory and communication accounting: the XXL FFN stack, FSDP, a TPU v5p FSDP+TP mesh, DDP buckets.

Analytic, nothing is measured: every number is a formula of named constants, and each table
prints the formula beside its value. Results go to ``<results-dir>/analytic/accounting_*.csv``.

1. Memory of the XXL configuration on one device: fp32 master weights, gradients and AdamW's
   two moments (16 bytes per parameter), plus the bf16 activations saved for backward (no
   activation checkpointing), per token and for a few token counts (tokens = batch x context).
2. FSDP over N devices, with weights, gradients, optimizer state and half the activations sharded:
   the memory per device and the smallest N that fits a device's capacity.
3. A TPU v5p mesh with X-way FSDP and Y-way tensor parallelism: the per-device batch at which
   the forward pass becomes compute-bound (Austin et al., "How to Scale Your Model", 2025, Part 5).
4. Bucketed DDP: exposed communication o*n_b + (s/n_b)/w, its optimal bucket count and size.

Units: GB = 10^9 bytes, MB = 10^6 bytes; batches and contexts are counted in tokens.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TypeVar

import pandas as pd

from benchmarks.common import (
    int_list,
    make_parser,
    nonnegative_int_list,
    parse_args,
    positive_float,
    positive_int,
    print_table,
    save_results,
)
from benchmarks.model import MODEL_SIZES, model_config

TOUR_ARGS: list[str] = []
N = TypeVar("N", int, float)

GB = 1e9
MB = 1e6
BYTES_FP32 = 4
BYTES_BF16 = 2
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, each one fp32 value per parameter
SCALING_BOOK = "Austin et al., How to Scale Your Model (2025)"
CS336_XXL = "CS336 assignment 2, communication accounting (XXL)"


@dataclass(frozen=True)
class FFNStack:
    """A Transformer reduced to its feed-forward blocks: per block x @ W_in (D x F) then @ W_out (F x D)."""

    d_model: int
    d_ff: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def params(self) -> int:
        return self.num_blocks * 2 * self.d_model * self.d_ff

    @property
    def saved_elements_per_token(self) -> int:
        """Activations kept for backward per token: each linear layer's input (D for W_in, F for W_out)."""
        return self.num_blocks * (self.d_model + self.d_ff)


XXL = FFNStack(d_model=16384, d_ff=53248, num_blocks=126)


# --- memory ---------------------------------------------------------------------------------------

def training_state_bytes(params: int) -> dict[str, int]:
    """fp32 master weights, fp32 gradients and AdamW's fp32 moments, in bytes."""
    return {"weights": BYTES_FP32 * params, "gradients": BYTES_FP32 * params,
            "optimizer": ADAMW_MOMENTS * BYTES_FP32 * params}


def activation_bytes(model: FFNStack, tokens: int, bytes_per_element: int = BYTES_BF16) -> int:
    """Bytes saved for backward by a step over `tokens` tokens, without activation checkpointing."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return model.saved_elements_per_token * bytes_per_element * tokens


def fsdp_bytes_per_device(state_bytes: float, activation_bytes: float, devices: int) -> float:
    """Per-device bytes when the training state and half the activations are sharded over `devices`."""
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return (state_bytes + activation_bytes / 2) / devices + activation_bytes / 2


def min_fsdp_devices(state_bytes: float, activation_bytes: float, capacity_bytes: float) -> int | None:
    """The smallest N with fsdp_bytes_per_device(N) < capacity; None if the unsharded half cannot fit."""
    free = capacity_bytes - activation_bytes / 2
    if free <= 0:
        return None
    devices = max(1, math.ceil((state_bytes + activation_bytes / 2) / free))
    # ceil gives per-device == capacity on an exact division: the bound is strict.
    while fsdp_bytes_per_device(state_bytes, activation_bytes, devices) >= capacity_bytes:
        devices += 1
    return devices


# --- FSDP + tensor parallelism on a TPU mesh (How to Scale Your Model, Part 5) ---------------------

@dataclass(frozen=True)
class Mesh:
    """X-way FSDP over M_X mesh axes, Y-way tensor parallelism over M_Y axes; C FLOP/s, W_ici B/s per chip."""

    fsdp: int
    tensor: int
    fsdp_axes: int
    tensor_axes: int
    flops: float
    ici_bandwidth: float

    @property
    def chips(self) -> int:
        return self.fsdp * self.tensor

    @property
    def alpha(self) -> float:
        """The ICI arithmetic intensity C / W_ici (FLOPs per byte)."""
        return self.flops / self.ici_bandwidth


def fsdp_tp_layer_times(mesh: Mesh, batch_tokens: float, d_model: int, d_ff: int) -> dict[str, float]:
    """Forward-pass seconds per FFN block: matmuls, FSDP weight all-gathers, TP activation gather/scatter."""
    d, f, b = d_model, d_ff, batch_tokens
    return {
        "math": 2 * 2 * b * d * f / (mesh.chips * mesh.flops),
        "fsdp comms": 2 * 2 * d * f / (mesh.tensor * mesh.ici_bandwidth * mesh.fsdp_axes),
        "tp comms": 2 * 2 * b * d / (mesh.fsdp * mesh.ici_bandwidth * mesh.tensor_axes),
    }


def compute_bound_batch_per_device(mesh: Mesh, d_ff: int) -> float | None:
    """Tokens per chip above which max(T_fsdp, T_tp) < T_math; None if TP alone is comms-bound at any batch.

    T_fsdp < T_math  <=>  B/N > alpha / (Y * M_X);  T_tp < T_math  <=>  Y < F * M_Y / alpha (no B in it).
    """
    if mesh.tensor * mesh.alpha >= d_ff * mesh.tensor_axes:
        return None
    return mesh.alpha / (mesh.tensor * mesh.fsdp_axes)


def optimal_fsdp_degree(mesh: Mesh, batch_tokens: float, d_ff: int) -> float:
    """X_opt = sqrt(B/F * M_X/M_Y * N): the FSDP degree that equalises FSDP and TP comms at this batch."""
    return math.sqrt(batch_tokens / d_ff * mesh.fsdp_axes / mesh.tensor_axes * mesh.chips)


def min_batch_per_device_any_split(mesh: Mesh, d_ff: int) -> float:
    """alpha^2 / (M_X M_Y F): the smallest compute-bound tokens per chip with the best X, Y for each batch."""
    return mesh.alpha**2 / (mesh.fsdp_axes * mesh.tensor_axes * d_ff)


# --- bucketed DDP ---------------------------------------------------------------------------------

def bucket_overhead(total_bytes: float, bandwidth: float, call_overhead: float, buckets: float) -> float:
    """Seconds of communication not hidden behind backward: o*n_b + (s/n_b)/w (the last bucket waits)."""
    if buckets <= 0:
        raise ValueError(f"buckets must be positive, got {buckets}")
    return call_overhead * buckets + total_bytes / buckets / bandwidth


def optimal_bucket_count(total_bytes: float, bandwidth: float, call_overhead: float) -> float:
    """n_b* = sqrt(s / (w*o)), where d/dn_b (o*n_b + s/(n_b*w)) = 0."""
    if min(total_bytes, bandwidth, call_overhead) <= 0:
        raise ValueError("total_bytes, bandwidth and call_overhead must all be positive")
    return math.sqrt(total_bytes / (bandwidth * call_overhead))


def best_integer_bucket_count(total_bytes: float, bandwidth: float, call_overhead: float) -> int:
    """The whole bucket count (>= 1) with the least overhead: floor or ceil of n_b*, as the sum is convex."""
    n_star = optimal_bucket_count(total_bytes, bandwidth, call_overhead)
    candidates = {max(1, math.floor(n_star)), max(1, math.ceil(n_star))}
    return min(candidates, key=lambda n: bucket_overhead(total_bytes, bandwidth, call_overhead, n))


def model_parameter_count(size: str) -> int:
    """Parameters of the app's reference Transformer at `size`: 2 V D + L (4 D^2 + 3 D F + 2 D) + D.

    Embedding and LM head (V x D each), per block the attention projections (4 D^2), SwiGLU (3 D F)
    and two RMSNorm weights, and the final norm.
    """
    cfg = model_config(size)
    d, f = cfg.d_model, cfg.d_ff
    return 2 * cfg.vocab_size * d + cfg.num_layers * (4 * d * d + 3 * d * f + 2 * d) + d


# --- tables ---------------------------------------------------------------------------------------

def _row(symbol: str, quantity: str, formula: str, value: float, unit: str) -> dict[str, object]:
    return {"symbol": symbol, "quantity": quantity, "formula": formula, "value": value, "unit": unit}


def memory_table(model: FFNStack, tokens: list[int], h100_bytes: float) -> pd.DataFrame:
    p = model.params
    state = training_state_bytes(p)
    total_state = sum(state.values())
    per_token = activation_bytes(model, 1)
    rows = [
        _row("P", "parameters", "P = L * 2 * D * F", p, "parameters"),
        _row("W", "fp32 master weights", "W = 4 B * P", state["weights"] / GB, "GB"),
        _row("G", "fp32 gradients", "G = 4 B * P", state["gradients"] / GB, "GB"),
        _row("O", "AdamW state (2 fp32 moments)", "O = 2 * 4 B * P", state["optimizer"] / GB, "GB"),
        _row("S", "weights + gradients + optimizer", "S = W + G + O = 16 B * P", total_state / GB, "GB"),
        _row("S/H100", "S in H100-80GB units", "S / 80 GB", total_state / h100_bytes, "H100s"),
        _row("a", "bf16 activations saved per token", "a = L * (D + F) * 2 B", per_token / MB, "MB/token"),
    ]
    for t in tokens:
        acts = activation_bytes(model, t)
        rows += [
            _row(f"A(T={t})", f"activations, {t} tokens", f"A = a * T, T = {t}", acts / GB, "GB"),
            _row(f"M1(T={t})", f"one device, {t} tokens", "M1 = S + A", (total_state + acts) / GB, "GB"),
            _row(f"M1/H100(T={t})", f"one device, {t} tokens, in H100s", "M1 / 80 GB",
                 (total_state + acts) / h100_bytes, "H100s"),
        ]
    return pd.DataFrame(rows)


def fsdp_table(model: FFNStack, tokens: list[int], capacity_bytes: float) -> pd.DataFrame:
    state = sum(training_state_bytes(model.params).values())
    cap = f"{capacity_bytes / GB:g} GB"
    rows = []
    for t in dict.fromkeys([0, *tokens]):  # T = 0: the training state alone
        acts = activation_bytes(model, t)
        n = min_fsdp_devices(state, acts, capacity_bytes)
        what = f"{t} tokens" if t else "training state only"
        if n is None:
            rows.append(_row(f"N_min(T={t})", f"smallest N, {what}: none, A/2 alone exceeds {cap}",
                             f"A/2 = {acts / 2 / GB:.1f} GB >= {cap}", float("nan"), "devices"))
            continue
        rows += [
            _row(f"N_min(T={t})", f"smallest N, {what}", f"smallest N with (S + A/2)/N + A/2 < {cap}",
                 n, "devices"),
            _row(f"M_N(T={t})", f"per device at N_min, {what}", "M_N = (S + A/2)/N + A/2",
                 fsdp_bytes_per_device(state, acts, n) / GB, "GB"),
        ]
    return pd.DataFrame(rows)


def tpu_table(model: FFNStack, mesh: Mesh) -> pd.DataFrame:
    x, y, f = mesh.fsdp, mesh.tensor, model.d_ff
    rows = [
        _row("N", "chips", "N = X * Y", mesh.chips, "chips"),
        _row("alpha", "ICI arithmetic intensity", "alpha = C / W_ici", mesh.alpha, "FLOP/byte"),
        _row("Y_max", "largest compute-bound TP degree", "T_tp < T_math <=> Y < F * M_Y / alpha",
             f * mesh.tensor_axes / mesh.alpha, "chips"),
    ]
    per_device = compute_bound_batch_per_device(mesh, f)
    if per_device is None:
        rows.append(_row("B/N", f"no batch is compute-bound: Y = {y} >= F * M_Y / alpha",
                         "T_tp >= T_math for every B", float("nan"), "tokens/chip"))
        return pd.DataFrame(rows)
    batch = per_device * mesh.chips
    times = fsdp_tp_layer_times(mesh, batch, model.d_model, f)
    floor_per_device = min_batch_per_device_any_split(mesh, f)
    rows += [
        _row("B/N", f"compute-bound tokens per chip (X={x}, Y={y})",
             "T_fsdp < T_math <=> B/N > alpha / (Y * M_X)", per_device, "tokens/chip"),
        _row("B", "overall batch at that point", "B = N * alpha / (Y * M_X)", batch, "tokens"),
        _row("T_math", "matmul time per block at B", "T_math = 4 B D F / (N C)", times["math"] * 1e3, "ms"),
        _row("T_fsdp", "FSDP all-gather time per block", "T_fsdp = 4 D F / (Y W_ici M_X)",
             times["fsdp comms"] * 1e3, "ms"),
        _row("T_tp", "TP all-gather + reduce-scatter per block at B", "T_tp = 4 B D / (X W_ici M_Y)",
             times["tp comms"] * 1e3, "ms"),
        _row("X_opt", "comms-minimising FSDP degree at B", "X_opt = sqrt(B/F * M_X/M_Y * N)",
             optimal_fsdp_degree(mesh, batch, f), "chips"),
        _row("(B/N)_min", "compute-bound tokens per chip with the best X, Y",
             "B/N > alpha^2 / (M_X M_Y F)", floor_per_device, "tokens/chip"),
        _row("B_min", "overall batch with the best X, Y", "B = N * alpha^2 / (M_X M_Y F)",
             floor_per_device * mesh.chips, "tokens"),
    ]
    return pd.DataFrame(rows)


def ddp_table(size: str, bandwidth: float, overheads_us: list[int]) -> pd.DataFrame:
    cfg = MODEL_SIZES[size]
    params = model_parameter_count(size)
    s = BYTES_FP32 * params
    shape = f"V={cfg.vocab_size}, D={cfg.d_model}, F={cfg.d_ff}, L={cfg.num_layers}"
    rows = [
        _row("P_ddp", f"parameters of the {size} Transformer ({shape})",
             "P = 2 V D + L (4 D^2 + 3 D F + 2 D) + D", params, "parameters"),
        _row("s", "fp32 gradient bytes all-reduced per step", "s = 4 B * P", s / GB, "GB"),
        _row("t_1", "exposed comms, one bucket", "t_1 = o + s / w ~ s / w", s / bandwidth * 1e3, "ms"),
    ]
    for us in overheads_us:
        o = us * 1e-6
        n_star = optimal_bucket_count(s, bandwidth, o)
        n_int = best_integer_bucket_count(s, bandwidth, o)
        rows += [
            _row(f"n_b*(o={us}us)", f"optimal bucket count, o = {us} us", "n_b* = sqrt(s / (w o))", n_star,
                 "buckets"),
            _row(f"size*(o={us}us)", f"optimal bucket size, o = {us} us", "s / n_b* = sqrt(s w o)",
                 s / n_star / MB, "MB"),
            _row(f"t*(o={us}us)", f"least exposed comms, o = {us} us", "o n_b* + s/(n_b* w) = 2 sqrt(s o/w)",
                 bucket_overhead(s, bandwidth, o, n_star) * 1e3, "ms"),
            _row(f"n_int(o={us}us)", f"best whole bucket count, o = {us} us",
                 "argmin over floor/ceil of n_b*", n_int, "buckets"),
        ]
    return pd.DataFrame(rows)


def constants_table(args: argparse.Namespace, defaults: argparse.Namespace, model: FFNStack) -> pd.DataFrame:
    def source(name: str, default_source: str) -> str:
        given = getattr(args, name) != getattr(defaults, name)
        return f"--{name.replace('_', '-')} on the command line" if given else default_source

    ddp_source = ("NCCL all-reduce bus bandwidth at 1 GB measured on 2 H200s (issue 5); algorithm bandwidth "
                  "equals bus bandwidth at 2 ranks")
    rows = [
        ("D", "d_model", model.d_model, "", CS336_XXL),
        ("F", "d_ff", model.d_ff, "", CS336_XXL),
        ("L", "FFN blocks (two linear layers each, no attention)", model.num_blocks, "", CS336_XXL),
        ("4 B", "bytes per fp32 value (weights, gradients, AdamW moments)", BYTES_FP32, "bytes", "IEEE 754"),
        ("2 B", "bytes per bf16 value (activations, communication)", BYTES_BF16, "bytes", "bfloat16"),
        ("80 GB", "H100 memory", args.h100_gb, "GB", source("h100_gb", "NVIDIA H100 SXM5 80GB datasheet")),
        ("cap", "device capacity for FSDP", args.capacity_gb, "GB",
         source("capacity_gb", f"{CS336_XXL}: one TPU v5p (96 GB HBM in {SCALING_BOOK}, Part 2)")),
        ("X", "FSDP degree", args.mesh_fsdp, "chips", source("mesh_fsdp", CS336_XXL)),
        ("Y", "tensor-parallel degree", args.mesh_tensor, "chips", source("mesh_tensor", CS336_XXL)),
        ("M_X", "mesh axes used by FSDP", args.fsdp_axes, "axes",
         source("fsdp_axes", f"{CS336_XXL}; {SCALING_BOOK}, Part 5 (M_X M_Y = 2 on a 3D mesh)")),
        ("M_Y", "mesh axes used by TP", args.tensor_axes, "axes", source("tensor_axes", CS336_XXL)),
        ("C", "TPU v5p bf16 FLOP/s per chip", args.flops, "FLOP/s",
         source("flops", f"{SCALING_BOOK}, Part 2, TPU specs table")),
        ("W_ici", "TPU v5p ICI bytes/s per link, bidirectional (2 x 9e10 one-way)", args.ici_bandwidth, "B/s",
         source("ici_bandwidth", f"{SCALING_BOOK}, Part 2 table; Part 5 uses the bidirectional figure")),
        ("w", "all-reduce bandwidth (bytes / all-reduce time)", args.ddp_bandwidth_gbps, "GB/s",
         source("ddp_bandwidth_gbps", ddp_source)),
        ("o", "per-all-reduce overhead (launch + latency + hook)", ",".join(map(str, args.ddp_overhead_us)),
         "us", source("ddp_overhead_us", "assumed: NCCL small-message latency on NVLink is ~10-30 us; "
                      "fit it from benchmarks.allreduce (time = o + bytes / w)")),
    ]
    return pd.DataFrame(rows, columns=["symbol", "meaning", "value", "unit", "source"])


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("accounting", __doc__)
    parser.add_argument("--tokens", type=nonnegative_int_list, default="1024,4096,8192,16384",
                        help="tokens per step (batch x context) for the activation memory")
    parser.add_argument("--h100-gb", type=positive_float, default=80.0, help="memory of one H100, GB")
    parser.add_argument("--capacity-gb", type=positive_float, default=95.0,
                        help="per-device memory the FSDP configuration must stay below, GB")
    parser.add_argument("--mesh-fsdp", type=positive_int, default=16, help="X: FSDP degree of the TPU mesh")
    parser.add_argument("--mesh-tensor", type=positive_int, default=4, help="Y: tensor-parallel degree")
    parser.add_argument("--fsdp-axes", type=positive_int, default=2, help="M_X: mesh axes used by FSDP")
    parser.add_argument("--tensor-axes", type=positive_int, default=1, help="M_Y: mesh axes used by TP")
    parser.add_argument("--flops", type=positive_float, default="4.59e14", help="C: bf16 FLOP/s per chip")
    parser.add_argument("--ici-bandwidth", type=positive_float, default="1.8e11",
                        help="W_ici: bidirectional ICI bytes/s per link")
    parser.add_argument("--ddp-size", choices=list(MODEL_SIZES), default="xl",
                        help="reference model whose fp32 gradients the DDP bucket model all-reduces")
    parser.add_argument("--ddp-bandwidth-gbps", type=positive_float, default=329.0,
                        help="w: all-reduce bandwidth, GB/s")
    parser.add_argument("--ddp-overhead-us", type=int_list, default="10,50,200",
                        help="o: per-all-reduce overheads to evaluate, microseconds")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    mesh = Mesh(fsdp=args.mesh_fsdp, tensor=args.mesh_tensor, fsdp_axes=args.fsdp_axes,
                tensor_axes=args.tensor_axes, flops=args.flops, ici_bandwidth=args.ici_bandwidth)
    tables = {
        "accounting_constants": ("Constants", constants_table(args, parser.parse_args([]), XXL)),
        "accounting_memory": ("XXL memory on one device (fp32 state, bf16 activations)",
                              memory_table(XXL, args.tokens, args.h100_gb * GB)),
        "accounting_fsdp": (f"FSDP: smallest N below {args.capacity_gb:g} GB per device",
                            fsdp_table(XXL, args.tokens, args.capacity_gb * GB)),
        "accounting_tpu": (f"TPU v5p mesh X={mesh.fsdp} (FSDP) x Y={mesh.tensor} (TP): when the forward is "
                           "compute-bound", tpu_table(XXL, mesh)),
        "accounting_ddp": (f"Bucketed DDP, {args.ddp_size} model, w = {args.ddp_bandwidth_gbps:g} GB/s",
                           ddp_table(args.ddp_size, args.ddp_bandwidth_gbps * GB, args.ddp_overhead_us)),
    }
    for name, (title, df) in tables.items():
        print_table(df, title, float_format="{:.5g}")
        save_results(df, name, args, metadata={"device": "analytic", "gpu_count": "0"})


if __name__ == "__main__":
    main()
