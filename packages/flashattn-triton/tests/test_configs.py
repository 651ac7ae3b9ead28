"""Configs and the choice of kernel, on the CPU: what the launcher accepts and refuses before any launch."""

from __future__ import annotations

import pytest
import torch

from flashattn_triton import _hopper, triton_impl
from flashattn_triton._configs import HOPPER_BACKWARD, BackwardConfig, smaller


def test_hopper_config_must_fit_the_kernel():
    with pytest.raises(ValueError, match="num_warps = block_n / 16"):
        BackwardConfig(64, 128, 4, 2, atomic_dq=True, hopper=True)
    with pytest.raises(ValueError, match="atomic_dq=True"):
        BackwardConfig(64, 128, 8, 2, hopper=True)
    with pytest.raises(ValueError, match="num_stages >= 2"):
        BackwardConfig(64, 128, 8, 1, atomic_dq=True, hopper=True)


def test_hopper_config_steps_down_to_the_triton_kernel():
    (config,) = HOPPER_BACKWARD
    triton_config = BackwardConfig(config.block_m, config.block_n, config.num_warps, config.num_stages, True)
    assert smaller(config) == triton_config


def test_described_configs_name_the_hopper_kernel():
    assert triton_impl._describe(BackwardConfig(64, 64, 4, 3, atomic_dq=True)) == "64/64/4/3/1"
    assert triton_impl._describe(HOPPER_BACKWARD[0]) == "64/128/8/4/1/168 hopper"


def test_hopper_kernel_refused_where_it_does_not_apply():
    pytest.importorskip("triton")
    q, k, v, out, grad_out = (torch.randn(1, 2, 256, 64, dtype=torch.bfloat16) for _ in range(5))
    assert not _hopper.supports(q, (q, k, v, out, grad_out), 64)  # CPU tensors
    lse = torch.zeros(1, 2, 256)
    with pytest.raises(ValueError, match="the Hopper kernel runs 16-bit problems with head dim 16, 32 or"):
        triton_impl.triton_backward(q, k, v, out, lse, grad_out, True, 0.125, HOPPER_BACKWARD[0])
