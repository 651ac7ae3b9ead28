"""Runs the interpreted_*.py modules, each in a subprocess with TRITON_INTERPRET=1: the tuned kernels
(interpreted_kernels.py), the feature kernels (interpreted_features.py), packed sequences on the tuned
kernels (interpreted_varlen.py) and issue 43's edge cases (interpreted_edge_cases.py), on CPU.

Triton decides between compiling and interpreting when a kernel is defined, so the interpreter needs
its own process; this keeps the variable out of every other test of the same pytest run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashattn_triton import FlashAttentionTriton
from flashattn_triton._launcher import interpreted

INTERPRETED = ["interpreted_kernels.py", "interpreted_features.py", "interpreted_varlen.py",
               "interpreted_edge_cases.py"]


@pytest.mark.parametrize("module", INTERPRETED)
def test_kernels_under_the_interpreter(triton_interpreter, module):
    here = Path(__file__).parent
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
               "--rootdir", str(here), "-o", "addopts=", str(here / module)]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=280)  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        f"{module} failed ({summary}):\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
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
