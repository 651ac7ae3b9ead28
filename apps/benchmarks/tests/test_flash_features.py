"""benchmarks.flash --feature on CPU, at tiny sizes: the table and its ratios (the GPU run is the lead's)."""

from benchmarks import flash_features
from benchmarks.common import read_results
from benchmarks.flash import main


def test_gqa_feature_writes_ours_and_the_baseline_with_ratios(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(flash_features, "GQA_SEQ", 32)
    main(["--device", "cpu", "--feature", "gqa", "--dtypes", "float32", "--warmup", "1", "--rep", "5",
          "--results-dir", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("*/flash-features.csv")
    df, _ = read_results(path)
    rows = df.set_index("impl")
    pairs = ["causal", "not causal"]
    assert list(rows.index) == [
        f"{impl} {pair}" for pair in pairs for impl in ("flash_attention", "sdpa enable_gqa")
    ]
    for pair in pairs:
        assert float(rows.loc[f"sdpa enable_gqa {pair}", "fwd x baseline"]) == 1.0
        for which in ("fwd", "bwd"):
            ours = float(rows.loc[f"flash_attention {pair}", f"{which} ms"])
            base = float(rows.loc[f"sdpa enable_gqa {pair}", f"{which} ms"])
            ratio = float(rows.loc[f"flash_attention {pair}", f"{which} x baseline"])
            assert ours > 0 and abs(ratio - base / ours) < 0.01


def test_window_speedup_reads_full_causal_over_windowed():
    import pandas as pd

    df = pd.DataFrame([
        {"feature": "window", "impl": "flash_attention window 1024", "fwd ms": 1.0, "bwd ms": 2.0},
        {"feature": "window", "impl": "flex_attention window", "fwd ms": 1.5, "bwd ms": 3.0},
        {"feature": "window", "impl": "flash_attention full causal", "fwd ms": 7.0, "bwd ms": 12.0},
    ])  # fmt: skip
    assert flash_features.window_speedup(df).endswith("fwd 7.00x, bwd 6.00x")


def test_repeats_keep_each_cases_median_over_rounds(monkeypatch):
    """--repeats: every case timed once a round, rounds over all the feature's cases, the median kept (here
    round 0 reads 9 ms, round 1 2 ms, round 2 1 ms for every pass: 2 ms each, neither the first nor the
    last round's)."""
    import torch

    monkeypatch.setattr(flash_features, "GQA_SEQ", 32)
    per_round = [9.0, 2.0, 1.0]
    calls = []

    def timer(fn):
        calls.append(fn)
        return per_round[(len(calls) - 1) // 8]  # 4 cases, fwd and bwd each: 8 timings a round

    df = flash_features.run_features(["gqa"], torch.device("cpu"), torch.float32, 1, timer, repeats=3)
    assert len(calls) == 24
    assert (df["fwd ms"] == 2.0).all() and (df["bwd ms"] == 2.0).all()


def test_a_pass_without_a_time_says_why_in_its_cells_and_ratios(monkeypatch):
    """A timer's reason instead of a time (--cuda-graphs: "capture failed") stays in the pass's cells, its
    ratios and the window's speedup, where a division would have raised; the other passes keep theirs."""
    import pandas as pd
    import torch

    monkeypatch.setattr(flash_features, "GQA_SEQ", 32)
    calls = []

    def timer(fn):
        calls.append(fn)
        return "capture failed" if len(calls) == 2 else 1.0  # the first case's backward

    df = flash_features.run_features(["gqa"], torch.device("cpu"), torch.float32, 1, timer)
    first = df.iloc[0]
    assert first["bwd ms"] == "capture failed" and first["bwd x baseline"] == "capture failed"
    assert first["fwd ms"] == 1.0 and first["fwd x baseline"] == 1.0
    failed = "capture failed"
    window = pd.DataFrame([
        {"feature": "window", "impl": "flash_attention window 1024", "fwd ms": 1.0, "bwd ms": failed},
        {"feature": "window", "impl": "flash_attention full causal", "fwd ms": 7.0, "bwd ms": 12.0},
    ])  # fmt: skip
    assert flash_features.window_speedup(window).endswith("fwd 7.00x, bwd capture failed")
