"""``fully_shard``: torch FSDP2's API (names, arguments, semantics) over minddp's flat collectives.

Applied bottom-up (each block, then the root), in place. Each call makes the module's parameters that
no inner call took into one unit (:class:`minddp.fsdp_group.ParamGroup`): DTensors sharded on dim 0,
registered as the module's parameters for good, so ``model.parameters()``, torch's optimizers,
``clip_grad_norm_``, ``torch.distributed.checkpoint`` and ``get_state_dict``/``set_state_dict`` see them
as they see FSDP2's. The module's class becomes ``FSDP<Class>``, a subclass with :class:`FSDPModule`'s
methods.

The unit is all-gathered before its forward (the next unit's all-gather in flight meanwhile) and freed
after it (``reshard_after_forward``); gathered again when its backward begins (the previous unit's in
flight); its gradient is reduce-scattered as soon as its backward is done. The last reduction
finishes, and the gradients land on the parameters, in a callback the autograd engine runs at the end
of ``backward()``: nothing is left pending for the optimizer to miss. A backward that raised leaves
its partial gradients behind; the next forward discards them, with any unsynchronized accumulation.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from minddp.backward_callback import queue_at_end_of_backward
from minddp.collectives import all_gather_objects
from minddp.fsdp_api import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    as_mp_policy,
    as_offload_policy,
)
from minddp.fsdp_comm import FlatCollectives, PendingReduce
from minddp.fsdp_group import ParamGroup
from minddp.nested import map_tensors, tensors_in

_FULL_PRECISION = MixedPrecisionPolicy()  # frozen: one default object serves every call
_COMMS: dict[tuple[dist.ProcessGroup, str], FlatCollectives] = {}
_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
# Set on each parameter a fully_shard call replaced by a DTensor ("<Class>.<name>"): a module outside the call
# that still holds it shares it with the call, and sharding it twice would train two copies.
_SHARDED_BY = "_minddp_sharded_by"


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = _FULL_PRECISION,
    offload_policy: Any = None,
) -> nn.Module:
    """Shard ``module``'s parameters (those no inner ``fully_shard`` took) over ``mesh``; returns ``module``.

    Args:
        module: call on each block first, then on the root. It may be on the meta device (then
            ``model.to_empty(device=...)`` and initialise the DTensor parameters in place before use).
        mesh: a 1-D :class:`DeviceMesh` (shard over it) or a 2-D one (HSDP: replicate over dim 0, shard
            over dim 1). Default: every rank of the default group, on CUDA if available, else CPU.
        reshard_after_forward: free the gathered parameters after the forward and gather them again for
            the backward (ZeRO-3); ``False`` keeps them to the backward (ZeRO-2). The root module keeps
            them either way, as FSDP2's does: its backward starts right after its forward.
        mp_policy: a :class:`MixedPrecisionPolicy` (minddp's or torch's).
        offload_policy: ``None`` or a :class:`CPUOffloadPolicy` (minddp's or torch's).

    The configuration (parameter names, shapes, dtypes, policies) is compared across the ranks with one
    small all-gather: a rank that differs raises the same error on every rank.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"module: fully_shard was already applied to this {type(module).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward: expected a bool, got {reshard_after_forward!r} "
            "(FSDP2's int form is not supported)"
        )
    mp, offload = as_mp_policy(mp_policy), as_offload_policy(offload_policy)
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh: expected a 1-D (FSDP) or 2-D (HSDP: replicate, shard) mesh, got {mesh.ndim}-D"
        )
    named = _managed_params(module)
    _check_same_config_on_every_rank(module, named, mesh, reshard_after_forward, mp, offload)
    state = FSDPState(module, named, mesh, reshard_after_forward, mp, offload)
    for name, param, _ in named:
        setattr(param, _SHARDED_BY, f"{type(module).__name__}.{name}")
    module._fsdp_state = state
    module.__class__ = _fsdp_class(type(module))
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward, prepend=False)
    if state.group is not None:
        module.register_load_state_dict_post_hook(lambda *_: state.group.rehome())
    return module


class UnshardHandle:
    """What :meth:`FSDPModule.unshard` returns with ``async_op=True``: ``wait()`` for the full parameters."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.use_unsharded()
            self._group = None


class FSDPModule:
    """The methods a ``fully_shard``-ed module gains (FSDP2's names). Its class is ``FSDP<Class>``."""

    _fsdp_state: FSDPState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (the forward then does not wait for them)."""
        group = self._fsdp_state.group
        if group is not None:
            group.unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters; its attributes go back to the sharded DTensors."""
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates full (unsharded) gradients without reducing them, until a backward
        with ``True`` reduces the sum (gradient accumulation without communication)."""
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: keep the gathered parameters after backward (the next forward then gathers nothing)."""
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` (in order) when this module's forward begins (instead of the next one)."""
        self._fsdp_state.forward_prefetch = _states_of(modules, "modules")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather ``modules`` when this module's backward begins, instead of the implicit one-behind."""
        self._fsdp_state.backward_prefetch = _states_of(modules, "modules")

    def _states(self, recurse: bool) -> list[FSDPState]:
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._fsdp_state for m in modules if isinstance(m, FSDPModule)]

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # to_empty / .to() / .cuda() swap the DTensors' local tensors: point them back at the flat shard.
        self.reshard()
        result = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.rehome()
        return result

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(
            "a fully_shard-ed module cannot be deep-copied (as with FSDP2): copy the model before "
            "fully_shard, or save and load a state dict"
        )


class _Context:
    """What the units under one root share during an iteration."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states
        self.forward_order: list[FSDPState] = []
        self.last_forward_order: list[FSDPState] = []
        self.pending: tuple[FSDPState, PendingReduce] | None = None
        self.reduced: list[tuple[ParamGroup, torch.Tensor]] = []
        self.backward_running = False

    def complete_pending(self) -> None:
        if self.pending is None:
            return
        state, pending = self.pending
        self.pending = None
        shard = pending.wait()
        if state.replicate_comm is not None:  # HSDP: then average the shards over the replicas
            state.replicate_comm.all_reduce_mean(shard)
        self.reduced.append((state.group, state.group.shard_grad(shard)))


class FSDPState:
    """One ``fully_shard`` call's state: its unit, settings and forward/backward hooks."""

    def __init__(
        self,
        module: nn.Module,
        named: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: DeviceMesh,
        reshard_after_forward: bool,
        mp: MixedPrecisionPolicy,
        offload: OffloadPolicy,
    ) -> None:
        self.module, self.mp = module, mp
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self.is_root: bool | None = None
        self.ctx: _Context | None = None
        self.in_backward = False
        device = _mesh_device(mesh)
        shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_comm = _comm(mesh.get_group(0), device) if mesh.ndim == 2 else None
        placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        is_offload = isinstance(offload, CPUOffloadPolicy)
        self.group = (
            ParamGroup(
                named,
                mesh,
                placements,
                _comm(shard_group, device),
                device,
                mp.param_dtype,
                mp.reduce_dtype,
                is_offload,
                is_offload and offload.pin_memory,
                self._on_grad_ready,
            )
            if named
            else None
        )

    # --- forward ----------------------------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.is_root is None:
            self._lazy_init()
        ctx = self.ctx
        if self.is_root:
            if ctx.backward_running:  # the last backward raised before its end
                _discard_failed_backward(ctx)
            ctx.last_forward_order, ctx.forward_order = (ctx.forward_order or ctx.last_forward_order), []
        if self.group is not None:
            self.group.use_unsharded()
        if not self.in_backward:  # (in backward: activation checkpointing recomputes this forward)
            ctx.forward_order.append(self)
            for state in self._forward_prefetch():
                state.group.unshard()
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp.param_dtype)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.in_backward:
            return output
        needing_grad = [t for t in tensors_in(output) if t.requires_grad]
        if needing_grad:
            register_multi_grad_hook(needing_grad, functools.partial(_pre_backward, self), mode="any")
        if self.group is not None and ((self.reshard_after_forward and not self.is_root) or not needing_grad):
            self.group.reshard()
        if self.mp.output_dtype is not None:
            output = _cast_floats(output, self.mp.output_dtype)
        return output

    def _forward_prefetch(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return [s for s in self.forward_prefetch if s.group is not None]
        order = self.ctx.last_forward_order
        following = order[order.index(self) + 1 : order.index(self) + 2] if self in order else []
        return [s for s in following if s.group is not None]

    # --- backward ---------------------------------------------------------------------------------------

    def pre_backward(self) -> None:
        ctx = self.ctx
        if not ctx.backward_running:
            ctx.backward_running = True
            queue_at_end_of_backward(functools.partial(_finish_backward, ctx))
        self.in_backward = True
        if self.group is not None:
            self.group.use_unsharded()
        if self.backward_prefetch is not None:
            prefetch = self.backward_prefetch
        else:
            order = ctx.forward_order
            prefetch = order[order.index(self) - 1 : order.index(self)] if self in order[1:] else []
        for state in prefetch:
            if state.group is not None:
                state.group.unshard()

    def _on_grad_ready(self, group: ParamGroup) -> None:
        if self.reshard_after_backward:
            group.reshard()
        if self.requires_gradient_sync:
            self.start_reduce()

    def start_reduce(self) -> None:
        pending = self.group.start_reduce()
        self.ctx.complete_pending()  # at most one reduction in flight: it holds a full gradient
        self.ctx.pending = (self, pending)

    # --- setup ------------------------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """The first forward: this module is the root of every fully_shard-ed module under it."""
        states = [m._fsdp_state for m in self.module.modules() if isinstance(m, FSDPModule)]
        ctx = _Context(states)
        for state in states:
            if state.is_root is not None and state is not self:
                raise RuntimeError(
                    "fully_shard: a module ran its forward on its own before its parent's; run "
                    "the model's forward first (FSDP2 makes the same demand)"
                )
            state.is_root, state.ctx = state is self, ctx
            if state.group is not None:
                state.group.rehome()


def _pre_backward(state: FSDPState, _grads: Any) -> None:
    state.pre_backward()


def _finish_backward(ctx: _Context) -> None:
    """Run by the autograd engine at the end of backward: reduce what is left, land the gradients, reshard."""
    for state in ctx.states:
        if state.group is not None and state.requires_gradient_sync and state.group.has_unreduced_grad:
            state.start_reduce()  # a unit whose gradient hook did not fire (a part of it unused)
    ctx.complete_pending()
    for group, grad in ctx.reduced:
        group.accumulate_grads(grad)
    ctx.reduced = []
    for state in ctx.states:
        if state.group is not None and state.reshard_after_backward:
            state.group.reshard()
        state.in_backward = False
    ctx.backward_running = False


def _discard_failed_backward(ctx: _Context) -> None:
    """Drop what a backward that raised left: the reduction in flight, the reduced and full gradients."""
    if ctx.pending is not None:
        ctx.pending[1].wait()
        ctx.pending = None
    ctx.reduced = []
    for state in ctx.states:
        if state.group is not None:
            state.group.drop_unreduced_grad()
            state.group.reshard()
        state.in_backward = False
    ctx.backward_running = False


# --- helpers ------------------------------------------------------------------------------------------------


def _managed_params(module: nn.Module) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """(name, parameter, every (module, attribute) holding it) for the parameters this call shards: those of
    ``module``'s submodules not under an inner fully_shard; one an inner (or other) call holds is refused."""
    inner: dict[int, str] = {}
    own_modules: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if m is not module and isinstance(m, FSDPModule):
            for name, p in m.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
                inner.setdefault(id(p), name)
            continue
        own_modules.append((prefix, m))
        stack.extend((f"{prefix}{name}.", child) for name, child in reversed(list(m.named_children())))
    found: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for prefix, m in own_modules:
        for attr, p in m._parameters.items():
            if p is None:
                continue
            owner = inner.get(id(p)) or getattr(p, _SHARDED_BY, None)
            if owner is not None:
                raise ValueError(
                    f"module: parameter {prefix + attr!r} is shared with {owner!r}, which another "
                    "fully_shard call already shards; put the modules sharing it in one fully_shard "
                    "call (as torch >= 2.13's FSDP2 asks)"
                )
            entry = found.setdefault(id(p), (prefix + attr, p, []))
            if (m, attr) not in [(pm, pa) for pm, pa in entry[2]]:
                entry[2].append((m, attr))
    return list(found.values())


def _check_same_config_on_every_rank(
    module: nn.Module,
    named: list[tuple[str, nn.Parameter, Any]],
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    mp: MixedPrecisionPolicy,
    offload: OffloadPolicy,
) -> None:
    """Raise the same error on every rank if any rank's call differs from the group's first rank's."""
    signature = [
        f"module {type(module).__name__}",
        f"mesh shape {tuple(mesh.shape)}",
        f"reshard_after_forward={reshard_after_forward}",
        f"mp_policy={mp}",
        f"offload_policy={offload}",
    ]
    signature += [
        f"parameter {n} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}" for n, p, _ in named
    ]
    device = _mesh_device(mesh)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if dist.get_world_size(group) == 1:
            continue
        gathered = all_gather_objects(signature, group, device)
        for rank, other in enumerate(gathered[1:], start=1):
            if other != gathered[0]:
                first = next(
                    (i for i, (a, b) in enumerate(zip(gathered[0], other, strict=False)) if a != b),
                    min(len(gathered[0]), len(other)),
                )
                ours = gathered[0][first] if first < len(gathered[0]) else "nothing"
                theirs = other[first] if first < len(other) else "nothing"
                raise ValueError(
                    f"fully_shard: rank 0 has {ours} where rank {rank} has {theirs} (mesh dim "
                    f"{dim}); every rank must make the same call on the same model"
                )


def _default_mesh() -> DeviceMesh:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fully_shard needs an initialized process group: call torch.distributed."
            "init_process_group(...) first (torchrun sets up its environment), or pass mesh="
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _comm(group: dist.ProcessGroup, device: torch.device) -> FlatCollectives:
    key = (group, str(device))
    if key not in _COMMS:
        _COMMS[key] = FlatCollectives(group, device)
    return _COMMS[key]


def _fsdp_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


def _states_of(modules: Iterable[Any], argument: str) -> list[FSDPState]:
    modules = list(modules)
    bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise TypeError(f"{argument}: expected fully_shard-ed modules, got {', '.join(bad)}")
    return [m._fsdp_state for m in modules]


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``."""
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)
