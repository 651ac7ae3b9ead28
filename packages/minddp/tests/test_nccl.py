"""NCCL on real GPUs: tests/nccl_smoke.py under torchrun, one rank per GPU."""

from __future__ import annotations

import importlib.util
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
    done = subprocess.run(command, capture_output=True, text=True,
                          timeout=1200)  # hang guard: a deadlocked NCCL collective; takes under a minute
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nccl smoke test passed" in done.stdout


def _fsdp_comparison(rank: int, world_size: int) -> None:
    spec = importlib.util.spec_from_file_location("nccl_smoke", Path(__file__).with_name("nccl_smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    smoke.fsdp_matches_one_process(rank, world_size, torch.device("cpu"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_smoke_tests_fsdp_comparison_holds_on_gloo(ranks, world_size):
    """The NCCL smoke test's FSDP check, on CPU ranks, where bf16 sums over ranks round as on GPUs: its
    tolerance must hold beyond one rank (an AdamW comparison failed on 2 H200s and here alike)."""
    ranks(_fsdp_comparison, world_size)
