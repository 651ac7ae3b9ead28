"""Wall-clock timing of training steps, whole or phase by phase, with the device synchronized.

A *step* is a callable that takes a ``phase`` function and wraps each part of its work in
``with phase("forward"): ...``. Every phase synchronizes the device before and after its body, so
its time is the time of its own kernels, and is annotated with a :func:`profkit.nvtx.range` of the
same name (NVTX, and a ``torch.profiler.record_function`` range while a profiler records, which
:mod:`profkit.kernels` uses to attribute kernels to phases). Work outside any phase is not timed.
"""

from __future__ import annotations

import math
import statistics
import timeit
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from profkit import nvtx
from profkit.memory import PeakMemory, read_peak_memory, reset_peak_memory

Phase = Callable[[str], AbstractContextManager[None]]
Step = Callable[[Phase], object]


@dataclass(frozen=True)
class Timing:
    """Seconds per measured step: the samples, their mean and sample standard deviation."""

    samples: tuple[float, ...]
    mean: float
    std: float

    @classmethod
    def from_samples(cls, samples: list[float] | tuple[float, ...]) -> Timing:
        if not samples:
            raise ValueError("samples is empty: a Timing needs at least one measurement")
        samples = tuple(samples)
        std = statistics.stdev(samples) if len(samples) > 1 else 0.0
        return cls(samples=samples, mean=statistics.fmean(samples), std=std)

    @property
    def mean_ms(self) -> float:
        return self.mean * 1e3

    @property
    def std_ms(self) -> float:
        return self.std * 1e3

    def __str__(self) -> str:
        return f"{self.mean_ms:.3f} ± {self.std_ms:.3f} ms (n={len(self.samples)})"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for all queued work on ``device`` (default: the current CUDA device if there is one)."""
    device = torch.device(device) if device is not None else None
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


class PhaseClock:
    """The ``phase`` function handed to a step: times, synchronizes and annotates each phase.

    ``record`` is off during warm-up, so only measured steps contribute samples. With
    ``track_memory`` (CUDA only) each measured phase also gets its peak memory in ``peaks``.
    """

    def __init__(self, device: torch.device | str | None = None, track_memory: bool = False) -> None:
        self.device = device
        self.track_memory = track_memory
        self.samples: dict[str, list[float]] = {}
        self.peaks: dict[str, list[PeakMemory]] = {}
        self.record = True

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        if self.track_memory:
            reset_peak_memory(self.device)
        with nvtx.range(name):
            start = timeit.default_timer()
            yield
            synchronize(self.device)
            elapsed = timeit.default_timer() - start
        if self.record:
            self.samples.setdefault(name, []).append(elapsed)
            peak = read_peak_memory(self.device) if self.track_memory else None
            if peak is not None:
                self.peaks.setdefault(name, []).append(peak)

    def timings(self) -> dict[str, Timing]:
        return {name: Timing.from_samples(samples) for name, samples in self.samples.items()}


class PhaseMarker:
    """A ``phase`` function that only marks phases (NVTX and profiler ranges): no timing, no sync.

    What :func:`profkit.trace` hands to a step, so that a trace shows the step as it runs unprofiled,
    with communication free to overlap across phase boundaries.
    """

    record = True

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        with nvtx.range(name):
            yield


def run_steps(step: Step, warmup: int, steps: int, clock: PhaseClock | PhaseMarker,
              measuring: AbstractContextManager[object] | None = None) -> None:
    """Call ``step(clock)`` ``warmup`` times unrecorded, then ``steps`` times recorded.

    The measured calls run inside ``measuring`` (a profiler, say) when given. Each call is wrapped
    in an NVTX range "warmup i" or "step i" so a timeline shows which is which.
    """
    if warmup < 0:
        raise ValueError(f"warmup={warmup} must be >= 0")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    clock.record = False
    for i in range(warmup):
        with nvtx.range(f"warmup {i}"):
            step(clock)
    clock.record = True
    with measuring or nullcontext():
        for i in range(steps):
            with nvtx.range(f"step {i}"):
                step(clock)


def time_phases(step: Step, warmup: int = 5, steps: int = 10,
                device: torch.device | str | None = None) -> dict[str, Timing]:
    """Time each phase of ``step`` over ``steps`` measured calls after ``warmup`` unmeasured ones.

    >>> def step(phase):
    ...     with phase("forward"):
    ...         loss = model(x).sum()
    ...     with phase("backward"):
    ...         loss.backward()
    >>> times = time_phases(step, warmup=2, steps=5)   # {"forward": Timing, "backward": Timing}

    A phase that runs in some steps only gets fewer samples; one that never ran is absent.
    """
    clock = PhaseClock(device)
    run_steps(step, warmup, steps, clock)
    return clock.timings()


def time_steps(fn: Callable[[], object], warmup: int = 5, steps: int = 10,
               device: torch.device | str | None = None, name: str = "step") -> Timing:
    """Time ``fn()`` as one phase: ``steps`` samples after ``warmup`` unmeasured calls."""

    def step(phase: Phase) -> None:
        with phase(name):
            fn()

    return time_phases(step, warmup, steps, device)[name]


def total_mean(timings: dict[str, Timing]) -> float:
    """Mean seconds of a whole step: the sum of its phases' means (NaN if there are none)."""
    return math.fsum(t.mean for t in timings.values()) if timings else math.nan
