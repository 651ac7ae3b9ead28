import math

import pytest
import torch
from torch import nn

from benchmarks.accounting import (
    XXL,
    FFNStack,
    Mesh,
    activation_bytes,
    best_integer_bucket_count,
    bucket_overhead,
    compute_bound_batch_per_device,
    fsdp_bytes_per_device,
    fsdp_tp_layer_times,
    main,
    min_batch_per_device_any_split,
    min_fsdp_devices,
    model_parameter_count,
    optimal_bucket_count,
    optimal_fsdp_degree,
    training_state_bytes,
)
from benchmarks.common import read_results
from benchmarks.model import TransformerLM, count_parameters, model_config

V5P = dict(flops=4.59e14, ici_bandwidth=1.8e11)


def ffn_stack_module(model: FFNStack) -> nn.Sequential:
    layers = []
    for _ in range(model.num_blocks):
        layers += [nn.Linear(model.d_model, model.d_ff, bias=False),
                   nn.Linear(model.d_ff, model.d_model, bias=False)]
    return nn.Sequential(*layers)


def test_parameter_and_saved_activation_counts_match_a_real_ffn_stack():
    model = FFNStack(d_model=8, d_ff=20, num_blocks=3)
    net = ffn_stack_module(model).to(torch.bfloat16)
    assert sum(p.numel() for p in net.parameters()) == model.params
    param_ptrs = {p.data_ptr() for p in net.parameters()}
    saved: list[torch.Tensor] = []
    tokens = 7
    x = torch.randn(tokens, model.d_model, dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        net(x).sum().backward()
    saved_bytes = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() not in param_ptrs)
    assert saved_bytes == activation_bytes(model, tokens)


def test_xxl_state_is_sixteen_bytes_per_parameter_and_about_44_h100s():
    p = 126 * 2 * 16384 * 53248
    assert XXL.params == p
    state = training_state_bytes(p)
    assert state == {"weights": 4 * p, "gradients": 4 * p, "optimizer": 8 * p}
    assert 43 < sum(state.values()) / 80e9 < 45
    # bf16 inputs of both linear layers of every block: 126 * (16384 + 53248) * 2 bytes per token
    assert activation_bytes(XXL, 1) == 17_547_264


def test_fsdp_memory_and_smallest_device_count():
    # state 100, activations 20: (100 + 10)/N + 10 < 30  <=>  N > 5.5
    assert fsdp_bytes_per_device(100, 20, 5) == 32
    assert min_fsdp_devices(100, 20, 30) == 6
    assert fsdp_bytes_per_device(100, 20, 6) < 30
    # exact division: 100/4 == 25 is not below 25
    assert min_fsdp_devices(100, 0, 25) == 5
    # the unsharded half of the activations alone is over capacity: no N helps
    assert min_fsdp_devices(100, 60, 30) is None
    with pytest.raises(ValueError, match="devices"):
        fsdp_bytes_per_device(100, 20, 0)


def test_fsdp_smallest_n_is_smallest_by_search():
    state = sum(training_state_bytes(XXL.params).values())
    acts = activation_bytes(XXL, 4096)
    n = min_fsdp_devices(state, acts, 95e9)
    fits = [k for k in range(1, 1000) if fsdp_bytes_per_device(state, acts, k) < 95e9]
    assert n == fits[0]


def test_fsdp_tp_compute_bound_batch_for_the_v5p_mesh():
    mesh = Mesh(fsdp=16, tensor=4, fsdp_axes=2, tensor_axes=1, **V5P)
    assert mesh.alpha == pytest.approx(2550)
    per_device = compute_bound_batch_per_device(mesh, XXL.d_ff)
    assert per_device == pytest.approx(2550 / (4 * 2))
    # at the threshold the matmuls take exactly as long as the FSDP gathers; the TP comms are shorter
    times = fsdp_tp_layer_times(mesh, per_device * 64, XXL.d_model, XXL.d_ff)
    assert times["math"] == pytest.approx(times["fsdp comms"])
    assert times["tp comms"] < times["math"]
    below = fsdp_tp_layer_times(mesh, 0.9 * per_device * 64, XXL.d_model, XXL.d_ff)
    assert max(below["fsdp comms"], below["tp comms"]) > below["math"]


def test_too_much_tensor_parallelism_is_never_compute_bound():
    mesh = Mesh(fsdp=2, tensor=32, fsdp_axes=2, tensor_axes=1, **V5P)  # 32 * 2550 > 53248
    assert compute_bound_batch_per_device(mesh, XXL.d_ff) is None


def test_best_split_floor_matches_a_search_over_fsdp_degrees():
    mesh = Mesh(fsdp=16, tensor=4, fsdp_axes=2, tensor_axes=1, **V5P)
    d, f, n = 1024, 8192, mesh.chips

    def compute_bound_with_some_split(per_device: float) -> bool:
        for x in (1 + i * (n - 1) / 4000 for i in range(4001)):
            split = Mesh(fsdp=x, tensor=n / x, fsdp_axes=2, tensor_axes=1, **V5P)
            t = fsdp_tp_layer_times(split, per_device * n, d, f)
            if max(t["fsdp comms"], t["tp comms"]) < t["math"]:
                return True
        return False

    floor = min_batch_per_device_any_split(mesh, f)
    assert floor == pytest.approx(2550**2 / (2 * f))
    assert compute_bound_with_some_split(1.02 * floor)
    assert not compute_bound_with_some_split(0.98 * floor)
    # the optimal FSDP degree balances the two kinds of communication
    x_opt = optimal_fsdp_degree(mesh, 1.5 * floor * n, f)
    t = fsdp_tp_layer_times(Mesh(x_opt, n / x_opt, 2, 1, **V5P), 1.5 * floor * n, d, f)
    assert t["fsdp comms"] == pytest.approx(t["tp comms"])


def test_bucket_model_optimum_by_brute_force():
    s, w, o = 8e9, 329e9, 50e-6
    n_star = optimal_bucket_count(s, w, o)
    assert s / n_star == pytest.approx(math.sqrt(s * w * o))
    assert bucket_overhead(s, w, o, n_star) == pytest.approx(2 * math.sqrt(s * o / w))
    best = min(range(1, 5000), key=lambda n: bucket_overhead(s, w, o, n))
    assert best_integer_bucket_count(s, w, o) == best
    for n in (0.5 * n_star, 2 * n_star):
        assert bucket_overhead(s, w, o, n) > bucket_overhead(s, w, o, n_star)
    # tiny models: one bucket is best, never zero buckets
    assert best_integer_bucket_count(1e3, 1e11, 1e-3) == 1
    with pytest.raises(ValueError):
        optimal_bucket_count(s, w, 0)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_parameter_count_formula_matches_the_model(size):
    with torch.device("meta"):
        model = TransformerLM(model_config(size))
    assert model_parameter_count(size) == count_parameters(model)


def test_main_writes_analytic_results_with_formulas(tmp_path):
    main(["--results-dir", str(tmp_path), "--tokens", "0,4096,100000", "--ddp-size", "small"])
    folder = tmp_path / "analytic"
    names = sorted(p.stem for p in folder.glob("*.csv"))
    assert names == ["accounting_constants", "accounting_ddp", "accounting_fsdp", "accounting_memory",
                     "accounting_tpu"]
    fsdp, meta = read_results(folder / "accounting_fsdp.csv")
    assert meta["device"] == "analytic"
    assert meta["command"].startswith("python -m benchmarks.accounting")
    rows = fsdp.set_index("symbol")
    assert rows.loc["N_min(T=0)", "value"] == 38  # ceil(3517.6 GB / 95 GB)
    assert math.isnan(rows.loc["N_min(T=100000)", "value"])  # A/2 = 877 GB > 95 GB
    assert all(("=" in f or "<" in f) for f in fsdp["formula"])
    constants, _ = read_results(folder / "accounting_constants.csv")
    assert constants["source"].notna().all()


def test_command_line_values_are_named_as_their_source(tmp_path):
    main(["--results-dir", str(tmp_path), "--flops", "9.18e14", "--ddp-size", "tiny"])
    constants, _ = read_results(tmp_path / "analytic" / "accounting_constants.csv")
    source = constants.set_index("symbol")["source"]
    assert source["C"] == "--flops on the command line"
    assert "How to Scale Your Model" in source["W_ici"]
    tpu, _ = read_results(tmp_path / "analytic" / "accounting_tpu.csv")
    assert tpu.set_index("symbol").loc["alpha", "value"] == pytest.approx(9.18e14 / 1.8e11)
