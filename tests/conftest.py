"""Fixtures shared by the cross-package tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest


def _run_under_torchrun(
    script: str, results_dir: Path, cases: Iterable[str], world_size: int
) -> dict[str, str]:
    """Run script RESULTS_DIR on world_size ranks under torchrun (killed whole after 150 s), each rank
    writing RESULTS_DIR/rank{r}.json as {case: 'ok' or its traceback}; {case: 'ok' or why not}."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world_size}", script, str(results_dir)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env)  # fmt: skip
    try:
        log, _ = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log, _ = process.communicate()
    per_rank = [json.loads(p.read_text()) if p.exists() else {}
                for p in (results_dir / f"rank{r}.json" for r in range(world_size))]  # fmt: skip
    outcomes = {}
    for case in cases:
        failures = [f"rank {r}: {results[case]}" for r, results in enumerate(per_rank)
                    if results.get(case, "ok") != "ok"]  # fmt: skip
        unfinished = [r for r, results in enumerate(per_rank) if case not in results]
        if unfinished and not failures:
            failures = [f"ranks {unfinished} did not finish (torchrun exit code {process.returncode}):\n"
                        f"{log[-6000:]}"]  # fmt: skip
        outcomes[case] = "\n".join(failures) or "ok"
    return outcomes


@pytest.fixture(scope="session")
def run_under_torchrun() -> Callable[[str, Path, Iterable[str], int], dict[str, str]]:
    """A test file that is also its own torchrun worker runs itself with this (a fixture, as the tests
    are imported with --import-mode=importlib, which puts no test folder on sys.path)."""
    return _run_under_torchrun
