"""NCCL on real GPUs: tests/nccl_smoke.py under torchrun, one rank per GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs for NCCL")
def test_every_strategy_on_nccl_matches_one_process():
    script = Path(__file__).with_name("nccl_smoke.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={torch.cuda.device_count()}", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nccl smoke test passed" in done.stdout
