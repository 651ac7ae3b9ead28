import argparse
import math
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

from benchmarks.common import save_results
from benchmarks.report import SECTIONS, build_report, fit_allreduce, main
from benchmarks.report.core import axes, style

H100 = "NVIDIA H100 80GB HBM3"


def write(results: Path, name: str, df: pd.DataFrame, device: str = H100, command: str | None = None,
          date: str = "2026-01-01 00:00 UTC", meta: dict[str, str] | None = None) -> Path:
    """A results file exactly as an experiment writes it."""
    command = command or f"python -m benchmarks.{name.split('_')[0]} --results-dir /x"
    args = argparse.Namespace(results_dir=results, no_save=False, command=command)
    return save_results(df, name, args, metadata={"device": device, "date": date, **(meta or {})})


def section(report: str, title: str) -> str:
    """The text of one '## title' section."""
    start = report.index(f"## {title}\n")
    end = report.find("\n## ", start + 1)
    return report[start:] if end < 0 else report[start:end]


def title_of(key: str) -> str:
    return next(s.title for s in SECTIONS if s.key == key)


# --- synthetic results, shaped like each experiment's CSV, with answers known by construction ----------

SIZES = {"small": 20.0, "medium": 50.0, "large": 100.0, "xl": 200.0, "2.7B": 300.0}  # ms at context 128, fp32


def e2e_rows() -> pd.DataFrame:
    rows = []
    for precision in ("fp32", "bf16"):
        for size, base in SIZES.items():
            for context in (128, 256, 512):
                key = {"size": size, "context": context, "precision": precision, "attention": "naive"}
                if size == "2.7B" and precision == "fp32" and context == 512:
                    rows.append({**key, "step ms": "OOM"})
                    continue
                step = base * context / 128 / (2.0 if precision == "bf16" else 1.0)
                rows.append({**key, "fwd ms": step / 4, "bwd ms": step / 2, "opt ms": step / 4,
                             "step ms": step, "tokens/s": 4 * context / step * 1e3, "MFU %": 30 + base / 30})
    return pd.DataFrame(rows)


def attention_rows() -> pd.DataFrame:
    rows = []
    for d in (16, 32, 64, 128):
        for t in (256, 1024, 4096, 8192, 16384):
            oom = t == 16384 and d >= 64
            eager = 1e-6 * t * t * (1 + d / 64)
            rows.append({"d": d, "T": t,
                         "fwd ms eager": "OOM" if oom else eager, "fwd ms compiled": eager / 2,
                         "bwd ms eager": "OOM" if oom else 2 * eager, "bwd ms compiled": eager,
                         "mem MiB eager": "OOM" if oom else 8 * t * t * 4 / 2**20,
                         "mem MiB compiled": 4 * t * t * 4 / 2**20, "predicted MiB": 8 * t * t * 4 / 2**20})
    return pd.DataFrame(rows)


def flash_rows() -> pd.DataFrame:
    speed = {"triton": 1.25, "torch": 0.2, "naive": 0.5, "sdpa-flash": 1.0}  # relative to sdpa-flash
    rows = []
    shapes = [(1, t, d) for d in (64, 128) for t in (1024, 2048, 4096, 8192)] + [(16, 16384, 64)]
    for bh, t, d in shapes:
        base = {p: 1e-6 * bh * t * t * d * k for p, k in (("fwd", 1.0), ("bwd", 2.5), ("fwd+bwd", 3.5))}
        for impl, s in speed.items():
            oom = impl == "naive" and t >= 8192
            cells = {f"{p} ms": "OOM" if oom else ms / s for p, ms in base.items()}
            ratios = {f"{p} x flash": "-" if oom else s for p in base}
            tflops = {"fwd+bwd TFLOP/s": "-" if oom else 100 * s * d / 128}
            rows.append({"batch*heads": bh, "T": t, "d": d, "dtype": "bfloat16", "causal": True, "impl": impl,
                         **cells, **ratios, **tflops})
    return pd.DataFrame(rows)


ALLREDUCE_O, ALLREDUCE_W = 20e-6, 300e9


def allreduce_rows() -> pd.DataFrame:
    rows = []
    for mib in (1, 10, 100, 1024):
        seconds = ALLREDUCE_O + mib * 2**20 / ALLREDUCE_W
        rows.append({"backend": "nccl", "device": "cuda", "world size": 2, "size (MiB)": mib, "calls": 10,
                     "median ms": seconds * 1e3, "min ms": seconds * 1e3,
                     "alg GB/s": mib * 2**20 / seconds / 1e9, "bus GB/s": mib * 2**20 / seconds / 1e9})
    return pd.DataFrame(rows)


DDP_STEPS = {("single", None): 100.0, ("naive", None): 140.0, ("flat", None): 125.0, ("overlap", None): 118.0,
             ("bucketed", 1.0): 112.0, ("bucketed", 10.0): 106.0, ("bucketed", 100.0): 104.0,
             ("bucketed", 1000.0): 115.0, ("torch", 25.0): 108.0}


def ddp_rows() -> pd.DataFrame:
    return pd.DataFrame([{"strategy": s, "bucket MiB": b if b else "", "ranks": 1 if s == "single" else 2,
                          "buckets": max(1, round(8000 / b)) if s == "bucketed" else "",
                          "step ms": ms, "step std": 2.0, "x single": ms / 100.0,
                          "comm ms": 0.0 if s == "single" else 30.0,
                          "exposed comm ms": 0.0 if s == "single" else (ms - 100.0) / 2,
                          "overlap %": float("nan") if s == "single" else 100 * (1 - (ms - 100.0) / 60)}
                         for (s, b), ms in DDP_STEPS.items()])


def shardopt_tables() -> dict[str, pd.DataFrame]:
    memory = []
    for name, state in (("AdamW (unsharded)", 16000.0), ("ShardedOptimizer", 8100.0),
                        ("ZeroRedundancyOptimizer", 8000.0)):
        for phase, grads, opt in (("after init", 0.0, 0.0), ("before step", 8000.0, state),
                                  ("after step", 8000.0, state)):
            memory.append({"optimizer": name, "phase": phase, "parameters_MB": 8000.0, "gradients_MB": grads,
                           "optimizer_state_MB": opt, "other_MB": 500.0, "peak_MB": 8500.0 + grads + opt})
    time = pd.DataFrame({"optimizer": ["AdamW (unsharded)", "ShardedOptimizer", "ZeroRedundancyOptimizer"],
                         "iteration_ms": [200.0, 210.0, 220.0], "optimizer_step_ms": [20.0, 15.0, 16.0],
                         "comm_ms": [10.0, 20.0, 20.0], "exposed_comm_ms": [10.0, 5.0, 10.0],
                         "overlap_pct": [0.0, 75.0, 50.0]})
    goal = pd.DataFrame({"criterion": ["state per rank (MB)", "step (ms)"], "measured": [8100.0, 15.0],
                         "limit": [8200.0, 16.0], "met": [True, True]})
    return {"shardopt_memory": pd.DataFrame(memory), "shardopt_time": time, "shardopt_goal": goal}


def memory_rows() -> pd.DataFrame:
    return pd.DataFrame([
        {"step": 0, "phase": "forward", "peak allocated (GiB)": 40.0, "peak reserved (GiB)": 42.0,
         "allocated after (GiB)": 30.0},
        {"step": 0, "phase": "backward", "peak allocated (GiB)": 55.0, "peak reserved (GiB)": 60.0,
         "allocated after (GiB)": 20.0},
        {"step": 0, "phase": "optimizer", "peak allocated (GiB)": 45.0, "peak reserved (GiB)": 60.0,
         "allocated after (GiB)": 40.0},
        {"step": "all", "phase": "timeline peak (active)", "peak allocated (GiB)": 56.5,
         "peak reserved (GiB)": "", "allocated after (GiB)": ""},
    ])


def fsdp_rows(scale: float = 1.0) -> pd.DataFrame:
    rows = []
    for strategy, params, ms in (("torch-ddp", 500.0, 100.0), ("minddp-bucketed", 500.0, 104.0),
                                 ("torch-fsdp2", 250.0, 120.0), ("minddp-fsdp", 250.0, 126.0)):
        params, ms = params * scale, ms * scale
        rows.append({"strategy": strategy, "compute": "fp32", "iteration_ms": ms, "params_MB": params,
                     "model_params_MB": params, "grads_MB": params, "model_grads_MB": params,
                     "optimizer_MB": 2 * params, "model_optimizer_MB": 2 * params, "model_gathered_MB": 0.0,
                     "model_activations_MB": 900.0, "peak_MB": 4 * params + 1000, "other_MB": 1000.0,
                     "comm_ms": 40.0, "exposed_comm_ms": 10.0 if "fsdp" in strategy else 20.0,
                     "overlap_pct": 75.0 if "fsdp" in strategy else 50.0})
    return pd.DataFrame(rows)


def checkpointing_rows() -> pd.DataFrame:
    held = {"none": 1000.0, "blocks": 100.0, "every-k": 550.0, "sqrt": 50.0, "attention": 400.0}
    slower = {"none": 1.0, "blocks": 1.33, "every-k": 1.17, "sqrt": 1.33, "attention": 1.05}
    return pd.DataFrame([{"policy": p, "context": c, "activations_MB": held[p] * c / 1024,
                          "model_MB": held[p] * c / 1024 * 0.99, "peak_MB": 500 + held[p] * c / 1024,
                          "step_ms": 10 * slower[p] * c / 1024, "slowdown": slower[p]}
                         for p in held for c in (512, 1024)])


def write_gpu_results(results: Path) -> Path:
    """Every experiment's results as the H100 run would write them; returns results/."""
    write(results, "e2e_train", e2e_rows(), meta={"mode": "train", "batch_size": "4"},
          command="python -m benchmarks.e2e --size all --precision fp32,bf16")
    tag = "2.7B_ctx128_fp32_naive"
    write(results, f"e2e_train_memory_{tag}", memory_rows(),
          command=f"python -m benchmarks.e2e --size 2.7B --memory {results}/h100/e2e_2.7B.pickle",
          meta={"mode": "train"})
    fig = plt.figure(figsize=(2, 1))
    fig.savefig(results / "nvidia-h100-80gb-hbm3" / "e2e_2.7B.png")
    plt.close(fig)
    write(results, "attention", attention_rows(), meta={"dtype": "fp32", "batch_size": "8"})
    write(results, "flash", flash_rows())
    write(results, "allreduce", allreduce_rows())
    write(results, "ddp", ddp_rows(), meta={"ranks": "2", "backend": "nccl", "model": "xl"})
    for name, df in shardopt_tables().items():
        write(results, name, df)
    write(results, "fsdp", fsdp_rows(), meta={"world_size": "2"})
    write(results, "fsdp_xl", fsdp_rows(scale=2), meta={"world_size": "2", "model": "xl"})
    write(results, "checkpointing", checkpointing_rows(), meta={"model": "small"})
    limits = {"policy": ["none", "blocks"], "largest_context": [2048, 8192], "search_limit": 32768}
    write(results, "checkpointing_max_context", pd.DataFrame(limits))
    return results


@pytest.fixture(scope="module")
def gpu_report(tmp_path_factory):
    """The report built from a full synthetic GPU run: (report text, plots, results dir)."""
    root = tmp_path_factory.mktemp("gpu")
    results = write_gpu_results(root / "results")
    out, plots = build_report(results, root / "docs" / "report.md")
    return out.read_text(), plots, results


@pytest.fixture
def accounting_results(tmp_path):
    from benchmarks.accounting import main as accounting

    accounting(["--results-dir", str(tmp_path / "results"), "--ddp-size", "tiny"])
    return tmp_path / "results"


def test_missing_experiments_say_which_command_to_run(tmp_path):
    out, plots = build_report(tmp_path / "nothing", tmp_path / "docs" / "report.md")
    text = out.read_text()
    assert plots == []
    for s in SECTIONS:  # a command that writes where this report reads
        command = f"{s.command} --results-dir {(tmp_path / 'nothing').resolve()}"
        assert f"Not measured yet: run `{command}`." in section(text, s.title)


def test_every_section_is_measured_and_plotted(gpu_report):
    text, plots, _ = gpu_report
    for s in SECTIONS:
        if s.key not in ("precision", "accounting"):
            assert "Not measured yet" not in section(text, s.title), s.key
    names = {p.name for p in plots}
    assert {"e2e_train.png", "attention.png", "flash_speedup.png", "flash_time.png", "ddp_step_time.png",
            "allreduce_bandwidth.png", "shardopt_memory.png", "shardopt_overlap.png", "fsdp_memory.png",
            "fsdp_overlap.png",
            "checkpointing_memory_time.png",
            "e2e_train_memory_2.7B_ctx128_fp32_naive.png"} <= names
    for p in plots:
        assert p.is_file() and p.stat().st_size > 0
        assert f"]({p.name})" in text


def test_regenerate_commands_write_where_the_report_read(gpu_report):
    """Copied, each 'Regenerate with' command writes the file the report read, not into the default folder."""
    text, _, results = gpu_report
    assert f"Regenerate with `python -m benchmarks.ddp --results-dir {results.resolve()}`." in text
    commands = [c for line in text.splitlines() if line.startswith("Regenerate with")
                for c in line.split("`")[1::2]]
    assert len(commands) >= 9 and all(c.endswith(f"--results-dir {results.resolve()}") for c in commands)


def test_a_recorded_results_dir_is_replaced_by_the_one_read(tmp_path):
    from benchmarks.report.build import display_command

    assert display_command("python -m benchmarks.flash --results-dir /scratch --quick", "results") == (
        "python -m benchmarks.flash --quick --results-dir results")
    assert display_command("python -m benchmarks.flash --results-dir=/x", "out") == (
        "python -m benchmarks.flash --results-dir out")


def test_e2e_statements(gpu_report):
    text = section(gpu_report[0], title_of("e2e"))
    df = e2e_rows()
    tokens = pd.to_numeric(df["tokens/s"], errors="coerce")
    best = df.loc[tokens.idxmax()]
    assert f"Highest throughput: {best['size']} at context {best['context']}, {best['precision']}" in text
    assert "bf16 autocast against fp32: 2.00x faster" in text and "2.00x to 2.00x" not in text
    assert "Out of memory: size=2.7B, precision=fp32: from context = 512." in text
    assert "Backward time against forward time: 2.00x." in text  # every pair alike: no range
    assert "small 4.00x" in text  # step time grows with context: 512 / 128


def test_memory_section_shows_the_timeline_and_peaks(gpu_report):
    text = section(gpu_report[0], title_of("memory"))
    assert "Highest per-phase peak: backward at 55.00 GiB" in text
    assert "Peak active memory on the timeline: 56.50 GiB" in text
    assert "(e2e_train_memory_2.7B_ctx128_fp32_naive.png)" in text


def test_attention_statements(gpu_report):
    text = section(gpu_report[0], title_of("attention"))
    assert "Forward: compiled is 2.00x the speed of eager (median" in text
    assert "eager runs out of memory: d=64: from T = 16384; d=128: from T = 16384." in text
    assert "eager fwd time grows as T^2.00" in text
    assert "measured / predicted: 1.000 for eager" in text  # every cell alike: no range


def test_flash_statements(gpu_report):
    text = section(gpu_report[0], title_of("flash"))
    assert "bfloat16 fwd+bwd: fastest triton in 8 of 8 (T, d) cells." in text
    assert "Triton over SDPA flash, bfloat16, T >= 1024 (geometric mean): fwd 1.25x" in text
    assert "naive: dtype=bfloat16, d=64: from T = 8192" in text
    assert "Shape 16x16384x64 bfloat16, fwd+bwd: triton" in text
    assert "Best fwd+bwd throughput, bfloat16: triton 125 TFLOP/s (T=1024, d=128), sdpa-flash 100" in text


def test_allreduce_fit_recovers_latency_and_bandwidth(gpu_report):
    df = allreduce_rows()
    (fit,) = fit_allreduce(df)
    assert fit.overhead_s == pytest.approx(ALLREDUCE_O, rel=1e-6)
    assert fit.bandwidth == pytest.approx(ALLREDUCE_W, rel=1e-6)
    text = section(gpu_report[0], title_of("allreduce"))
    peak = df["bus GB/s"].max()
    assert f"nccl: peak bus bandwidth {peak:.3g} GB/s at 1024 MiB over 2 ranks" in text
    assert "o = 20 µs, w = 300 GB/s" in text


def test_ddp_statements(gpu_report):
    text = section(gpu_report[0], title_of("ddp"))
    assert "Fastest data-parallel: bucketed (100 MiB, 80 buckets) 104 ms (1.040x single)" in text
    assert "slowest: naive 140 ms (1.400x single)" in text
    assert "meets the 1.10x goal); -3.7% against torch DDP, same run." in text
    assert "the bucket model predicts" in text  # from the allreduce fit on the same device
    assert "naive 20 of 30 ms exposed (33% overlapped)" in text  # from the traced columns


@pytest.mark.parametrize("device", [H100, "cpu"])
def test_ddp_differences_within_noise_are_not_findings(tmp_path, device):
    """Bucketed 2 ms faster than one device with 5 ms of spread is noise, not 0.98x; from a CPU run no
    speed statement is made at all."""
    rows = pd.DataFrame([
        {"strategy": "single", "step ms": 100.0, "step std": 3.0, "x single": 1.0, "comm ms": 0.0,
         "exposed comm ms": 0.0},
        {"strategy": "bucketed", "bucket MiB": 25.0, "step ms": 98.0, "step std": 4.0, "x single": 0.98,
         "comm ms": 20.0, "exposed comm ms": 5.0, "overlap %": 75.0},
        {"strategy": "naive", "step ms": 130.0, "step std": 4.0, "x single": 1.3, "comm ms": 30.0,
         "exposed comm ms": 30.0, "overlap %": 0.0},
    ])
    results = tmp_path / "results"
    write(results, "ddp", rows, device=device)
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("ddp"))
    assert "| ~1 (noise) " in text and "| 0.98 " not in text  # the table marks it as the command prints it
    if device == "cpu":
        assert "Speed: not read from this CPU run" in text and "x single" not in text.split("|")[-1]
        assert "**Measured on a CPU.**" in out.read_text() and "Speed needs a GPU run." in out.read_text()
        return
    assert "bucketed (25 MiB) 98 ms (within noise of single)" in text
    traced = ("bucketed (25 MiB) 5 of 20 ms exposed (75% overlapped), "
              "naive 30 of 30 ms exposed (0% overlapped)")
    assert traced in text
    assert "Noise: 1 of 2 strategies" in text
    assert "no communication on the device" not in text
    assert "this run gives no verdict on the 1.10x goal" in text and "0.980x" not in text


def test_shardopt_statements(gpu_report):
    text = section(gpu_report[0], title_of("shardopt"))
    assert "ShardedOptimizer 8,100 MB, 1.98x less than AdamW (unsharded) (16,000 MB)" in text
    assert "ShardedOptimizer against ZeroRedundancyOptimizer: -4.5% per iteration." in text
    assert "per iteration and rank" in text and "ShardedOptimizer 5 of 20 ms exposed (75% overlapped)" in text
    assert "state per rank (MB): 8100 against 8200: met." in text
    assert "Peak memory per rank over the iteration: AdamW (unsharded) 32,500 MB" in text


def test_fsdp_statements(gpu_report):
    text = section(gpu_report[0], title_of("fsdp"))
    assert "fp32: minddp.FSDP holds 250 MB of parameters per rank, 2x less than DDP (500 MB)" in text
    assert "minddp.FSDP 126 ms per iteration against FSDP2's 120 ms (+5.0%); peak 2,000 MB a rank" in text
    assert "minddp-fsdp fp32 10 of 40 ms exposed (75% overlapped)" in text
    assert "Settings: model xl." in text  # each model size's file has its table and findings
    assert "minddp.FSDP 252 ms per iteration against FSDP2's 240 ms (+5.0%); peak 3,000 MB a rank" in text


def test_checkpointing_statements(gpu_report):
    text = section(gpu_report[0], title_of("checkpointing"))
    assert "measured/model 1.010 over 10 cells" in text and "1.010 and 1.010" not in text
    assert "context 1024, blocks: activations 100 MB (10x less than none)." in text
    assert "context 1024, attention: activations 400 MB (2.5x less than none)." in text
    assert "Step time at context 1024, against none's 10 ms: blocks 13.3 ms (+33%)" in text
    assert "Largest context each policy trains at" in text


def test_main_writes_the_report_where_asked(tmp_path, accounting_results):
    out = tmp_path / "site" / "report.md"
    main(["--results-dir", str(accounting_results), "--out", str(out)])
    text = out.read_text()
    regenerate = ("Regenerate with `python -m benchmarks.accounting --ddp-size tiny "
                  f"--results-dir {accounting_results}`")
    assert regenerate in section(text, title_of("accounting"))
    assert (out.parent / "accounting_fsdp_memory.png").stat().st_size > 10_000


def test_no_save_prints_the_report_and_writes_nothing(tmp_path, accounting_results, capsys):
    out = tmp_path / "docs" / "report.md"
    main(["--results-dir", str(accounting_results), "--out", str(out), "--no-save"])
    assert "## Memory and communication accounting" in capsys.readouterr().out
    assert not out.parent.exists()


def test_precision_names_the_least_and_most_accurate_sum(tmp_path):
    results = tmp_path / "results"
    sums = {("float32", "float32"): 10.0001, ("float16", "float16"): 9.95, ("float32", "float16"): 10.002}
    write(results, "precision_accumulation",
          pd.DataFrame([{"accumulator": a, "addend": b, "sum": v} for (a, b), v in sums.items()]))
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("precision"))
    assert "Closest to 10: float32 accumulator, float32 addends" in text
    assert "Farthest: float16 accumulator, float16 addends" in text
    assert f"{0.05 / 0.0001:,.0f}x the error" in text


def test_gpu_results_are_preferred_and_others_mentioned(tmp_path):
    results = tmp_path / "results"
    rows = pd.DataFrame([{"accumulator": "float32", "addend": "float32", "sum": 10.5}])
    write(results, "precision_accumulation", rows, device="cpu", date="2026-05-01 00:00 UTC")
    write(results, "precision_accumulation", rows.assign(sum=10.25), device=H100)
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("precision"))
    assert f"device **{H100}**" in text
    assert "10.25" in text and "10.5 " not in text
    assert "Results also exist for: cpu" in text


def test_accounting_statements_come_from_the_numbers(tmp_path, accounting_results):
    from benchmarks.common import read_results

    out, plots = build_report(accounting_results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("accounting"))
    fsdp, _ = read_results(accounting_results / "analytic" / "accounting_fsdp.csv")
    n_min = int(fsdp.set_index("symbol").loc["N_min(T=4096)", "value"])
    assert f"4,096 tokens: at least **{n_min}** devices" in text
    assert "16,384 tokens: no N fits under 95 GB" in text
    assert "compute-bound above **318.8 tokens per chip**, an overall batch of **20,400 tokens**" in text
    assert {p.name for p in plots} == {"accounting_fsdp_memory.png", "accounting_ddp_buckets.png"}


def test_missing_columns_are_named_and_the_table_still_shown(tmp_path):
    results = tmp_path / "results"
    write(results, "accounting_tpu", pd.DataFrame({"symbol": ["B/N"], "something": [1.0]}), device="analytic")
    write(results, "ddp", pd.DataFrame({"strategy": ["single", "naive"], "time": [1.0, 2.0]}))
    write(results, "attention", pd.DataFrame({"d": [16], "T": [64]}))
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = out.read_text()
    assert "something" in section(text, title_of("accounting"))
    assert "The summary: not possible, the results lack B/N" in section(text, title_of("accounting"))
    assert "The analysis: not possible, the results lack step ms" in section(text, title_of("ddp"))
    assert "the results lack fwd ms <variant>" in section(text, title_of("attention"))


def test_oom_everywhere_is_not_a_crash(tmp_path):
    results = tmp_path / "results"
    df = e2e_rows().assign(**{"step ms": "OOM", "tokens/s": "", "MFU %": "", "fwd ms": "", "bwd ms": ""})
    write(results, "e2e_train", df)
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("e2e"))
    assert "Out of memory: size=small, precision=fp32: from context = 128" in text
    assert not math.isnan(len(text))


COMMITTED_RESULTS = Path(__file__).resolve().parents[3] / "results"


@pytest.fixture(scope="module")
def committed_report(tmp_path_factory):
    """The report as `python -m benchmarks.report --results-dir results` writes it from the committed ones."""
    out, _ = build_report(COMMITTED_RESULTS, tmp_path_factory.mktemp("committed") / "report.md")
    return out.read_text()


def test_the_committed_results_report_reads_as_written_with_care(committed_report):
    """The issue's glitches: units 'nan', 'C = 459000000000000.0', '1.70x to 1.70x', '1.0x less than none'."""
    import re

    text = committed_report
    assert not re.search(r"\bnan\b", text, re.IGNORECASE)
    assert not re.findall(r"(?<![\w.])\d{7,}\.\d+", text)  # a float above 1e6 printed raw
    words = [w.strip(",;.()") for w in text.split()]
    repeated = [" ".join(words[i - 1:i + 2]) for i, w in enumerate(words[1:-1], start=1)
                if w in ("to", "and") and words[i - 1] == words[i + 1] and words[i - 1][:1].isdigit()]
    assert not repeated, repeated  # '1.70x to 1.70x'
    assert "1.0x less" not in text and "1.0x more" not in text
    assert "4.59e+14" in text  # the TPU's FLOP/s, as a number a reader can take in
    commands = [c for line in text.splitlines() if line.startswith("Regenerate with")
                for c in line.split("`")[1::2]]
    from benchmarks.report.build import as_typed

    assert commands and all(c.endswith(f"--results-dir {as_typed(COMMITTED_RESULTS)}") for c in commands)


def test_close_x_values_are_not_ticked_on_top_of_each_other():
    """checkpointing_memory_time.png printed step times 307, 311 and 351 ms as one '307311351'."""
    fig, (ax,) = axes()
    ax.plot([267.4, 307.5, 311.9, 351.1, 359.1], [1, 2, 3, 4, 5], marker="o", label="policy")
    style(ax, "step time (ms)", "memory (MB)", "checkpointing")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    low, high = ax.get_xlim()
    boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels(which="both")
             if t.get_visible() and t.get_text() and low <= t.get_position()[0] <= high]
    assert boxes and not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)
