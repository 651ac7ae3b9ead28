"""flash_attention compiled in the end-to-end model, and benchmarks.flash's CUDA-graph mode."""

import pytest
import torch

from benchmarks import e2e, flash
from benchmarks.common import device_slug, read_results


def test_compiled_model_with_flash_attention_reports_speedups_over_sdpa(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    e2e.main(["--results-dir", str(tmp_path), "--size", "tiny", "--context", "16", "--warmup", "1",
              "--steps", "2", "--compile", "--compile-backend", "aot_eager", "--attention", "flash,sdpa"])
    times, _ = read_results(tmp_path / device_slug() / "e2e_train.csv")
    ratios, _ = read_results(tmp_path / device_slug() / "e2e_train_vs_sdpa.csv")
    assert list(ratios["attention"]) == ["flash"]
    flash_ms, sdpa_ms = (times.set_index("attention").loc[a, "step ms"] for a in ("flash", "sdpa"))
    assert ratios["step x sdpa"][0] == pytest.approx(sdpa_ms / flash_ms, rel=1e-2)
    assert (ratios[["fwd x sdpa", "bwd x sdpa"]] > 0).all().all()


def test_speedups_leave_out_of_memory_cells_blank():
    rows = [{"size": "xl", "context": 2048, "precision": "bf16", "attention": a, "fwd ms": f, "bwd ms": b,
             "step ms": s} for a, f, b, s in [("flash", 1.0, 2.0, 4.0), ("sdpa", 2.0, 3.0, "OOM")]]
    ratios = e2e.speedups(rows, baseline="sdpa")
    assert ratios.to_dict("records") == [{"size": "xl", "context": 2048, "precision": "bf16",
                                          "attention": "flash", "fwd x sdpa": 2.0, "bwd x sdpa": 1.5,
                                          "step x sdpa": ""}]


def test_cuda_graphs_need_cuda(capsys):
    with pytest.raises(SystemExit):
        flash.main(["--cuda-graphs", "--device", "cpu", "--no-save"])
    assert "--cuda-graphs captures CUDA graphs and needs a CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_time_every_pass_of_triton_and_sdpa_flash():
    df = flash.main(["--cuda-graphs", "--seq", "1024", "--dims", "64", "--dtypes", "bfloat16", "--shapes", "",
                     "--impls", "triton,sdpa-flash", "--warmup", "5", "--rep", "20", "--no-save"])
    for which in flash.PASSES:
        assert (df[f"{which} ms"].map(lambda x: isinstance(x, float) and x > 0)).all(), df
        assert df.set_index("impl").loc["sdpa-flash", f"{which} x flash"] == 1.0
