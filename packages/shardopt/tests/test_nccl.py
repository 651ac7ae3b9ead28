"""The distributed checks on 2 GPUs with NCCL: in-place all-gather, state moved point-to-point."""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("shardopt_distributed_checks_nccl",
                                               Path(__file__).with_name("distributed_checks.py"))
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return checks.launch(2, tmp_path_factory.mktemp("nccl"), backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("check", checks.checks_for(2))
def test_on_two_gpus(check, outcomes):
    assert outcomes[check] == "ok", outcomes[check]
