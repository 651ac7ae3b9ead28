import pickle

import numpy as np
import pytest
import torch

import profkit
from profkit import memory

TORCH_LINEAR = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125,
                "name": "forward"}
SCORES = {"filename": "/repo/model.py", "line": 10, "name": "attention_scores"}
MLP = {"filename": "/repo/model.py", "line": 20, "name": "forward"}
CPP = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": list(frames)}


def free(addr, size):
    return [{"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": []},
            {"action": "free_completed", "addr": addr, "size": size, "stream": 0, "frames": []}]


def small_snapshot():
    """Positions (after n alloc/free events) and bytes live:
    0: weights 100 + early 50 = 150 | 1: +A 200 | 2: +B 30 | 3: -A | 4: +C 400 | 5: -early (peak was 580 at 4)
    """
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 4096, "stream": 0, "frames": []},
        alloc(0x100, 200, CPP, TORCH_LINEAR, SCORES),
        alloc(0x200, 30, MLP),
        *free(0x100, 200),
        alloc(0x300, 400, TORCH_LINEAR, SCORES),
        *free(0x900, 50),  # allocated before recording began
        {"action": "oom", "addr": 0, "size": 10**9, "stream": 0, "device_free": 0, "frames": []},
    ]
    segment = {"device": 0, "address": 0x000, "total_size": 4096, "stream": 0, "blocks": [
        {"address": 0x000, "size": 100, "state": "active_allocated", "requested_size": 100, "frames": []},
        {"address": 0x200, "size": 30, "state": "active_allocated", "requested_size": 30, "frames": [MLP]},
        {"address": 0x300, "size": 400, "state": "active_allocated", "requested_size": 400,
         "frames": [SCORES]},
        {"address": 0x490, "size": 3000, "state": "inactive", "requested_size": 0, "frames": []},
    ]}
    return {"segments": [segment], "device_traces": [trace]}


def test_frame_label_skips_library_and_cpp_frames():
    label = memory.frame_label([CPP, TORCH_LINEAR, SCORES])
    assert label == "model.py:10 attention_scores › linear.py:125 forward"
    assert memory.frame_label([SCORES, MLP]) == "model.py:10 attention_scores"
    assert memory.frame_label([CPP, TORCH_LINEAR]) == "linear.py:125 forward"
    assert memory.frame_label([CPP]) == "??:0 c10::cuda::CUDACachingAllocator::malloc"
    assert memory.frame_label([]) == memory.NO_PYTHON_FRAMES


def test_trace_reads_allocations_including_those_made_before_recording():
    trace = memory.read_trace(small_snapshot())
    assert trace.events == 5 and trace.oom_positions == [5]
    spans = {(a.size, a.start, a.end, a.label) for a in trace.allocations}
    assert spans == {
        (200, 1, 3, "model.py:10 attention_scores › linear.py:125 forward"),
        (30, 2, 6, "model.py:20 forward"),
        (400, 4, 6, "model.py:10 attention_scores › linear.py:125 forward"),
        (50, 0, 5, memory.BEFORE_RECORDING),
        (100, 0, 6, memory.BEFORE_RECORDING),  # still allocated, never seen in the trace
    }
    assert [a.start for a in trace.allocations] == sorted(a.start for a in trace.allocations)


def test_timeline_stacks_bands_and_labels_the_largest_sources():
    timeline = memory.build_timeline(memory.read_trace(small_snapshot()), top=2)
    assert list(timeline.total) == [150, 350, 380, 180, 580, 530]
    assert timeline.peak_bytes == 580 and timeline.peak_position == 4
    assert [(s.label, s.largest, s.count) for s in timeline.sources] == [
        ("model.py:10 attention_scores › linear.py:125 forward", 400, 2), (memory.BEFORE_RECORDING, 100, 2)]
    # B (30 bytes, unlabelled) sits on top of A until A is freed, then drops by A's 200 bytes.
    (b_band,) = [band for band in timeline.bands if band.label is None]
    assert list(b_band.x) == [2, 3, 4, 5]
    assert list(b_band.lower) == [350, 150, 150, 100]
    assert list(b_band.upper - b_band.lower) == [30, 30, 30, 30]
    # Bands never overlap: at every position the labelled and unlabelled heights sum to the total.
    height = np.zeros(timeline.x.size)
    for band in timeline.bands:
        height[np.searchsorted(timeline.x, band.x)] += band.upper - band.lower
    assert list(height) == list(timeline.total)


def test_downsampling_keeps_the_peak():
    trace = [alloc(0x10, 1000, MLP)]
    for i in range(5000):
        size = 10**6 if i == 3333 else 10
        trace += [alloc(0x1000 + i, size, SCORES), *free(0x1000 + i, size)]
    snapshot = {"segments": [], "device_traces": [[], trace]}
    timeline = memory.build_timeline(memory.read_trace(snapshot), max_points=200)
    assert timeline.x.size <= 200
    assert timeline.peak_bytes == 1000 + 10**6
    assert memory.read_trace(snapshot).events == 10001  # device 1 picked: the one with events


def test_render_writes_a_png(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(small_snapshot()))
    png = tmp_path / "out" / "timeline.png"
    timeline = profkit.render_memory_timeline(path, png, title="synthetic")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline.peak_bytes == 580


def test_bad_snapshots_are_named(tmp_path):
    with pytest.raises(ValueError, match="no trace events"):
        memory.read_trace({"segments": [], "device_traces": [[], []]})
    with pytest.raises(ValueError, match="device=3"):
        memory.read_trace(small_snapshot(), device=3)
    bad = tmp_path / "x.pickle"
    bad.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a CUDA memory snapshot"):
        memory.load_snapshot(bad)
    with pytest.raises(ValueError, match="top=-1"):
        memory.build_timeline(memory.read_trace(small_snapshot()), top=-1)


def test_peaks_are_none_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    profkit.reset_peak_memory()
    assert profkit.read_peak_memory() is None
    with pytest.raises(RuntimeError, match="needs CUDA"):
        with profkit.record_memory_history("x.pickle"):
            pass


def test_record_memory_history_dumps_and_stops_even_on_error(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda enabled="all", **kw: calls.append(
        ("record", enabled, kw.get("stacks"))))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot",
                        lambda filename: (calls.append(("dump", filename)),
                                          open(filename, "wb").write(pickle.dumps(small_snapshot()))))
    path = tmp_path / "deep" / "snap.pickle"
    with pytest.raises(torch.OutOfMemoryError), profkit.record_memory_history(path):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert calls == [("record", "all", "python"), ("dump", str(path)), ("record", None, None)]
    assert memory.load_snapshot(path)["device_traces"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_snapshot_round_trip(tmp_path):
    model = torch.nn.Linear(256, 256, device="cuda")
    profkit.reset_peak_memory()
    with profkit.record_memory_history(tmp_path / "s.pickle") as path:
        model(torch.randn(64, 256, device="cuda")).sum().backward()
    peak = profkit.read_peak_memory()
    assert peak.allocated > 0 and peak.reserved >= peak.allocated
    timeline = profkit.render_memory_timeline(path, tmp_path / "s.png")
    assert timeline.peak_bytes > 0 and timeline.sources
