"""Runs interpreted_varlen.py in a subprocess with TRITON_INTERPRET=1 (packed sequences on
the tuned kernels, on CPU).

Triton decides between compiling and interpreting when a kernel is defined, so the interpreter needs
its own process; this keeps the variable out of every other test of the same pytest run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_varlen_tuned_kernels_under_the_interpreter(triton_interpreter):
    here = Path(__file__).parent
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
               "--rootdir", str(here), "-o", "addopts=", str(here / "interpreted_varlen.py")]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=280)  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        f"interpreted varlen tests failed ({summary}):\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    )
