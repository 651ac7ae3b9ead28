"""Fully sharded data parallel (ZeRO stage 3) in the style of torch's FSDP2 ``fully_shard``.

The model's parameters are grouped into units (each Transformer block, plus a root unit for the
rest). Each rank keeps a flat 1/N shard of every unit (:mod:`minddp.fsdp_unit`); a unit is
all-gathered just before its module runs and freed just after, the next unit's gather in flight
meanwhile; the backward gathers again and reduce-scatters each unit's gradient to the shards as
soon as the unit's backward is done. Every collective is issued in the same order on every rank,
because every rank runs the same forward and backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from minddp.collectives import all_gather_objects
from minddp.fsdp_comm import FlatCollectives, PendingReduce
from minddp.fsdp_unit import FlatUnit, ParamSlot
from minddp.nested import map_tensors, tensors_in


class FSDP(nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over the ranks of ``process_group``.

    Args:
        module: the model, built identically on every rank (rank 0's values are copied to all).
        compute_dtype: a floating-point dtype (e.g. ``torch.bfloat16``) that sharded weights are cast
            to before they are gathered and used, as are the floating-point inputs of the model's and
            each unit's forward. The shards (master weights), their gradients and the optimizer
            state stay in the parameters' dtype; gradients are reduced in that dtype too.
            ``None``: compute in the parameters' dtype.
        process_group: the group to shard over (default: the default group).
        wrap: module classes that each make a unit. Default: every module whose class name ends
            in ``Block``, else the children of every ``nn.ModuleList``. Units do not nest: a match
            inside another match belongs to the outer one. The root unit holds the rest.
        shard_vectors: also shard parameters of fewer than 2 dimensions (norm scales, biases).
            By default each rank keeps those whole (they are tiny) and averages their gradients.
        keep_dtype_modules: module classes (e.g. norm layers) whose own parameters the forward uses
            in their dtype rather than ``compute_dtype``, as autocast keeps norms in float32 and
            FSDP2 does for a module sharded with a policy of its own. Their parameters must be ones
            every rank keeps whole (so not with ``shard_vectors``); their inputs are not cast back.

    Frozen parameters (``requires_grad=False``) stay whole on every rank. Parameters kept whole
    are used in ``compute_dtype`` too (a cast copy per forward). A parameter shared by
    modules of different units (an LM head tied to the embedding) belongs to the root unit.

    ``parameters()`` yields each unit's shard (a 1-D ``nn.Parameter``) and the parameters kept
    whole: give those to the optimizer, and its state is sharded too. Between steps each of
    ``module``'s parameter attributes holds the part of the parameter this rank keeps (1-D, possibly
    empty), with its gradient after :meth:`finish_gradient_synchronization`.
    """

    def __init__(self, module: nn.Module, *, compute_dtype: torch.dtype | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 wrap: Iterable[type[nn.Module]] | None = None, shard_vectors: bool = False,
                 keep_dtype_modules: Iterable[type[nn.Module]] = ()) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("FSDP needs an initialized process group: call torch.distributed."
                               "init_process_group(...) first (torchrun sets up its environment)")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype={compute_dtype!r} is not a floating-point torch.dtype "
                             "(use e.g. torch.bfloat16, or None to compute in the parameters' dtype)")
        self.module = module
        self.compute_dtype = compute_dtype
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        if dist.get_rank(self.process_group) < 0:
            raise ValueError("process_group: this rank is not a member of the given process group")
        unit_modules = _unit_modules(module, wrap)
        devices = {t.device for t in [*module.parameters(), *module.buffers()]}
        _check_same_model_on_every_rank(module, unit_modules, devices, self.process_group)
        device = next(iter(devices)) if devices else torch.device("cpu")
        comm = FlatCollectives(self.process_group, device)

        names = _first_names(module)
        # Every name a parameter answers to (tied ones have several) -> its first name.
        self._aliases = {n: names[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
        sharded = {id(p) for p in module.parameters() if p.requires_grad and (shard_vectors or p.dim() >= 2)}
        self._replicated = [(n, p) for n, p in module.named_parameters() if id(p) not in sharded]
        own_dtype = _own_dtype_params(module, keep_dtype_modules, sharded)
        owner = _owning_unit(module, unit_modules, sharded)
        units = []
        for unit_name, unit_module in [*unit_modules.items(), ("", module)]:
            params = [p for p in module.parameters() if owner.get(id(p)) == unit_name]
            if not params:
                if unit_module is not module and wrap is not None:
                    raise ValueError(f"wrap: module {unit_name!r} ({type(unit_module).__name__}) has no "
                                     "parameters to shard (all frozen, shared with another unit, or vectors "
                                     "kept whole); leave its class out of wrap")
                continue
            units.append(FlatUnit(unit_name, unit_module, _slots(module, params, names), params, comm,
                                  compute_dtype, self._on_grad_ready))
        self._units = units
        self._root = units[-1] if units and units[-1].module is module else None
        self._whole_in_compute_dtype = _CastOnUse(
            module, [p for _, p in self._replicated if id(p) not in own_dtype], compute_dtype)
        self._broadcast_from_rank0([*(p for _, p in self._replicated), *module.buffers()])
        for unit in units:
            if unit is not self._root:
                unit.module.register_forward_pre_hook(self._make_pre_forward(unit))
                unit.module.register_forward_hook(self._make_post_forward(unit))
        self._comm = comm
        self._pending: tuple[FlatUnit, PendingReduce] | None = None
        self._order: list[FlatUnit] = []  # non-root units in the order this iteration's forward ran them
        self._last_order: list[FlatUnit] = []

    @property
    def units(self) -> tuple[FlatUnit, ...]:
        """The units, blocks first (module order), the root unit (name ``""``) last."""
        return tuple(self._units)

    # --- parameters ------------------------------------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Each unit's shard (``module.<unit>.flat_shard``), then the parameters every rank keeps whole."""
        for unit in self._units:
            yield f"{prefix}module.{unit.name + '.' if unit.name else ''}flat_shard", unit.shard
        for name, param in self._replicated:
            yield f"{prefix}module.{name}", param

    # --- forward and backward --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._last_order, self._order = (self._order or self._last_order), []
        for unit in self._units:
            unit.show_shard_grads()  # drop views of gradients an optimizer's zero_grad released
        if self._root is not None:
            self._root.use_full()
        if self._last_order:
            self._last_order[0].gather()
        if self.compute_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        with self._whole_in_compute_dtype.active():
            output = self.module(*args, **kwargs)
        if self._root is not None and not _tensors_needing_grad(output):
            self._root.free()  # no backward follows; else the root stays until its gradient is reduced
        return output

    def _make_pre_forward(self, unit: FlatUnit) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> Any:
            unit.use_full()
            self._order.append(unit)
            following = _after(self._last_order, unit)
            if following is not None:
                following.gather()  # overlaps this unit's compute
            return args if self.compute_dtype is None else _cast_floats(args, self.compute_dtype)
        return pre_forward

    def _make_post_forward(self, unit: FlatUnit) -> Any:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            needing_grad = _tensors_needing_grad(output)
            if needing_grad:
                register_multi_grad_hook(needing_grad, lambda _: self._before_backward(unit), mode="any")
            unit.free()
        return post_forward

    def _before_backward(self, unit: FlatUnit) -> None:
        unit.wait_gathered()
        preceding = _after(self._order[::-1], unit)
        if preceding is not None:
            preceding.gather()  # overlaps this unit's backward

    def _on_grad_ready(self, unit: FlatUnit) -> None:
        full_grad = unit.take_full_grad()
        self._complete_pending_reduce()  # at most one reduce in flight: its full gradient is freed when done
        self._pending = (unit, self._comm.reduce_scatter_mean(full_grad))

    def _complete_pending_reduce(self) -> None:
        if self._pending is not None:
            unit, pending = self._pending
            self._pending = None
            unit.accumulate_shard_grad(pending.wait())

    def finish_gradient_synchronization(self) -> None:
        """Wait for the last reduce-scatter and average the gradients of the parameters kept whole.

        Call it after ``backward()`` and before ``optimizer.step()``: afterwards each shard's
        ``.grad`` is its slice of the gradient averaged over the ranks, in the shard's dtype. Every
        unit is freed. Backward passes before it accumulate, as without FSDP.
        """
        self._complete_pending_reduce()
        trainable = [p for _, p in self._replicated if p.requires_grad]
        if trainable:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainable]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._comm.all_reduce_mean(flat)
            for param, grad in zip(trainable, flat.split([p.numel() for p in trainable]), strict=True):
                param.grad = grad.view_as(param)
        for unit in self._units:
            unit.free()
            unit.show_shard_grads()

    # --- full parameters and checkpoints ---------------------------------------------------------

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value on every rank, keyed by ``module.named_parameters()``'s names.

        A collective: call it on every rank, outside forward and backward. Sharded parameters come
        back as new tensors, one unit gathered at a time; parameters kept whole as detached copies.
        """
        gathered = {}
        for unit in self._units:
            gathered.update(unit.gather_master())
        gathered.update((name, param.detach().clone()) for name, param in self._replicated)
        return {name: gathered[name] for name in _first_names(self.module).values()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with every parameter whole, on every rank (a collective).

        Save it from rank 0; :meth:`load_full_state_dict` takes it at any world size.
        """
        full = self.gather_full_params()
        return {key: full[self._aliases[key]] if key in self._aliases else value.detach().clone()
                for key, value in self.module.state_dict(keep_vars=True).items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a :meth:`full_state_dict` saved at any world size; each rank keeps its shard."""
        expected = set(self.module.state_dict(keep_vars=True))
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for unit in self._units:
            for slot in unit.slots:
                unit.load_param(slot, _checked(state_dict, slot.name, slot.shape))
        with torch.no_grad():
            for name, tensor in [*self._replicated, *self.module.named_buffers()]:
                if name in state_dict:
                    tensor.copy_(_checked(state_dict, name, tensor.shape))

    def sharded_state_dict(self) -> dict[str, Any]:
        """The parameters as DTensors sharded on dim 0 (``torch.distributed.checkpoint`` reshards them on
        load), parameters kept whole and persistent buffers as plain tensors. A collective.

        Keys are ``module.named_parameters()``'s names and the persistent buffers' names.
        ``dcp.save(fsdp.sharded_state_dict(), checkpoint_id=path)`` saves;
        ``sd = fsdp.sharded_state_dict(); dcp.load(sd, checkpoint_id=path); fsdp.load_sharded_state_dict(sd)``
        loads, at any world size.
        """
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = self._device_mesh()
        result: dict[str, Any] = {}
        for unit in self._units:
            for name, full in unit.gather_master().items():
                placement = Shard(0) if full.dim() else Replicate()
                result[name] = distribute_tensor(full, mesh, [placement], src_data_rank=None)
        result.update((name, param.detach().clone()) for name, param in self._replicated)
        persistent = self.module.state_dict(keep_vars=True)
        result.update((name, buf.detach().clone()) for name, buf in self.module.named_buffers()
                      if name in persistent)
        return result

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``dcp.load`` filled into a :meth:`sharded_state_dict` (a collective per parameter)."""
        from torch.distributed.tensor import DTensor

        for unit in self._units:
            for slot in unit.slots:
                value = state_dict.get(slot.name)
                if value is None:
                    raise ValueError(f"state_dict: missing key {slot.name!r}")
                full = value.full_tensor() if isinstance(value, DTensor) else value
                unit.load_param(slot, _checked({slot.name: full}, slot.name, slot.shape))
        with torch.no_grad():
            for name, tensor in [*self._replicated, *self.module.named_buffers()]:
                if name in state_dict:
                    tensor.copy_(_checked(state_dict, name, tensor.shape))

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("FSDP.state_dict() would hold each rank's 1-D pieces of the parameters; use "
                           "full_state_dict() (whole tensors, any world size) or sharded_state_dict() "
                           "(for torch.distributed.checkpoint)")

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("use load_full_state_dict() or load_sharded_state_dict()")

    # --- internals -------------------------------------------------------------------------------

    def _device_mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.process_group, self._comm.device.type)

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        source = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=source, group=self.process_group)


# --- helpers ---------------------------------------------------------------------------------------

def _unit_modules(root: nn.Module, wrap: Iterable[type[nn.Module]] | None) -> dict[str, nn.Module]:
    """The outermost submodules that make units, by name, in module order."""
    if wrap is not None:
        classes = (wrap,) if isinstance(wrap, type) else tuple(wrap)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"wrap: expected nn.Module subclasses, got {bad!r}")
        matches = lambda name, m: isinstance(m, classes)
    elif any(type(m).__name__.endswith("Block") for m in root.modules()):
        matches = lambda name, m: type(m).__name__.endswith("Block")
    else:
        list_children = {id(child) for m in root.modules() if isinstance(m, nn.ModuleList) for child in m}
        matches = lambda name, m: id(m) in list_children
    found: dict[str, nn.Module] = {}
    for name, m in root.named_modules():
        if m is root or not matches(name, m) or any(name.startswith(outer + ".") for outer in found):
            continue
        found[name] = m
    return found


def _first_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> the name ``module.named_parameters()`` gives it (the first, for a tied one)."""
    return {id(p): n for n, p in module.named_parameters()}


def _owning_unit(root: nn.Module, unit_modules: dict[str, nn.Module], sharded: set[int]) -> dict[int, str]:
    """id(parameter) -> the name of the unit that shards it ("" for the root unit).

    A parameter reachable from modules of two units, or from outside every unit, goes to the root.
    """
    claims: dict[int, set[str]] = {}
    inside_units: set[int] = set()
    for unit_name, unit_module in unit_modules.items():
        for m in unit_module.modules():
            inside_units.add(id(m))
            for p in m._parameters.values():
                if p is not None:
                    claims.setdefault(id(p), set()).add(unit_name)
    for m in root.modules():
        if id(m) not in inside_units:
            for p in m._parameters.values():
                if p is not None:
                    claims.setdefault(id(p), set()).add("")
    return {pid: next(iter(names)) if len(names) == 1 else ""
            for pid, names in claims.items() if pid in sharded}


def _places(root: nn.Module, params: list[nn.Parameter]) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) that holds it."""
    places: dict[int, list[tuple[nn.Module, str]]] = {id(p): [] for p in params}
    seen: set[tuple[int, str]] = set()
    for _, m in root.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and id(p) in places and (id(m), attr) not in seen:
                seen.add((id(m), attr))
                places[id(p)].append((m, attr))
    return places


def _own_dtype_params(root: nn.Module, classes: Iterable[type[nn.Module]], sharded: set[int]) -> set[int]:
    """ids of the parameters of ``classes``' modules (keep_dtype_modules), which must all be kept whole."""
    classes = tuple(classes)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"keep_dtype_modules: {cls!r} is not an nn.Module class")
    own: set[int] = set()
    for name, m in root.named_modules():
        if isinstance(m, classes):
            for attr, p in m.named_parameters(recurse=False):
                if id(p) in sharded:
                    raise ValueError(f"keep_dtype_modules: {name}.{attr} ({type(m).__name__}, shape "
                                     f"{tuple(p.shape)}) is sharded; only parameters every rank keeps "
                                     "whole (fewer than 2 dims, shard_vectors=False) keep their dtype")
                own.add(id(p))
    return own


class _CastOnUse:
    """Parameters every rank keeps whole, seen by the forward as copies in the compute dtype.

    The copy is differentiable, so a trainable parameter's gradient arrives in its own dtype.
    """

    def __init__(self, root: nn.Module, params: list[nn.Parameter], dtype: torch.dtype | None) -> None:
        cast = [p for p in params if dtype is not None and p.is_floating_point() and p.dtype != dtype]
        places = _places(root, cast)
        self._params = [(p, places[id(p)]) for p in cast]
        self._dtype = dtype

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for param, places in self._params:
            copy = param.to(self._dtype)
            for module, attr in places:
                module._parameters[attr] = copy
        try:
            yield
        finally:
            for param, places in self._params:
                for module, attr in places:
                    module._parameters[attr] = param


def _slots(root: nn.Module, params: list[nn.Parameter], names: dict[int, str]) -> list[ParamSlot]:
    places = _places(root, params)
    slots, offset = [], 0
    for p in params:
        slots.append(ParamSlot(names[id(p)], places[id(p)], p.shape, offset))
        offset += p.numel()
    return slots


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``."""
    return map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _tensors_needing_grad(output: Any) -> list[torch.Tensor]:
    """The tensors in an output that will receive gradients."""
    return [t for t in tensors_in(output) if t.requires_grad]


def _after(order: list[FlatUnit], unit: FlatUnit) -> FlatUnit | None:
    """The unit that follows ``unit``'s first appearance in ``order`` (None if last or absent)."""
    for i, candidate in enumerate(order[:-1]):
        if candidate is unit:
            return order[i + 1]
    return None


def _checked(state_dict: dict[str, torch.Tensor], key: str, shape: torch.Size) -> torch.Tensor:
    value = state_dict[key]
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"state_dict[{key!r}] has shape {tuple(value.shape)}; the model's is {tuple(shape)}")
    return value


def _check_same_model_on_every_rank(module: nn.Module, unit_modules: dict[str, nn.Module],
                                    devices: set[torch.device], group: dist.ProcessGroup) -> None:
    """Raise the same error on every rank if a rank's model differs from rank 0's (one object all-gather)."""
    problem = None
    if len({d.type for d in devices}) > 1 or len(devices) > 1:
        problem = f"module: parameters and buffers are on several devices ({sorted(map(str, devices))}); " \
                  "FSDP needs one"
    signature = [f"parameter {n} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
                 for n, p in module.named_parameters()]
    signature += [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    signature += [f"unit {n} ({type(m).__name__})" for n, m in unit_modules.items()]
    comm_device = min(devices, key=str) if devices else torch.device("cpu")  # where the collectives run
    gathered = all_gather_objects((problem, signature), group, comm_device)
    for rank, (rank_problem, _) in enumerate(gathered):
        if rank_problem:
            raise ValueError(f"rank {rank}: {rank_problem}")
    reference = gathered[0][1]
    for rank, (_, other) in enumerate(gathered[1:], start=1):
        if other != reference:
            first = next((i for i, (a, b) in enumerate(zip(reference, other, strict=False)) if a != b),
                         min(len(reference), len(other)))
            ours = reference[first] if first < len(reference) else "nothing"
            theirs = other[first] if first < len(other) else "nothing"
            raise ValueError(f"module: rank 0 has {ours} where rank {rank} has {theirs}; "
                             "every rank must build the same model")
