"""The config of each problem size class, first found: the choice tuned in this process or on disk by an
earlier tuning on this machine (a JSON file per GPU and software versions under
``$FLASHATTN_TRITON_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashattn_triton``, else
``~/.cache/flashattn_triton``); the choice shipped for sm_90 (``tuned/sm90.json``, where the package holds
one); else ``default_config``. Tuning runs only when asked (``FLASHATTN_TRITON_AUTOTUNE=1``,
``flashattn_triton.tune(...)``), never under CUDA graph capture or a compile trace;
``FLASHATTN_TRITON_AUTOTUNE=0`` runs the defaults only; ``FLASHATTN_TRITON_AUTOTUNE_LOG=1`` prints each
tuning's timings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashattn_triton._configs import Problem, describe
from flashattn_triton._launcher import (
    env_flag,
    gpu_milliseconds,
    out_of_resources,
    triton_version,
    write_atomically,
)

# The cache files' format: a change makes a new subdirectory rather than misread old files.
FORMAT = 2
# Candidates within this fraction of the fastest tie (near-equal kernels' times vary that much between
# processes), and the first of them wins.
TIE = 0.01
ROUNDS, ROUND_MS = 3, 4  # rounds over every candidate, and the GPU time queued for each, ms


_requested = False  # set by flashattn_triton.tune()


def autotune_enabled() -> bool:
    """Whether a class with no known choice is tuned: only when asked (see the module docstring)."""
    return _requested or env_flag("FLASHATTN_TRITON_AUTOTUNE", False)


def defaults_only() -> bool:
    return not _requested and not env_flag("FLASHATTN_TRITON_AUTOTUNE", True)


def default_config(candidates: list, problem: Problem) -> Any:
    """The heuristic config: the Gluon kernels' first where the dispatch table chose them, else the first."""
    if problem.hopper:
        return next((c for c in candidates if c.hopper), candidates[0])
    return candidates[0]


SHIPPED = Path(__file__).parent / "tuned" / "sm90.json"


def cache_dir() -> Path:
    """Where the tuned choices live (see the module docstring)."""
    explicit = os.environ.get("FLASHATTN_TRITON_CACHE_DIR")
    if explicit:
        root = Path(explicit).expanduser()
    else:
        user_cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(user_cache).expanduser() / "flashattn_triton"
    return root / f"v{FORMAT}"


def tuning_forbidden() -> bool:
    """Inside a CUDA graph capture (timing would launch into the graph, and sync) or a compile trace."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-").lower()


class TuningCache:
    """Tuned configs by (device, Problem.size_key), in memory and in one file per GPU and versions."""

    def __init__(self) -> None:
        self.chosen: dict[tuple, Any] = {}
        self.stored: dict[Path, dict[str, Any]] = {}  # each file's entries, read on first use

    def file(self, device: torch.device) -> Path:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        # (the package's version read where it is: importing the package here would be an import cycle)
        package = sys.modules[__package__].__version__
        versions = f"torch-{torch.__version__}-triton-{triton_version()}-flashattn_triton-{package}"
        return cache_dir() / f"{_slug(gpu)}-{_slug(versions)}.json"

    def choose(self, run: Callable[[Any], None], candidates: list, problem: Problem,
               device: torch.device) -> Any:  # fmt: skip
        """The config of `problem`: its class's known choice, else the fastest candidate timed with
        run(config) where tuning was asked for and may run, else the default."""
        if len(candidates) == 1 or defaults_only():
            return default_config(candidates, problem)
        key = (device, problem.size_key)
        config = self.known(candidates, problem, device)
        if config is None:
            if not autotune_enabled() or tuning_forbidden():
                return default_config(candidates, problem)
            times = self._time(run, candidates)
            if not times:
                return default_config(candidates, problem)
            fastest = min(times.values())
            config = next(c for c in candidates if c in times and times[c] <= fastest * (1 + TIE))
            name = "|".join(map(str, problem.size_key))
            if os.environ.get("FLASHATTN_TRITON_AUTOTUNE_LOG"):
                timings = ", ".join(f"{describe(c)} {ms:.4f} ms" for c, ms in times.items())
                print(f"flashattn_triton tuned {name}: {timings} -> {describe(config)}", file=sys.stderr)
            self._store(self.file(device), name, config, times, candidates)
        self.chosen[key] = config
        return config

    def known(self, candidates: list, problem: Problem, device: torch.device,
              capability: tuple[int, int] | None = None) -> Any:  # fmt: skip
        """The choice of problem's class made earlier (in this process or on disk) or shipped for its GPU
        (capability: a described device's), or None."""
        config = self.chosen.get((device, problem.size_key))
        if config is not None or defaults_only():
            return config
        name = "|".join(map(str, problem.size_key))
        if capability is None:  # (a described device's choices are the shipped ones only)
            config = self._decode(self._entries(self.file(device)).get(name), candidates)
            capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if config is None and capability == (9, 0) and not _requested:
            config = self._decode(self._entries(SHIPPED).get(name), candidates)
        return config

    @staticmethod
    def _time(run: Callable[[Any], None], candidates: list) -> dict[Any, float]:
        """Each candidate's best GPU time a call over ROUNDS rounds of all candidates (timed once each, the
        first ones met a GPU still raising its clocks)."""
        times: dict[Any, float] = {}
        failed = set()
        for _ in range(ROUNDS):
            for candidate in candidates:
                if candidate in failed:
                    continue
                try:
                    ms = gpu_milliseconds(lambda c=candidate: run(c), ROUND_MS)
                except Exception as exc:  # too big for this GPU, or a build this Triton refuses: skipped
                    failed.add(candidate)
                    times.pop(candidate, None)
                    if not isinstance(exc, out_of_resources()):  # anything else is a bug to show
                        warnings.warn(f"flashattn_triton: config {describe(candidate)} failed while tuning, "
                                      f"skipped: {type(exc).__name__}: {str(exc)[:300]}", RuntimeWarning,
                                      stacklevel=4)  # fmt: skip
                    continue
                times[candidate] = min(ms, times.get(candidate, ms))
        return times

    @staticmethod
    def _decode(entry: dict | None, candidates: list) -> Any:
        """The candidate an entry names; None without one, or where it was chosen among other candidates."""
        if not isinstance(entry, dict) or entry.get("candidates") != [describe(c) for c in candidates]:
            return None
        return next((c for c in candidates if dataclasses.asdict(c) == entry.get("config")), None)

    def _entries(self, path: Path) -> dict[str, Any]:
        entries = self.stored.get(path)
        if entries is None:
            entries = self.stored[path] = self._read(path)
        return entries

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):  # none yet, unreadable or torn: tune again (and rewrite it)
            return {}
        return entries if isinstance(entries, dict) else {}

    def _store(self, path: Path, name: str, config: Any, times: dict[Any, float], candidates: list) -> None:
        """Add an entry (choice, candidates, times) to the file as re-read now, replacing it whole through a
        renamed temporary file, so that no reader sees half a file."""
        entry = {"config": dataclasses.asdict(config), "candidates": [describe(c) for c in candidates],
                 "times_ms": {describe(c): t for c, t in times.items()}}  # fmt: skip
        entries = {**self._read(path), name: entry}
        self.stored[path] = entries
        try:
            write_atomically(path, json.dumps(entries, indent=1, sort_keys=True).encode())
        except OSError as exc:  # a read-only home: the choice still holds for this process
            warnings.warn(f"flashattn_triton: could not write the tuning cache {path}: {exc}", RuntimeWarning,
                          stacklevel=4)  # fmt: skip


TUNING = TuningCache()
