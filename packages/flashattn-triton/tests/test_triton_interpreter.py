"""Runs the interpreted_*.py modules, each in a subprocess with TRITON_INTERPRET=1: the tuned kernels
(interpreted_kernels.py), the feature kernels (interpreted_features.py), packed sequences on the tuned
kernels (interpreted_varlen.py) and issue 43's edge cases (interpreted_edge_cases.py), on CPU.

Triton decides between compiling and interpreting when a kernel is defined, so the interpreter needs
its own process; this keeps the variable out of every other test of the same pytest run. The
subprocess's per-test lines are echoed to the terminal as they come (the interpreter is slow, more so on
a busy machine), and no limit is put on its total time: only a subprocess that prints nothing for
SILENT_HANG_S is stopped, as hung.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flashattn_triton import FlashAttentionTriton
from flashattn_triton._launcher import interpreted

INTERPRETED = ["interpreted_kernels.py", "interpreted_features.py", "interpreted_varlen.py",
               "interpreted_edge_cases.py"]
# A hang guard, not a time limit: a single interpreted test prints its line within a minute or two even on
# a loaded 2-core machine, so this much silence means the subprocess is stuck.
SILENT_HANG_S = 1200


def run_echoing(command: list[str], env: dict[str, str],
                echo: Callable[[str], None]) -> tuple[int, list[str]]:
    """Run command, passing each line of its output to echo as it is printed; (exit status, all lines).

    Stops the command (and fails) only when it prints nothing for SILENT_HANG_S."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               bufsize=1)  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    while True:
        try:
            line = lines.get(timeout=SILENT_HANG_S)
        except queue.Empty:
            process.kill()
            process.wait()
            pytest.fail(f"{' '.join(command[-1:])}: no output for {SILENT_HANG_S} s, stopped as hung; "
                        "its last lines:\n" + "\n".join(seen[-40:]))
        if line is None:
            return process.wait(), seen
        seen.append(line)
        echo(line)


RESULTS = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def progress_echo(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Writes the subprocess's per-test result lines to this run's terminal, past pytest's capture."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def echo(line: str) -> None:
        if reporter is None or capture is None or "::" not in line or not any(w in line for w in RESULTS):
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"    interpreter: {line.rpartition('/')[2]}")

    return echo


@pytest.mark.timeout(0)  # the subprocess has its own hang guard (SILENT_HANG_S) and reports its progress
@pytest.mark.parametrize("module", INTERPRETED)
def test_kernels_under_the_interpreter(triton_interpreter, module, request):
    here = Path(__file__).parent
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:timeout",
               "-W", "ignore::pytest.PytestConfigWarning",  # pyproject timeout: no plugin
               "--import-mode=importlib", "--rootdir", str(here), "-o", "addopts=", str(here / module)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}  # lines as they come
    status, lines = run_echoing(command, env, progress_echo(request))
    summary = next((line for line in reversed(lines) if line.strip()), "")
    assert status == 0 and " passed" in summary and "skipped" not in summary, (
        f"{module} failed ({summary}):\n" + "\n".join(lines[-120:])
    )


def test_interpreter_requested_after_the_kernels_were_compiled_is_refused(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if interpreted():  # this process imported the kernels under TRITON_INTERPRET=1 itself
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 8, 16)
    with pytest.raises(RuntimeError, match="set it before the first call"):
        FlashAttentionTriton.apply(q, q, q)


def test_a_silent_subprocess_is_stopped_as_hung(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SILENT_HANG_S", 0.5)
    echoed = []
    with pytest.raises(pytest.fail.Exception, match="no output for 0.5 s, stopped as hung"):
        run_echoing([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                    dict(os.environ), echoed.append)
    assert echoed == ["started"]
