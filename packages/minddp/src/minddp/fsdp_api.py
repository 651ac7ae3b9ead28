"""The policies ``fully_shard`` takes, with torch FSDP2's names and fields (``torch.distributed.fsdp``).

torch's own ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy`` objects are accepted too (:func:`as_mp_policy`,
:func:`as_offload_policy`), so a script written for FSDP2 keeps its policies when it switches to minddp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision, as FSDP2's.

    Attributes:
        param_dtype: dtype of the gathered (unsharded) parameters, hence of the all-gather and of
            forward and backward compute. ``None``: the parameters' own dtype. The sharded
            parameters (master weights) and the optimizer step keep the parameters' dtype.
        reduce_dtype: dtype of the gradient reduce-scatter. ``None``: ``param_dtype`` if set, else the
            parameters' dtype. Gradients land on the shards in the parameters' dtype.
        output_dtype: dtype that floating-point forward outputs are cast to (``None``: left alone).
        cast_forward_inputs: cast the module's floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(
                    f"MixedPrecisionPolicy: {field}={value!r} is not a floating-point torch.dtype "
                    "(use e.g. torch.bfloat16, or None)"
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's base class): everything stays on the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and optimizer state in CPU memory; the optimizer steps on the CPU.

    Each unit's shard is copied to the device before its all-gather; each reduced gradient shard is
    copied back. ``pin_memory`` pins the shards (only where CUDA is available) for asynchronous copies.
    """

    pin_memory: bool = True


def as_mp_policy(policy: Any) -> MixedPrecisionPolicy:
    """minddp's policy for ``policy``: minddp's own, or torch's ``MixedPrecisionPolicy`` (same fields)."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if type(policy).__name__ == "MixedPrecisionPolicy" and all(hasattr(policy, f) for f in fields):
        return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in fields})
    raise TypeError(f"mp_policy: expected a MixedPrecisionPolicy (minddp's or torch's), got {policy!r}")


def as_offload_policy(policy: Any) -> OffloadPolicy:
    """minddp's policy for ``policy``: None, minddp's own, or torch's OffloadPolicy or CPUOffloadPolicy."""
    if policy is None or isinstance(policy, OffloadPolicy):
        return policy or OffloadPolicy()
    name = type(policy).__name__
    if name == "CPUOffloadPolicy" and hasattr(policy, "pin_memory"):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if name == "OffloadPolicy":
        return OffloadPolicy()
    raise TypeError(f"offload_policy: expected None, OffloadPolicy or CPUOffloadPolicy, got {policy!r}")
