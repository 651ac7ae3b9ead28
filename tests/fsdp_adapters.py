"""The three FSDP adapters of the CS336 2026 systems assignment's tests, backed by minddp.FSDP.

The assignment's ``tests/adapters.py`` declares them; its FSDP tests reach the implementation only
through them, so pointing those three names here runs the public tests against minddp.
"""

from __future__ import annotations

import torch
from torch import nn

from minddp import FSDP

CAST_MODULES = ("Linear", "Embedding")


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> FSDP:
    """``module`` fully sharded over the default group. With ``compute_dtype``, the weights of its Linear
    and Embedding modules compute in it and every other module's (the norms') in fp32, as the
    assignment's mixed-precision reference does (and as autocast keeps norms)."""
    keep = {type(m) for m in module.modules() if type(m).__name__ not in CAST_MODULES and m._parameters}
    return FSDP(module, compute_dtype=compute_dtype, keep_dtype_modules=keep)


def fsdp_on_after_backward(fsdp_model: FSDP, optimizer: torch.optim.Optimizer) -> None:
    """After ``backward()``, before ``optimizer.step()``: nothing left (backward reduced every gradient)."""
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: FSDP) -> dict[str, torch.Tensor]:
    """Every parameter whole, keyed by ``fsdp_model.module.named_parameters()``'s names."""
    return fsdp_model.gather_full_params()
