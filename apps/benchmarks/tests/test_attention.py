import pytest
import torch

from benchmarks import attention
from benchmarks.common import device_slug, read_results


def test_predicted_memory_formula():
    # B=8, T=4, d=2, fp32: 4 * (5*8*4*2 + 8*4*4) + 4*4 bytes
    assert attention.predicted_bytes(8, 4, 2, 4) == 4 * (320 + 128) + 16
    assert attention.predicted_bytes(8, 4, 2, 2) == 2 * (320 + 128) + 16


def run(tmp_path, *extra):
    attention.main(["--results-dir", str(tmp_path), "--d", "16", "--T", "32,64", "--passes", "2",
                    "--warmup", "1", *extra])
    return read_results(tmp_path / device_slug() / "attention.csv")


def test_eager_table_has_every_shape_and_the_formula(tmp_path):
    df, meta = run(tmp_path, "--variants", "eager")
    assert list(df.columns) == ["d", "T", "fwd ms eager", "bwd ms eager", "mem MiB eager", "predicted MiB"]
    assert list(zip(df["d"], df["T"], strict=True)) == [(16, 32), (16, 64)]
    assert (df["fwd ms eager"] > 0).all() and (df["bwd ms eager"] > 0).all()
    if torch.cuda.is_available():
        assert (df["mem MiB eager"] > 0).all()
    else:
        assert df["mem MiB eager"].isna().all()  # needs CUDA
    expected = [attention.predicted_bytes(8, t, 16, 4) / 2**20 for t in (32, 64)]
    assert df["predicted MiB"].tolist() == pytest.approx(expected, abs=1e-3)
    assert "B*T*T" in meta["formula"]


def test_compiled_side_by_side(tmp_path):
    df, _ = run(tmp_path, "--compile-backend", "aot_eager")
    assert [c for c in df.columns if c.startswith("fwd")] == ["fwd ms eager", "fwd ms compiled (aot_eager)"]
    assert (df["bwd ms compiled (aot_eager)"].astype(float) > 0).all()


def test_compile_failure_and_oom_are_cells_and_the_sweep_goes_on(tmp_path, monkeypatch):
    def broken_compile(fn, backend):
        def run(q, k, v):
            if q.shape[1] == 32:
                raise RuntimeError("backend exploded [badly]")
            try:
                raise torch.OutOfMemoryError("CUDA out of memory")
            except torch.OutOfMemoryError as oom:
                raise RuntimeError("compiler wrapped it") from oom
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    df, _ = run(tmp_path)
    assert df["fwd ms compiled"].tolist() == ["compile failed (RuntimeError)", "OOM"]
    assert df["mem MiB compiled"].tolist() == ["compile failed (RuntimeError)", "OOM"]
    assert (df["fwd ms eager"].astype(float) > 0).all()


def test_eager_oom_is_a_cell(tmp_path, monkeypatch):
    real = attention.measure

    def measure(attend, batch_size, seq_len, *args):
        if seq_len == 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
        return real(attend, batch_size, seq_len, *args)

    monkeypatch.setattr(attention, "measure", measure)
    df, _ = run(tmp_path, "--variants", "eager")
    assert df["fwd ms eager"].tolist()[1] == "OOM" and float(df["fwd ms eager"].tolist()[0]) > 0


@pytest.mark.parametrize("argv, message", [
    (["--passes", "0"], "--passes: must be at least 1, got 0"),
    (["--T", "0"], "--T"),
    (["--warmup", "0"], "--warmup >= 1"),
    (["--variants", "fast"], "fast not among"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        attention.main(["--no-save", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_memory_matches_the_formula_on_cuda():
    dev = torch.device("cuda")
    result = attention.measure(attention.naive_attention, 8, 1024, 64, torch.float32, 1, 2, dev)
    predicted = attention.predicted_bytes(8, 1024, 64, 4) / 2**20
    assert result["mem MiB"] == pytest.approx(predicted, rel=0.02)
