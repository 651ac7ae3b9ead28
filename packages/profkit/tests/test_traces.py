import gzip
import json

import pytest
import torch
from torch import nn

import profkit
from profkit.traces import PROFKIT_TRACK, load_trace, move_ranges


@pytest.fixture
def make_step(training_step):
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        step = training_step(model, optimizer, torch.randn(8, 32))

        def clipped(phase):  # a profkit.nvtx range inside a phase lands on the track too
            with profkit.nvtx.range("clip"):
                step(phase)

        return clipped

    return make


def track_tids(document):
    return {
        e["tid"]
        for e in document["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name" and e["args"]["name"].startswith(PROFKIT_TRACK)
    }


def test_trace_is_gzipped_chrome_json_with_phases_on_their_own_track(tmp_path, make_step):
    path = profkit.trace(make_step(), path=tmp_path / "t.json.gz", warmup=1, steps=3)
    with path.open("rb") as f:
        assert f.read(2) == b"\x1f\x8b"
    with gzip.open(path, "rt") as f:
        document = json.load(f)
    assert document["profkit"]["steps"] == 3 and document["profkit"]["world_size"] == 1
    events = document["traceEvents"]
    (track,) = track_tids(document)
    ranges = [e for e in events if e.get("tid") == track and e.get("ph") == "X"]
    names = [e["name"] for e in sorted(ranges, key=lambda e: (e["ts"], -e["dur"]))]
    assert names == [n for i in range(3) for n in (f"step {i}", "clip", "forward", "backward", "optimizer")]
    # each phase nests in its step, and the track's slices nest properly (Perfetto drops those that don't)
    steps = [e for e in ranges if e["name"].startswith("step")]
    for e in ranges:
        if not e["name"].startswith("step"):
            assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] for s in steps), e
    # the profiler's own events stay where it put them: CPU operators on their thread
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    assert any(e["name"] == "aten::addmm" for e in ops)
    assert all(e["tid"] != track for e in ops)
    assert not any(
        e.get("cat") == "user_annotation" and e["name"] == "forward" and e["tid"] != track for e in events
    )


def test_tracing_context_manager_and_warmup_outside_the_trace(tmp_path, make_step):
    step = make_step()
    with profkit.tracing(tmp_path / "cm.json.gz", steps=1) as phase:
        step(phase)
    document = load_trace(tmp_path / "cm.json.gz")
    (track,) = track_tids(document)
    names = sorted(e["name"] for e in document["traceEvents"] if e.get("tid") == track and e.get("ph") == "X")
    assert names == ["backward", "clip", "forward", "optimizer"]
    path = profkit.trace(step, path=tmp_path / "w.json.gz", warmup=2, steps=1)
    names = {e["name"] for e in load_trace(path)["traceEvents"]}
    assert "step 0" in names and not any(n.startswith("warmup") for n in names)


def test_trace_records_module_ranges_of_annotate_modules(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with profkit.nvtx.annotate_modules(model), profkit.tracing(tmp_path / "m.json.gz"):
        model(torch.randn(2, 4))
    document = load_trace(tmp_path / "m.json.gz")
    (track,) = track_tids(document)
    assert sorted(
        e["name"] for e in document["traceEvents"] if e.get("tid") == track and e.get("ph") == "X"
    ) == ["0", "1"]


def test_move_ranges_leaves_other_annotations():
    document = {
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "forward", "pid": 1, "tid": 7, "ts": 0, "dur": 5},
            {"ph": "X", "cat": "user_annotation", "name": "mine", "pid": 1, "tid": 7, "ts": 1, "dur": 1},
            {"ph": "X", "cat": "cpu_op", "name": "forward", "pid": 1, "tid": 7, "ts": 1, "dur": 1},
        ]
    }
    moved = move_ranges(document, {"forward"})["traceEvents"]
    assert moved[0]["tid"] != 7 and moved[0]["args"]["thread"] == 7
    assert moved[1]["tid"] == 7 and moved[2]["tid"] == 7


def test_errors_name_the_argument(tmp_path, make_step):
    with pytest.raises(ValueError, match="steps=0"):
        profkit.trace(make_step(), path=tmp_path / "x.json.gz", steps=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        profkit.trace(make_step(), path=tmp_path / "x.json.gz", warmup=-1)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.json.gz")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="traceEvents"):
        load_trace(tmp_path / "bad.json")


def test_render_trace_draws_the_first_step(tmp_path, make_step):
    path = profkit.trace(make_step(), path=tmp_path / "r.json.gz", warmup=1, steps=2)
    document = load_trace(path)
    (track,) = track_tids(document)
    first = min(
        (e for e in document["traceEvents"] if e.get("tid") == track and e["name"] == "step 0"),
        key=lambda e: e["ts"],
    )
    assert profkit.traces._window(
        document["traceEvents"], profkit.traces._track_names(document["traceEvents"])
    ) == (first["ts"], first["ts"] + first["dur"])
    png = profkit.traces.render_trace(path, tmp_path / "r.png")
    with png.open("rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
