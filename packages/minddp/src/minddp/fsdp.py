"""``FSDP(module, compute_dtype=...)``: the CS336 assignment's wrapper, a thin layer over :func:`fully_shard`.

It picks the units (each Transformer block), calls ``fully_shard`` on each and then on the model, and
keeps the assignment's methods. Everything else (DTensor parameters, reduction inside backward,
checkpoints through ``torch.distributed.checkpoint``) is ``fully_shard``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from minddp.collectives import broadcast_coalesced
from minddp.fsdp_api import MixedPrecisionPolicy
from minddp.fully_shard import FSDPModule, fully_shard


class FSDP(nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over the ranks of ``process_group``.

    Args:
        module: the model, built identically on every rank (rank 0's values are copied to all), or on
            the meta device (then ``fsdp.module.to_empty(device=...)`` and initialise it).
        compute_dtype: a floating-point dtype (e.g. ``torch.bfloat16``) the gathered weights and the
            floating-point inputs of each unit are cast to; the shards (master weights), their
            gradients and the optimizer state stay in the parameters' dtype, and gradients are reduced
            in it: ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=<parameters' dtype>)``.
        process_group: the group to shard over (default: the default group).
        wrap: module classes that each make a unit. Default: every module whose class name ends in
            ``Block``, else the children of every ``nn.ModuleList``. A match inside another belongs to
            the outer one. The model (the root unit) holds the rest.
        keep_dtype_modules: module classes (e.g. norm layers) made units of their own without mixed
            precision, so they compute in their parameters' dtype (as autocast keeps norms in float32).

    ``fsdp.module`` is the ``fully_shard``-ed model itself: its parameters are DTensors sharded on dim 0;
    calling it directly is the same as calling ``fsdp``.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        compute_dtype: torch.dtype | None = None,
        process_group: dist.ProcessGroup | None = None,
        wrap: Iterable[type[nn.Module]] | None = None,
        keep_dtype_modules: Iterable[type[nn.Module]] = (),
    ) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "FSDP needs an initialized process group: call torch.distributed."
                "init_process_group(...) first (torchrun sets up its environment)"
            )
        if compute_dtype is not None and not (
            isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"compute_dtype={compute_dtype!r} is not a floating-point torch.dtype "
                "(use e.g. torch.bfloat16, or None to compute in the parameters' dtype)"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ValueError("process_group: this rank is not a member of the given process group")
        tensors = [*module.parameters(), *module.buffers()]
        device = tensors[0].device if tensors else torch.device("cpu")
        mesh = DeviceMesh.from_group(group, "cuda" if device.type == "cuda" else "cpu")
        if not any(t.is_meta for t in tensors):
            broadcast_coalesced(tensors, 0, group)
        keep = _module_classes(keep_dtype_modules, "keep_dtype_modules")
        params_dtype = next((p.dtype for p in module.parameters()), None)
        policy = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=params_dtype if compute_dtype is not None else None
        )
        for unit in [*_unit_modules(module, wrap).values(), *_kept_modules(module, keep).values()][::-1]:
            if not isinstance(unit, FSDPModule):
                fully_shard(
                    unit, mesh=mesh, mp_policy=MixedPrecisionPolicy() if isinstance(unit, keep) else policy
                )
        self.module = fully_shard(module, mesh=mesh, mp_policy=policy)
        self.compute_dtype = compute_dtype
        self.process_group = group

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Kept for the assignment's interface: ``backward()`` already returned with every gradient
        reduced onto its shard (a DTensor ``.grad`` on each parameter), so there is nothing to wait for."""

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value on every rank, keyed by ``module.named_parameters()``'s names.

        A collective: call it on every rank."""
        return {name: _full(param) for name, param in self.module.named_parameters()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with every tensor whole, on every rank (a collective).

        :meth:`load_full_state_dict` takes it at any world size."""
        gathered: dict[int, torch.Tensor] = {}  # by tensor: a tied weight is gathered once for all its keys
        full = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if id(value) not in gathered:
                gathered[id(value)] = _full(value.detach())
            full[key] = gathered[id(value)]
        return full

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a :meth:`full_state_dict` saved at any world size; each rank keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # A copy: set_model_state_dict swaps the dict's tensors for their DTensor shards in place.
        set_model_state_dict(self.module, dict(state_dict), options=StateDictOptions(full_state_dict=True))

    def sharded_state_dict(self) -> dict[str, Any]:
        """``module.state_dict()``: DTensors for ``torch.distributed.checkpoint`` (which reshards on load)."""
        return self.module.state_dict()

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``dcp.load`` filled into a :meth:`sharded_state_dict`."""
        self.module.load_state_dict(state_dict)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def _module_classes(classes: Any, argument: str) -> tuple[type[nn.Module], ...]:
    classes = (classes,) if isinstance(classes, type) else tuple(classes)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise TypeError(f"{argument}: expected nn.Module subclasses, got {bad!r}")
    return classes


def _unit_modules(root: nn.Module, wrap: Iterable[type[nn.Module]] | None) -> dict[str, nn.Module]:
    """The outermost submodules that make units, by name, in module order."""
    if wrap is not None:
        classes = _module_classes(wrap, "wrap")
        matches = lambda m: isinstance(m, classes)
    elif any(type(m).__name__.endswith("Block") for m in root.modules()):
        matches = lambda m: type(m).__name__.endswith("Block")
    else:
        list_children = {id(child) for m in root.modules() if isinstance(m, nn.ModuleList) for child in m}
        matches = lambda m: id(m) in list_children
    found: dict[str, nn.Module] = {}
    for name, m in root.named_modules():
        if m is root or not matches(m) or any(name.startswith(outer + ".") for outer in found):
            continue
        if wrap is not None and not any(True for _ in m.parameters()):
            raise ValueError(
                f"wrap: module {name!r} ({type(m).__name__}) has no parameters to shard; "
                "leave its class out of wrap"
            )
        found[name] = m
    return found


def _kept_modules(root: nn.Module, classes: tuple[type[nn.Module], ...]) -> dict[str, nn.Module]:
    """The modules of ``classes`` (keep_dtype_modules) that hold parameters of their own."""
    return {
        name: m
        for name, m in root.named_modules()
        if classes and m is not root and isinstance(m, classes) and m._parameters
    }
