"""What the cross-package tests share: the two halves of a test file that is also its own torchrun worker.
The file's pytest side runs it through the run_under_torchrun fixture; its worker side (run as a script,
with tests/ on sys.path) calls run_cases_on_this_rank, which writes the RESULTS_DIR/rank{r}.json files
the fixture reads."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch.distributed as dist

# A hang guard, not a time limit: the torchrun worlds of these tests finish in under a minute on a busy
# 2-core machine; a deadlocked collective would wait forever.
HANG_GUARD_S = 1200


def run_cases_on_this_rank(results_dir: Path, cases: dict[str, Callable[[], None]]) -> None:
    """On each torchrun rank (gloo): run cases in order, recording 'ok' or the traceback of each in
    RESULTS_DIR/rank{r}.json; the first failure ends the process, so that torchrun stops the other
    ranks, which may be waiting in a collective."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))  # a deadlock guard
    results: dict[str, str] = {}
    out = results_dir / f"rank{dist.get_rank()}.json"
    for name, case in cases.items():
        try:
            case()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            out.write_text(json.dumps(results))
            os._exit(1)
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def _run_under_torchrun(
    script: str, results_dir: Path, cases: Iterable[str], world_size: int
) -> dict[str, str]:
    """Run script RESULTS_DIR on world_size ranks under torchrun (killed whole after HANG_GUARD_S), each rank
    writing RESULTS_DIR/rank{r}.json as {case: 'ok' or its traceback}; {case: 'ok' or why not}."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world_size}", script, str(results_dir)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=env)  # fmt: skip
    try:
        log, _ = process.communicate(timeout=HANG_GUARD_S)
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
