import time

import pytest
import torch

import profkit
from profkit import timing


def test_timing_statistics():
    t = profkit.Timing.from_samples([1.0, 2.0, 3.0, 4.0])
    assert t.mean == 2.5
    assert t.std == pytest.approx(1.2909944, rel=1e-6)  # sample (n-1) standard deviation
    assert t.mean_ms == 2500.0
    assert profkit.Timing.from_samples([0.5]).std == 0.0
    with pytest.raises(ValueError, match="samples"):
        profkit.Timing.from_samples([])


def test_warmup_steps_are_not_recorded_and_each_phase_is_timed():
    calls = []

    def step(phase):
        calls.append("step")
        with phase("forward"):
            time.sleep(0.002)
        if len(calls) % 2 == 0:
            with phase("backward"):
                pass

    times = profkit.time_phases(step, warmup=3, steps=4)
    assert len(calls) == 7
    assert len(times["forward"].samples) == 4
    # backward ran on calls 4 and 6 (measured); call 2 was warm-up
    assert len(times["backward"].samples) == 2
    assert min(times["forward"].samples) >= 0.002  # sleep guarantees at least this long


def test_device_is_synchronized_around_every_phase(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "synchronize", lambda device=None: log.append(("sync", device)))

    def step(phase):
        with phase("forward"):
            log.append("forward body")
        log.append("between")
        with phase("optimizer"):
            log.append("optimizer body")

    profkit.time_phases(step, warmup=0, steps=1, device="cpu")
    assert log == [("sync", "cpu"), "forward body", ("sync", "cpu"), "between",
                   ("sync", "cpu"), "optimizer body", ("sync", "cpu")]


def test_time_steps_counts_calls_and_validates_arguments():
    counter = []
    t = profkit.time_steps(lambda: counter.append(1), warmup=2, steps=5)
    assert len(counter) == 7 and len(t.samples) == 5
    with pytest.raises(ValueError, match="steps=0"):
        profkit.time_steps(lambda: None, warmup=1, steps=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        profkit.time_steps(lambda: None, warmup=-1, steps=1)


def test_ranges_mark_warmup_measured_steps_and_phases(nvtx_sink):
    def step(phase):
        with phase("forward"):
            pass

    profkit.time_phases(step, warmup=1, steps=2)
    assert nvtx_sink.pushed() == ["warmup 0", "forward", "step 0", "forward", "step 1", "forward"]
    assert nvtx_sink.balanced()


def test_phase_that_raises_leaves_ranges_balanced(nvtx_sink):
    def step(phase):
        with phase("forward"):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        profkit.time_phases(step, warmup=0, steps=1)
    assert nvtx_sink.balanced()


def test_synchronize_accepts_cpu_and_none():
    profkit.synchronize("cpu")
    profkit.synchronize(torch.device("cpu"))
    profkit.synchronize()


def test_peak_memory_is_read_per_measured_phase(monkeypatch):
    resets, reads = [], iter(range(100))
    monkeypatch.setattr(timing, "reset_peak_memory", lambda device=None: resets.append(device))
    monkeypatch.setattr(timing, "read_peak_memory",
                        lambda device=None: profkit.PeakMemory(next(reads), 0, 0))
    clock = timing.PhaseClock("cuda:0", track_memory=True)
    monkeypatch.setattr(timing, "synchronize", lambda device=None: None)

    def step(phase):
        with phase("forward"):
            pass
        with phase("backward"):
            pass

    timing.run_steps(step, warmup=1, steps=2, clock=clock)
    assert len(resets) == 6 and set(resets) == {"cuda:0"}
    assert [p.allocated for p in clock.peaks["forward"]] == [0, 2]
    assert [p.allocated for p in clock.peaks["backward"]] == [1, 3]
    assert profkit.read_peak_memory("cpu") is None
