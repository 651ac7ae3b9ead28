import math

import pandas as pd
import pytest

from benchmarks import flash
from benchmarks.common import read_results
from benchmarks.flash import add_ratios, forward_flops, geomean_summary, main, median_time, parse_shape


def test_tiny_sweep_writes_every_cell(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--device", "cpu", "--seq", "64,96", "--dims", "16", "--dtypes", "float32", "--shapes", "",
            "--impls", "triton,torch,naive,sdpa-flash,sdpa-cudnn", "--naive-max-seq", "64",
            "--warmup", "1", "--rep", "5", "--results-dir", str(tmp_path)]  # fmt: skip
    main(argv)
    (path,) = tmp_path.glob("*/flash.csv")  # under this machine's device name
    df, meta = read_results(path)
    assert meta["command"].startswith("python -m benchmarks.flash --device cpu --seq 64,96")
    assert len(df) == 2 * 5
    cells = df.set_index(["T", "impl"])
    for seq in (64, 96):
        assert float(cells.loc[(seq, "torch"), "fwd ms"]) > 0
        assert float(cells.loc[(seq, "sdpa-flash"), "fwd+bwd x flash"]) == 1.0
        assert cells.loc[(seq, "triton"), "bwd ms"] == "unsupported"  # CPU tensors, no interpreter
        assert cells.loc[(seq, "sdpa-cudnn"), "fwd ms"] == "unsupported"
    assert float(cells.loc[(64, "naive"), "bwd ms"]) > 0
    assert cells.loc[(96, "naive"), "fwd ms"] == "skipped"


def test_max_minutes_skips_what_is_left(tmp_path):
    df = main(["--device", "cpu", "--seq", "64", "--dims", "16", "--dtypes", "float32", "--shapes", "",
               "--impls", "naive,sdpa-flash", "--max-minutes", "1e-12", "--no-save"])  # fmt: skip
    assert (df["fwd ms"] == "skipped").all()


def test_repeats_run_in_rounds_over_every_cell_and_keep_the_median(monkeypatch):
    calls = []
    scripted = {"naive": iter([3.0, 1.0, 2.0]), "sdpa-flash": iter([5.0, 9.0, 4.0])}

    def fake_measure(fn, shape, causal, passes, dev, timer):
        impl = "naive" if fn is flash.naive_attention else "sdpa-flash"
        calls.append((shape.seq, impl))
        return dict.fromkeys(passes, next(scripted[impl]) if shape.seq == 64 else 1.0)

    monkeypatch.setattr(flash, "measure", fake_measure)
    df = main(["--device", "cpu", "--seq", "64,96", "--dims", "16", "--dtypes", "float32", "--shapes", "",
               "--impls", "naive,sdpa-flash", "--repeats", "3", "--no-save"])  # fmt: skip
    one_round = [(64, "naive"), (64, "sdpa-flash"), (96, "naive"), (96, "sdpa-flash")]
    assert calls == one_round * 3
    cells = df.set_index(["T", "impl"])
    assert cells.loc[(64, "naive"), "fwd ms"] == 2.0
    assert cells.loc[(64, "sdpa-flash"), "bwd ms"] == 5.0


def test_median_time_keeps_the_reason_only_when_nothing_was_timed():
    assert median_time(["OOM", 1.0, 3.0]) == 2.0
    assert median_time(["skipped", "skipped"]) == "skipped"


def test_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--repeats", "0", "--no-save"])
    assert "--repeats: must be at least 1, got 0" in capsys.readouterr().err


def test_ratios_and_tflops_from_times():
    rows = [
        {
            "batch*heads": 2,
            "T": 1024,
            "d": 64,
            "dtype": "bfloat16",
            "causal": True,
            "impl": impl,
            "fwd ms": fwd,
            "bwd ms": bwd,
        }
        for impl, fwd, bwd in [("triton", 1.0, 4.0), ("sdpa-flash", 2.0, 2.0), ("naive", "OOM", "OOM")]
    ]
    df = add_ratios(pd.DataFrame(rows), ["fwd", "bwd"], causal=True)
    triton = df[df["impl"] == "triton"].iloc[0]
    assert triton["fwd x flash"] == 2.0 and triton["bwd x flash"] == 0.5
    assert triton["fwd TFLOP/s"] == pytest.approx(forward_flops(2, 1024, 64, True) / 1e9, rel=1e-2)
    assert df[df["impl"] == "naive"].iloc[0]["fwd x flash"] == "-"
    assert "fwd x cudnn" not in df.columns  # no cuDNN rows, no cuDNN ratios
    lines = geomean_summary(df, ["fwd", "bwd"], min_seq=1024)
    assert any(
        "triton vs sdpa-flash" in line and "fwd 2.00x" in line and "bwd 0.50x" in line for line in lines
    )


def test_flops_and_shapes():
    assert forward_flops(1, 128, 64, causal=False) == 4 * 128 * 128 * 64
    assert forward_flops(1, 128, 64, causal=True) == 2 * 128 * 128 * 64
    assert parse_shape("16x16384x64") == (16, 16384, 64)
    with pytest.raises(ValueError, match="BATCHxTxD"):
        parse_shape("16x16384")
    assert math.isclose(forward_flops(16, 16384, 64, True) * 3.5 / 4.5e-3 / 1e12, 427.6, rel_tol=1e-3)


def test_help_explains_the_columns(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--naive-max-seq" in text and "x flash" in text
    assert "(default: None)" not in text  # '--seq ... (default 128,...,65536)' said once, not twice
    assert text.count("default 16,32,64,128") == 1 and "(default: 16384)" in text
    # the help is true on a CPU too: there sdpa-flash takes float32 and is the "x flash" baseline
    assert "on a CPU, SDPA's flash backend is PyTorch's CPU kernel, which takes float32" in text


def test_times_that_contradict_each_other_are_noise_not_findings():
    """The issue's CPU row: torch fwd 31.9 ms, bwd 0.719 ms, fwd+bwd 1.55 ms (a total below its part)."""
    df = pd.DataFrame({"batch*heads": 1, "T": [128, 128, 256, 256], "d": 16, "dtype": "float32",
                       "impl": ["torch", "sdpa-flash", "torch", "sdpa-flash"],
                       "fwd ms": [31.9, 0.0425, 1.0, 0.5], "bwd ms": [0.719, 0.1, 1.0, 1.0],
                       "fwd+bwd ms": [1.55, 11.5, 2.0, 0.9]})
    df = add_ratios(df, flash.PASSES, causal=True)
    assert flash.noisy_rows(df).tolist() == [True, False, False, True]
    shown = flash.shown_with_noise(df)
    assert shown.loc[0, "fwd ms"] == "31.9 (noise)" and shown.loc[0, "fwd+bwd TFLOP/s"].endswith("(noise)")
    assert shown.loc[0, "fwd x flash"].endswith("(noise)")
    assert shown.loc[1, "fwd ms"] == 0.0425  # a consistent row is left as measured
    # T = 256: the sdpa-flash baseline's fwd+bwd is below its bwd, so every ratio against it is noise too
    assert shown.loc[2, "fwd ms"] == 1.0 and shown.loc[2, "bwd x flash"].endswith("(noise)")
    assert not geomean_summary(df, flash.PASSES, min_seq=128)[0].count("n=2")  # noisy rows left out
