import socket

import pytest
import torch
import torch.distributed as dist

from benchmarks.allreduce import bus_bandwidth, calls_for, main, measure
from benchmarks.common import read_results
from minddp.launch import launch


def test_bus_bandwidth_is_the_ring_traffic_per_link():
    assert bus_bandwidth(1e9, 1.0, 2) == pytest.approx(1e9)  # two ranks: every byte crosses once each way
    assert bus_bandwidth(1e9, 1.0, 4) == pytest.approx(1.5e9)
    assert bus_bandwidth(1e9, 2.0, 6) == pytest.approx(2 * 5 / 6 * 0.5e9)


def test_big_tensors_get_fewer_calls_but_at_least_three():
    mib = 2**20
    assert calls_for(1 * mib, 10) == 10
    assert calls_for(1024 * mib, 10) == 4
    assert calls_for(4096 * mib, 10) == 3
    assert calls_for(1 * mib, 2) == 3


def test_main_measures_gloo_and_writes_table_and_plot(tmp_path):
    main(["--backends", "gloo", "--world-sizes", "2", "--sizes-mb", "1,2", "--iters", "3", "--warmup", "1",
          "--results-dir", str(tmp_path)])
    df, meta = read_results(tmp_path / "cpu" / "allreduce.csv") if not torch.cuda.is_available() else \
        read_results(next(tmp_path.glob("*/allreduce.csv")))
    assert list(df["size (MiB)"]) == [1, 2]
    assert (df["world size"] == 2).all() and (df["backend"] == "gloo").all()
    assert (df["median ms"] >= df["min ms"]).all() and (df["min ms"] > 0).all()
    assert df["bus GB/s"].tolist() == pytest.approx(df["alg GB/s"].tolist())  # n=2: bus = algorithm bandwidth
    assert "--world-sizes 2" in meta["command"]
    assert next(tmp_path.glob("*/allreduce.png")).stat().st_size > 0


def test_bad_world_size_is_refused_by_name():
    with pytest.raises(SystemExit):
        main(["--world-sizes", "1", "--no-save"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_nccl_without_gpus_is_skipped_with_a_message(capsys):
    main(["--backends", "nccl", "--no-save"])
    assert "skipped" in capsys.readouterr().out


def test_under_torchrun_launch_runs_in_this_process(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    try:
        rows = launch(measure, None, "gloo", args=("gloo", [1], 0, 1))
        assert dist.is_initialized() and rows[0]["world size"] == 1
        with pytest.raises(ValueError, match="WORLD_SIZE=1"):
            launch(measure, 2, "gloo", args=("gloo", [1], 0, 1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
