"""Runs interpreted_features.py in a subprocess with TRITON_INTERPRET=1 (the feature kernels on CPU).

Triton decides between compiling and interpreting when a kernel is defined, so the interpreter needs
its own process; this keeps the variable out of every other test of the same pytest run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_feature_kernels_under_the_interpreter(triton_interpreter):
    here = Path(__file__).parent
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
               "--rootdir", str(here), "-o", "addopts=", str(here / "interpreted_features.py")]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=280)  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        f"interpreted feature tests failed ({summary}):\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    )
