import pickle
from contextlib import contextmanager

import pytest
import torch

import profkit
from benchmarks import e2e
from benchmarks.common import device_slug, read_results
from benchmarks.model import forward_flops, model_config

FAST = ["--size", "tiny", "--context", "16,32", "--warmup", "1", "--steps", "2"]


def run(tmp_path, *extra, name="e2e_train"):
    e2e.main(["--results-dir", str(tmp_path), *FAST, *extra])
    return read_results(tmp_path / device_slug() / f"{name}.csv")


def test_peak_table_and_flops():
    assert e2e.peak_tflops("NVIDIA H100 80GB HBM3", "bf16", tf32=False) == 989.0
    assert e2e.peak_tflops("NVIDIA H100 80GB HBM3", "fp32", tf32=False) == 67.0
    assert e2e.peak_tflops("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 495.0
    assert e2e.peak_tflops("NVIDIA H100 PCIe", "bf16", tf32=False) == 756.0
    assert e2e.peak_tflops("NVIDIA H200", "bf16", tf32=True) == 989.0  # tf32 only changes fp32
    assert e2e.peak_tflops("cpu", "bf16", tf32=False) is None
    cfg = model_config("small", 128)
    assert e2e.step_flops(cfg, 4, "forward") == forward_flops(cfg, 4, 128)
    assert e2e.step_flops(cfg, 4, "train") == 3 * forward_flops(cfg, 4, 128)


def test_train_sweep_reports_every_phase_and_configuration(tmp_path):
    df, meta = run(tmp_path, "--precision", "fp32,bf16")
    assert list(zip(df["precision"], df["context"], strict=True)) == [
        ("fp32", 16), ("fp32", 32), ("bf16", 16), ("bf16", 32)]
    for column in ("fwd ms", "bwd ms", "opt ms", "tokens/s"):
        assert (df[column] > 0).all(), column
    step = df["fwd ms"] + df["bwd ms"] + df["opt ms"]
    assert df["step ms"].tolist() == pytest.approx(step.tolist(), abs=2e-3)
    tokens_per_s = 4 * df["context"] / (df["step ms"] / 1e3)
    assert df["tokens/s"].tolist() == pytest.approx(tokens_per_s.tolist(), rel=1e-2)
    flops = [e2e.step_flops(model_config("tiny", c), 4, "train") for c in df["context"]]
    tflops = [f / (ms / 1e3) / 1e12 for f, ms in zip(flops, df["step ms"], strict=True)]
    assert df["TFLOP/s"].tolist() == pytest.approx(tflops, abs=1e-3)  # rounded to 3 decimals
    assert meta["mode"] == "train" and meta["tf32"] == "False"
    if not torch.cuda.is_available():
        assert df["MFU %"].isna().all()  # no peak for a CPU


def test_forward_mode_leaves_backward_and_optimizer_blank(tmp_path):
    df, _ = run(tmp_path, "--mode", "forward", "--context", "16", name="e2e_forward")
    assert df["bwd ms"].isna().all() and df["opt ms"].isna().all()
    assert (df["fwd ms"] > 0).all()


def test_oom_is_a_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real = e2e.measure

    def measure(config, args, dev):
        if config.context == 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
        return real(config, args, dev)

    monkeypatch.setattr(e2e, "measure", measure)
    df, _ = run(tmp_path)
    assert df["step ms"].tolist()[0] == "OOM"
    assert float(df["step ms"].tolist()[1]) > 0


def test_profile_kernels_writes_per_phase_tables(tmp_path):
    run(tmp_path, "--context", "16", "--profile", "kernels")
    folder = tmp_path / device_slug()
    kernels, _ = read_results(folder / "e2e_train_kernels_tiny_ctx16_fp32_naive.csv")
    assert list(kernels.columns) == ["Phase", *profkit.kernels.COLUMNS]
    assert set(kernels["Phase"]) == {"forward", "backward", "optimizer"}
    for _, group in kernels.groupby("Phase"):
        # each share is rounded to 0.1%, so the sum is 100 within 0.05 a row
        assert group["Time (%)"].sum() == pytest.approx(100, abs=0.05 * len(group) + 1e-9)
    summary, _ = read_results(folder / "e2e_train_kernel_summary.csv")
    assert summary["phase"].tolist() == ["forward", "backward", "optimizer"]
    assert summary["matmul %"].tolist()[0] > 0 and summary["matmul %"].tolist()[2] == 0


def test_nvtx_annotates_steps_phases_blocks_and_attention_parts(tmp_path, monkeypatch):
    from benchmarks import model

    pushed = []

    class Sink:
        def range_push(self, name):
            pushed.append(name)

        def range_pop(self):
            pass

    monkeypatch.setattr(profkit.nvtx, "_sink", Sink)
    original = model.attention_softmax
    e2e.main(["--no-save", *FAST, "--context", "16", "--nvtx"])
    for name in ("warmup 0", "step 1", "forward", "backward", "optimizer", "blocks.1", "blocks.0.attn",
                 "blocks.0.ffn", "lm_head", "attention scores", "attention softmax",
                 "attention weighted sum"):
        assert name in pushed, name
    assert "blocks.0.attn.qkv" not in pushed
    assert model.attention_softmax is original


def test_compiled_model_runs(tmp_path):
    df, meta = run(tmp_path, "--context", "16", "--compile", "--compile-backend", "aot_eager")
    assert (df["step ms"] > 0).all() and meta["compile"] == "aot_eager"


def fake_recorder(snapshot):
    @contextmanager
    def record(path):
        try:
            yield path
        finally:
            path.write_bytes(pickle.dumps(snapshot))
    return record


def synthetic_snapshot():
    frames = [{"filename": "/repo/model.py", "line": 64, "name": "attention_scores"}]
    trace = [{"action": "alloc", "addr": 1, "size": 2**20, "frames": frames},
             {"action": "free_completed", "addr": 1, "size": 2**20, "frames": []}]
    return {"segments": [], "device_traces": [trace]}


def test_memory_records_fresh_steps_draws_the_timeline_and_tables_peaks(tmp_path, monkeypatch):
    monkeypatch.setattr(profkit, "record_memory_history", fake_recorder(synthetic_snapshot()))
    args = e2e.build_parser().parse_args([*FAST, "--memory-steps", "2"])
    config = e2e.Config("tiny", 16, "fp32", "naive")
    peaks = e2e.record_memory(config, args, torch.device("cpu"), tmp_path / "m.pickle")
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert peaks["phase"].tolist()[-1] == "timeline peak (active)"
    assert peaks["peak allocated (GiB)"].tolist()[-1] == pytest.approx(2**20 / 2**30)


def test_memory_draws_the_snapshot_of_an_oom(tmp_path, monkeypatch):
    monkeypatch.setattr(profkit, "record_memory_history", fake_recorder(synthetic_snapshot()))

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(e2e, "build_workload", oom)
    args = e2e.build_parser().parse_args(FAST)
    config = e2e.Config("tiny", 16, "fp32", "naive")
    e2e.record_memory(config, args, torch.device("cpu"), tmp_path / "m.pickle")
    assert (tmp_path / "m.png").exists()


def test_memory_paths_per_configuration():
    config = e2e.Config("2.7B", 256, "bf16", "naive")
    assert e2e.memory_path(e2e.Path("/tmp/m.pickle"), config, several=False) == e2e.Path("/tmp/m.pickle")
    assert e2e.memory_path(e2e.Path("/tmp/m.pickle"), config, several=True) == \
        e2e.Path("/tmp/m_2.7B_ctx256_bf16_naive.pickle")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_memory_without_cuda_says_so(tmp_path, capsys):
    e2e.main(["--no-save", *FAST, "--context", "16", "--memory", str(tmp_path / "m.pickle")])
    assert "--memory needs CUDA" in capsys.readouterr().out
    assert not (tmp_path / "m.pickle").exists()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: must be at least 1, got 0"),
    (["--size", "huge"], "huge not among"),
    (["--context", "0"], "--context"),
    (["--compile", "--warmup", "0"], "--warmup >= 1"),
    (["--memory", "x.png"], "snapshot pickle"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--no-save", *argv])
    assert message in capsys.readouterr().err
