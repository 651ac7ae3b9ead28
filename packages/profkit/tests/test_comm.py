import math
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from torch import nn

from profkit.comm import analyze_comm, bus_factor, canonical_collective, dtype_bytes, read_timeline


def cpu_rank(op, rank, gloo_start_ms, extra=()):
    """Main thread: compute 0-10 and 12-20 ms; gloo's thread: one all-reduce of 1000 floats to 14 ms."""
    events = [
        op("aten::mm", 0, 10),
        op("c10d::allreduce_", 10, 10.1),
        op("aten::add", 12, 20),
        op(
            "gloo:all_reduce",
            gloo_start_ms,
            14,
            tid=2,
            cat="user_annotation",
            **{"Input Dims": [[1000]], "Input type": ["float"]},
        ),
        *extra,
    ]
    return {
        "traceEvents": events,
        "baseTimeNanoseconds": 5_000,
        "profkit": {"rank": rank, "world_size": 2, "steps": 1},
    }


def test_cpu_traces_with_known_answers(chrome_event):
    op = chrome_event
    hook = [
        op("autograd::engine::evaluate_function: AccumulateGrad", 20, 25),
        op("c10d::allreduce_", 21, 21.1),
        op("aten::mul", 22, 23),
    ]
    report = analyze_comm([cpu_rank(op, 0, 10.5, hook), cpu_rank(op, 1, 12)])
    r0, r1 = report.ranks
    # rank 0: compute = 10 + 8 + 1 (the mul, not the hook node that issued a collective); the all-reduce
    # runs 10.5-14 and compute 12-14 hides 2 ms of it
    assert r0.compute_ms == pytest.approx(19.0)
    assert r0.comm_ms == pytest.approx(3.5)
    assert r0.exposed_ms == pytest.approx(1.5)
    assert r0.overlap_pct == pytest.approx(100 * 2 / 3.5)
    assert r1.comm_ms == pytest.approx(2.0) and r1.exposed_ms == pytest.approx(0.0)
    assert r1.overlap_pct == pytest.approx(100.0)
    # rank 0 arrived at 10.5, rank 1 at 12: rank 0 waits 1.5 ms for rank 1, the straggler
    assert r0.wait_ms == pytest.approx(1.5) and r1.wait_ms == pytest.approx(0.0)
    assert report.straggler == 1
    (collective,) = report.collectives
    assert collective.nbytes == 4000 and collective.transfer_ns == pytest.approx(2e6)
    assert collective.busbw == pytest.approx(4000 / 2e-3 * 2 * 1 / 2)
    total = report.total()
    assert total.comm_ms == pytest.approx(5.5) and total.exposed_ms == pytest.approx(1.5)
    rows = report.collective_rows()
    assert rows[0]["wait ms r0"] == pytest.approx(1.5) and rows[0]["last most often"] == 1


def test_cuda_kernels_and_clock_bases(chrome_event):
    op = chrome_event
    nccl = {"Collective name": "allreduce", "In msg nelems": 1_000_000, "Out msg nelems": 1_000_000,
            "dtype": "Float", "Group size": 2, "Process Group Name": "0"}

    def rank(r, nccl_start_ms, base_ns):
        return {
            "baseTimeNanoseconds": base_ns,
            "profkit": {"rank": r, "world_size": 2, "steps": 2},
            "traceEvents": [
                op("sm80_xmma_gemm", 0, 5, tid=7, cat="kernel"),
                op("Memcpy DtoD", 5, 6, tid=7, cat="gpu_memcpy"),
                op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", nccl_start_ms, 9, tid=8, cat="kernel", **nccl),
                op("aten::mm", 0, 1),
            ],
        }

    # rank 1's times are stored from a base 1 ms later: on the shared clock its all-reduce starts at 5 ms
    report = analyze_comm([rank(0, 3, 0), rank(1, 4, 1_000_000)])
    r0, r1 = report.ranks
    assert r0.device == "cuda"
    assert r0.compute_ms == pytest.approx(5 / 2)  # per step: the trace holds 2
    assert r0.comm_ms == pytest.approx(6 / 2) and r0.exposed_ms == pytest.approx(4 / 2)
    assert r0.overlap_pct == pytest.approx(100 * 2 / 6)
    assert r1.exposed_ms == pytest.approx(4 / 2)
    assert r0.wait_ms == pytest.approx(2 / 2) and report.straggler == 1
    (c,) = report.collectives
    assert c.name == "all_reduce" and c.group == "0" and c.nbytes == 4e6
    assert c.busbw == pytest.approx(4e6 / 5e-3 * 1.0)


def test_nccl_kernels_without_metadata_take_record_param_comms_by_external_id(chrome_event):
    op = chrome_event
    meta = {"Collective name": "_allgather_base", "In msg nelems": 1000, "Out msg nelems": 2000,
            "dtype": "BFloat16", "Group size": 2, "Process Group Name": "1", "External id": 7}
    document = {
        "profkit": {"rank": 0, "world_size": 2, "steps": 1},
        "traceEvents": [
            op("record_param_comms", 0, 0.1, **meta),
            op("ncclDevKernel_AllGather_RING_LL", 1, 3, tid=8, cat="kernel", **{"External id": 7}),
            op(
                "ncclDevKernel_AllGather_RING_LL", 4, 5, tid=8, cat="kernel", **{"External id": 99}
            ),  # no match
        ],
    }
    first, second = read_timeline(document).collectives
    assert (first.name, first.group, first.nbytes, first.group_size) == ("all_gather", "1", 4000, 2)
    assert second.name == "all_gather" and second.group == "default" and math.isnan(second.nbytes)


def test_collectives_only_one_rank_holds_are_left_out_of_the_waits(chrome_event):
    op = chrome_event
    late = op(
        "gloo:all_reduce",
        15,
        16,
        tid=2,
        cat="user_annotation",
        **{"Input Dims": [[10]], "Input type": ["float"]},
    )
    report = analyze_comm([cpu_rank(op, 0, 10.5, [late]), cpu_rank(op, 1, 12)])
    assert report.unmatched == {0: 1} and len(report.collectives) == 1
    assert report.ranks[0].comm_ms == pytest.approx(3.5 + 1.0)  # it ran, so it counts as communication
    assert report.ranks[0].wait_ms == pytest.approx(1.5)
    assert "Unmatched: rank 0 has 1 collective(s)" in report.format(markdown=True)


def test_collectives_gloo_ran_out_of_order_are_matched_by_kind(chrome_event):
    # gloo's thread pool started rank 1's broadcast before the all-gather issued ahead of it
    op = chrome_event
    gather = {"Input Dims": [[10]], "Input type": ["float"]}
    cast = {"Input Dims": [[4]], "Input type": ["float"]}
    rank0 = [op("gloo:all_gather", 10, 12, tid=2, cat="user_annotation", **gather),
             op("gloo:broadcast", 12, 13, tid=3, cat="user_annotation", **cast)]
    rank1 = [op("gloo:broadcast", 10.5, 13, tid=3, cat="user_annotation", **cast),
             op("gloo:all_gather", 11, 12, tid=2, cat="user_annotation", **gather)]
    report = analyze_comm([{**cpu_rank(op, 0, 0), "traceEvents": rank0},
                           {**cpu_rank(op, 1, 0), "traceEvents": rank1}])
    assert not report.unmatched
    by_name = {c.name: c for c in report.collectives}
    assert sorted(by_name) == ["all_gather", "broadcast"]
    assert by_name["all_gather"].nbytes == 2 * 40 and by_name["broadcast"].nbytes == 16
    starts = {r: c.start_ns for r, c in by_name["broadcast"].calls.items()}
    assert starts[0] - starts[1] == pytest.approx(1.5e6)  # rank 0's broadcast began 1.5 ms after rank 1's


def test_traces_of_different_steps_leave_collectives_unmatched_and_bad_input_is_an_error(chrome_event):
    op = chrome_event
    gather = op("gloo:all_gather", 10.5, 14, tid=2, cat="user_annotation")
    other = {**cpu_rank(op, 1, 12), "traceEvents": [*cpu_rank(op, 1, 12)["traceEvents"][:3], gather]}
    report = analyze_comm([cpu_rank(op, 0, 10.5), other])
    assert report.unmatched == {0: 1, 1: 1}
    with pytest.raises(ValueError, match="same rank"):
        analyze_comm([cpu_rank(op, 0, 10.5), cpu_rank(op, 0, 12)])
    with pytest.raises(ValueError, match="empty"):
        analyze_comm([])


def test_names_sizes_and_factors_follow_nccl_tests():
    assert [
        canonical_collective(n)
        for n in (
            "gloo:all_reduce",
            "allreduce",
            "_allgather_base",
            "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
            "allgather_into_tensor_coalesced",
            "gloo:broadcast",
        )
    ] == ["all_reduce", "all_reduce", "all_gather", "reduce_scatter", "all_gather", "broadcast"]
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8 and bus_factor("all_gather", 4) == 3 / 4
    assert bus_factor("broadcast", 4) == 1.0
    assert dtype_bytes("c10::BFloat16") == 2 and dtype_bytes("Float") == 4 and math.isnan(dtype_bytes("?"))


# --- a real 2-rank gloo run ------------------------------------------------------------------------------


def test_two_rank_gloo_ddp_run(tmp_path, monkeypatch):
    # Spawned ranks import the worker by its module's name: a module of this folder's, put on the path they
    # inherit, since the name pytest gives this file (tests.test_comm alone, packages.profkit... in the
    # repository's run) need not be importable there.
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    from gloo_ddp_worker import ddp_worker

    mp.start_processes(ddp_worker, args=(tmp_path / "store", tmp_path, 0.2), nprocs=2, start_method="spawn")
    report = analyze_comm([tmp_path / "rank0.json.gz", tmp_path / "rank1.json.gz"])
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for rank in report.ranks:
        assert rank.device == "cpu"
        # every gradient byte is all-reduced once a step, in more than one bucket
        assert rank.bytes == gradient_bytes and rank.collectives > 1
        assert rank.compute_ms > 0 and rank.comm_ms > 0
        assert 0 <= rank.exposed_ms <= rank.comm_ms and 0 <= rank.overlap_pct <= 100
        assert rank.wait_ms >= 0 and rank.step_ms > 0
    assert all(c.name == "all_reduce" and c.busbw > 0 for c in report.collectives)
    assert report.straggler == 1  # slept 0.2 s before each backward
    assert report.ranks[0].wait_ms > report.ranks[1].wait_ms
    text = report.format(markdown=True)
    assert "| rank |" in text and "Straggler: rank 1" in text
