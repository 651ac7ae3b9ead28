import math

import pytest
import torch

import profkit
from profkit.kernels import (
    COLUMNS,
    OUTSIDE,
    TraceEvent,
    events_from_chrome,
    events_from_kineto,
    is_matmul,
    summarize_kernels,
    trace_events,
)
from profkit.traces import load_trace


def ranges(*spans):
    return [TraceEvent(name, "range", start, end - start) for name, start, end in spans]


def kernel(name, launch, duration, start=None):
    # A kernel runs after its launch; attribution must use the launch time.
    return TraceEvent(name, "kernel", start if start is not None else launch + 5, duration, thread=7,
                      launch_ns=launch)


def test_kernels_are_attributed_to_the_phase_enclosing_their_launch():
    events = ranges(("forward", 0, 100), ("backward", 100, 300), ("optimizer", 300, 400))
    events += [
        kernel("sm90_xmma_gemm_f32", 10, 40),
        kernel("sm90_xmma_gemm_f32", 20, 20),
        kernel("elementwise_kernel", 30, 10),
        # launched in forward, ran during backward's range: still forward's
        kernel("elementwise_kernel", 99, 60, start=120),
        kernel("nvjet_tst_128x64", 150, 100),
        kernel("multi_tensor_apply_kernel", 350, 25),
        kernel("stray", 500, 5),
    ]
    report = summarize_kernels(events)
    assert report.source == "cuda kernels"
    assert list(report.tables) == ["forward", "backward", "optimizer", OUTSIDE]
    forward = report.tables["forward"]
    assert [k.name for k in forward.kernels] == ["elementwise_kernel", "sm90_xmma_gemm_f32"]
    rows = forward.rows()
    assert list(rows[0]) == list(COLUMNS)
    gemm = rows[1]
    assert gemm["Total Time (ns)"] == 60 and gemm["Instances"] == 2
    assert (gemm["Avg (ns)"], gemm["Med (ns)"], gemm["Min (ns)"], gemm["Max (ns)"]) == (30, 30, 20, 40)
    assert gemm["StdDev (ns)"] == pytest.approx(14.1, abs=0.05)
    assert gemm["Time (%)"] == pytest.approx(100 * 60 / 130, abs=0.05)
    assert forward.matmul_fraction == pytest.approx(60 / 130)
    assert report.tables["backward"].matmul_fraction == 1.0
    assert report.tables["optimizer"].matmul_fraction == 0.0
    assert [k.name for k in report.tables[OUTSIDE].kernels] == ["stray"]


def test_innermost_range_wins_and_unknown_launch_falls_back_to_kernel_start():
    events = ranges(("optimizer", 0, 100), ("forward", 10, 50))  # nested phases
    events += [kernel("a", 20, 5), kernel("b", 60, 5), TraceEvent("c", "kernel", 30, 5, launch_ns=None)]
    report = summarize_kernels(events)
    assert [k.name for k in report.tables["forward"].kernels] == ["a", "c"]
    assert [k.name for k in report.tables["optimizer"].kernels] == ["b"]


def test_ranges_not_named_as_phases_are_ignored_and_summary_is_per_step():
    events = ranges(("forward", 0, 100), ("Optimizer.step#AdamW.step", 0, 100))
    events += [kernel("gemm", 10, 30), kernel("gemm", 20, 30), kernel("add", 30, 40)]
    report = summarize_kernels(events, phases=["forward"], steps=2)
    (row,) = report.summary()
    assert row["phase"] == "forward"
    assert row["total ms per step"] == pytest.approx(100 / 1e6 / 2)
    assert row["instances per step"] == 1.5
    assert row["matmul %"] == pytest.approx(60.0)
    assert row["other %"] == pytest.approx(40.0)


def test_without_kernels_cpu_operators_count_by_self_time():
    events = ranges(("forward", 0, 1000))
    events += [
        TraceEvent("aten::linear", "op", 10, 500, thread=1),
        TraceEvent("aten::t", "op", 20, 30, thread=1),
        TraceEvent("aten::addmm", "op", 60, 400, thread=1),
        TraceEvent("aten::copy_", "op", 100, 50, thread=1),
        TraceEvent("aten::relu", "op", 600, 100, thread=1),
        TraceEvent("aten::relu", "op", 650, 20, thread=2),  # another thread: not a child
    ]
    report = summarize_kernels(events)
    assert report.source == "cpu ops"
    totals = {k.name: k.total_ns for k in report.tables["forward"].kernels}
    assert totals == {"aten::linear": 70, "aten::t": 30, "aten::addmm": 350, "aten::copy_": 50,
                      "aten::relu": 120}
    assert report.tables["forward"].matmul_fraction == pytest.approx(420 / 620)


def test_empty_phase_fraction_is_nan_and_format_has_nsys_header():
    report = summarize_kernels(ranges(("forward", 0, 10)) + [kernel("k" * 200, 1, 2)])
    text = report.tables["forward"].format(name_width=10)
    assert text.splitlines()[0].split() == "Time (%) Total Time (ns) Instances Avg (ns) Med (ns) Min (ns) " \
                                           "Max (ns) StdDev (ns) Name".split()
    assert text.splitlines()[-1].endswith("k" * 10)
    assert math.isnan(profkit.KernelTable("x", ()).matmul_fraction)


@pytest.mark.parametrize("name", [
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "ampere_sgemm_128x64_tn",
    "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT", "cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4",
    "triton_tem_fused_addmm_0", "aten::mm", "aten::addmm", "aten::bmm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_gemm>", "void gemv2T_kernel_val<int, int, float, float>",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, float>",
])
def test_matmul_names(name):
    assert is_matmul(name)


@pytest.mark.parametrize("name", [
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >",
    "triton_poi_fused_mul_silu_0", "triton_red_fused__softmax_1",
    "triton_poi_fused_addmm_gelu_0", "aten::softmax", "aten::add_",
    "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>",
    "fmha_cutlassF_f32_aligned_64x64",
    "aten::_efficient_attention_forward", "ncclDevKernel_AllReduce_Sum_f32", "Memcpy HtoD",
])
def test_not_matmul_names(name):
    assert not is_matmul(name)


class FakeKineto:
    """The methods of torch's _KinetoEvent that events_from_kineto reads."""

    def __init__(self, name, device, start, duration, corr=0, linked=0, activity=None, user=False, thread=1):
        self._v = dict(name=name, device=device, start=start, duration=duration, corr=corr, linked=linked,
                       activity=activity, user=user, thread=thread)

    def name(self): return self._v["name"]
    def device_type(self): return self._v["device"]
    def start_ns(self): return self._v["start"]
    def duration_ns(self): return self._v["duration"]
    def correlation_id(self): return self._v["corr"]
    def linked_correlation_id(self): return self._v["linked"]
    def start_thread_id(self): return self._v["thread"]
    def is_user_annotation(self): return self._v["user"]


class FakeKinetoWithActivity(FakeKineto):
    def activity_type(self): return self._v["activity"]


CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


@pytest.mark.parametrize("cls", [FakeKineto, FakeKinetoWithActivity])
def test_kineto_events_link_kernels_to_the_operator_that_launched_them(cls):
    raw = [
        cls("forward", CPU, 0, 100, corr=1, activity="user_annotation", user=True),
        cls("backward", CPU, 100, 100, corr=2, activity="user_annotation", user=True),
        cls("aten::mm", CPU, 90, 5, corr=3, activity="cpu_op"),
        # runtime call: its correlation id (CUPTI's numbering) collides with the op's id 1..3
        cls("cudaLaunchKernel", CPU, 150, 2, corr=3, activity="cuda_runtime"),
        cls("nvjet_tst_gemm", CUDA, 130, 20, corr=77, linked=3, activity="kernel", thread=7),
        cls("backward", CUDA, 100, 100, corr=0, linked=2, activity="gpu_user_annotation", user=True),
        cls("Memcpy DtoD (Device -> Device)", CUDA, 160, 3, linked=3, activity="gpu_memcpy"),
    ]
    events = events_from_kineto(raw)
    kinds = sorted((e.kind, e.name) for e in events)
    assert kinds == [("kernel", "nvjet_tst_gemm"), ("op", "aten::mm"),
                     ("range", "backward"), ("range", "forward")]
    (k,) = [e for e in events if e.kind == "kernel"]
    assert k.launch_ns == 90  # the op's start, not the runtime call's
    report = summarize_kernels(events)
    assert list(report.tables) == ["forward"]  # ran during backward's range, launched in forward


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_profile_phases_reports_each_phase(device, training_step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    step = training_step(model, optimizer, torch.randn(16, 32, device=device))
    report = profkit.profile_phases(step, warmup=1, steps=2, device=device)
    # Work outside the three phases (the profiler's own set-up ops, say) gets a table of its own, last.
    assert [p for p in report.tables if p != OUTSIDE] == ["forward", "backward", "optimizer"]
    forward, backward, optimizer_table = (report.tables[p] for p in ("forward", "backward", "optimizer"))
    assert 0 < forward.matmul_fraction < 1 and 0 < backward.matmul_fraction < 1
    assert optimizer_table.matmul_fraction == 0
    if device == "cuda":
        assert report.source == "cuda kernels"
    else:
        assert report.source == "cpu ops"
        addmm = next(k for k in forward.kernels if k.name == "aten::addmm")
        assert len(addmm.durations_ns) == 4  # two layers, two profiled steps
        assert "aten::mm" in {k.name for k in backward.kernels}


def test_chrome_trace_events_summarize_as_the_profilers_own(tmp_path, training_step):
    """The same profiled steps, read from torch's Kineto events and from its exported Chrome trace."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    step = training_step(model, torch.optim.AdamW(model.parameters()), torch.randn(16, 32))
    clock = profkit.PhaseClock()
    step(clock)
    with torch.profiler.profile() as prof:
        for _ in range(2):
            step(clock)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ours = summarize_kernels(events_from_chrome(load_trace(tmp_path / "t.json")), steps=2)
    theirs = summarize_kernels(trace_events(prof), steps=2)
    assert list(ours.tables) == list(theirs.tables)
    for phase, table in theirs.tables.items():
        mine = {k.name: k for k in ours.tables[phase].kernels}
        assert set(mine) == {k.name for k in table.kernels}
        for k in table.kernels:
            assert len(mine[k.name].durations_ns) == len(k.durations_ns)
            # the trace stores microseconds with three decimals: a nanosecond per event at most
            assert abs(mine[k.name].total_ns - k.total_ns) <= len(k.durations_ns) + 1
