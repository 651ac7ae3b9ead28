import torch

from benchmarks.precision import accumulate, accumulation_table, autocast_dtypes


def test_float16_accumulator_drifts_and_float32_does_not():
    assert abs(accumulate(torch.float32, torch.float32, upcast=False) - 10.0) < 1e-3
    assert abs(accumulate(torch.float16, torch.float16, upcast=False) - 10.0) > 1e-2
    table = accumulation_table()
    assert (table["abs error"] == (table["sum"] - 10.0).abs()).all()


def test_autocast_keeps_parameters_and_loss_in_float32():
    seen = autocast_dtypes(torch.bfloat16, torch.device("cpu"))
    assert seen["parameters (inside autocast)"] == "torch.float32"
    assert seen["fc1 output"] == "torch.bfloat16"
    assert seen["loss"] == "torch.float32"
    assert seen["gradients"] == "torch.float32"


def test_main_writes_results_with_metadata(tmp_path):
    from benchmarks.common import read_results
    from benchmarks.precision import main

    main(["--results-dir", str(tmp_path)])
    df, meta = read_results(tmp_path / "cpu" / "precision_accumulation.csv")
    assert list(df["accumulator"]) == ["float32", "float16", "float32", "float32"]
    assert meta["command"] == f"python -m benchmarks.precision --results-dir {tmp_path}"
    assert meta["torch"] == torch.__version__
