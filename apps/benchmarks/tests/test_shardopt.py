import os
import signal
import subprocess
import sys

import pytest
import torch

from benchmarks.common import read_results
from benchmarks.shardopt import main, tables

MB = 1e6


def test_main_spawns_two_workers_and_accounts_memory_per_optimizer(tmp_path):
    main(["--results-dir", str(tmp_path), "--warmup", "0", "--iters", "1", "--trace-steps", "1",
          "--timeout", "900"])  # a hang guard for its workers: they take a minute
    memory, meta = read_results(tmp_path / "cpu" / "shardopt_memory.csv")
    assert meta["world_size"] == "2" and meta["model"] == "tiny" and "CPU" in meta["memory_accounting"]
    assert "peak_MB" not in memory.columns  # no allocator peak on CPU, so no made-up column
    assert len(memory) == 12
    by = memory.set_index(["optimizer", "phase"])
    assert by["parameters_MB"].nunique() == 1
    for name in ("AdamW (unsharded)", "ShardedOptimizer", "ShardedOptimizer (overlap_with)",
                 "ZeroRedundancyOptimizer"):
        assert by.loc[(name, "after init"), "gradients_MB"] == 0
        assert by.loc[(name, "after init"), "optimizer_state_MB"] == 0
        assert by.loc[(name, "before step"), "gradients_MB"] == by.loc[(name, "before step"), "parameters_MB"]
    unsharded = by.loc[("AdamW (unsharded)", "after step"), "optimizer_state_MB"]
    # AdamW keeps two moments per parameter; the sharded ones hold about half of that on each rank.
    params = by.loc[("AdamW (unsharded)", "after step"), "parameters_MB"]
    assert unsharded == pytest.approx(2 * params, rel=1e-3)
    for name in ("ShardedOptimizer", "ShardedOptimizer (overlap_with)", "ZeroRedundancyOptimizer"):
        assert 0.4 * unsharded < by.loc[(name, "after step"), "optimizer_state_MB"] < 0.75 * unsharded

    goal, _ = read_results(tmp_path / "cpu" / "shardopt_goal.csv")
    assert len(goal) == 2
    state_row = goal[goal["criterion"].str.contains("state")].iloc[0]
    assert state_row["met"] and state_row["measured"] <= state_row["limit"]
    time, _ = read_results(tmp_path / "cpu" / "shardopt_time.csv")
    assert (time["iteration_ms"] >= time["optimizer_step_ms"]).all() and (time["optimizer_step_ms"] > 0).all()
    # from the traces: every optimizer communicates (gradients; the sharded ones also gather parameters),
    # and the exposed part is within it
    assert (time["comm_ms"] > 0).all() and (time["exposed_comm_ms"] >= 0).all()
    assert (time["exposed_comm_ms"] <= time["comm_ms"]).all() and time["overlap_pct"].between(0, 100).all()


def test_runs_under_torchrun(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "benchmarks.shardopt", "--optimizers", "unsharded,sharded", "--warmup", "0",
               "--iters", "1", "--results-dir", str(tmp_path), "--timeout", "900"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        log, _ = process.communicate(timeout=1200)  # a hang guard; it takes under a minute
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, log[-4000:]
    goal, meta = read_results(tmp_path / "cpu" / "shardopt_goal.csv")
    assert meta["world_size"] == "2"
    assert len(goal) == 1 and goal["met"].all()  # no ZeRO in this run: only the memory criterion


def record(params, grads, state, peak, iteration_s=0.5, step_s=0.1, largest=0):
    phase = {"parameters": params, "gradients": grads, "optimizer state": state, "peak": peak}
    return {"memory": {p: phase for p in ("after init", "before step", "after step")},
            "iteration_s": iteration_s, "back_to_back_s": iteration_s, "step_s": step_s,
            "largest_param_state": largest}


def test_cuda_tables_take_the_worst_rank_and_other_is_peak_minus_tensors():
    per_rank = [{"unsharded": record(100 * MB, 100 * MB, 200 * MB, 500 * MB, largest=20 * MB),
                 "sharded": record(100 * MB, 100 * MB, 90 * MB, 350 * MB, step_s=0.10),
                 "zero": record(100 * MB, 100 * MB, 100 * MB, 400 * MB, step_s=0.12)},
                {"unsharded": record(100 * MB, 100 * MB, 200 * MB, 510 * MB, largest=20 * MB),
                 "sharded": record(100 * MB, 100 * MB, 125 * MB, 360 * MB, step_s=0.13),
                 "zero": record(100 * MB, 100 * MB, 100 * MB, 400 * MB, step_s=0.11)}]
    result = tables(per_rank, on_cuda=True)
    memory = result["memory"].set_index(["optimizer", "phase"])
    assert memory.loc[("ShardedOptimizer", "after step"), "optimizer_state_MB"] == 125
    assert memory.loc[("ShardedOptimizer", "after step"), "peak_MB"] == 360
    assert memory.loc[("ShardedOptimizer", "after step"), "other_MB"] == 360 - 100 - 100 - 125
    goal = result["goal"].set_index("criterion")["met"].tolist()
    assert goal == [False, False]  # 125 > 200/2 + 20, and the slowest sharded step 130 ms > 120 ms


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the 2 GPUs")
def test_cuda_without_two_gpus_is_refused():
    with pytest.raises(SystemExit):
        main(["--device", "cuda", "--no-save"])
