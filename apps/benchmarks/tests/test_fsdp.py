import pytest

from benchmarks.common import read_results
from benchmarks.fsdp import main


def test_two_cpu_ranks_hold_what_the_memory_model_says(tmp_path):
    main(["--results-dir", str(tmp_path), "--warmup", "0", "--iters", "1", "--trace-steps", "1",
          "--compute", "fp32,bf16", "--timeout", "900"])  # a hang guard for its workers: they take a minute
    table, meta = read_results(tmp_path / "cpu" / "fsdp.csv")
    assert meta["world_size"] == "2" and meta["model"] == "tiny"
    assert "peak_MB" not in table.columns  # no allocator peak on CPU, so no made-up column
    assert len(table) == 8
    by = table.set_index(["strategy", "compute"])
    for strategy in ("torch-ddp", "minddp-bucketed", "torch-fsdp2", "minddp-fsdp"):
        for compute in ("fp32", "bf16"):
            row = by.loc[(strategy, compute)]
            # Measured tensor sizes against the model: padding is the only slack.
            assert row["params_MB"] == pytest.approx(row["model_params_MB"], rel=1e-3)
            assert row["grads_MB"] == pytest.approx(row["model_grads_MB"], rel=1e-3)
            assert row["optimizer_MB"] == pytest.approx(row["model_optimizer_MB"], rel=1e-3)
            assert row["iteration_ms"] > 0
            # from the traces: every strategy communicates; the exposed part is within it
            assert row["comm_ms"] > 0 and 0 <= row["exposed_comm_ms"] <= row["comm_ms"]
            assert 0 <= row["overlap_pct"] <= 100
    ddp = by.loc[("torch-ddp", "fp32"), "params_MB"]
    assert by.loc[("minddp-fsdp", "fp32"), "params_MB"] == pytest.approx(ddp / 2, rel=0.01)
