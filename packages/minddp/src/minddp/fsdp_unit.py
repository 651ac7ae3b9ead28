"""One FSDP unit: the parameters of one module kept as a flat 1/N shard, gathered whole only while in use.

Layout: the unit's parameters are flattened and concatenated in registration order, padded with
zeros to a multiple of the group size N; rank r keeps elements [r * S, (r + 1) * S) of that flat
tensor (S = padded length / N) as one ``nn.Parameter``, the *shard*, in the parameters' own dtype.
That shard is what the optimizer steps. Between uses, each of the model's parameter attributes
holds a view of the shard: the part of that parameter this rank keeps (1-D, possibly empty).

Gathered, the unit holds the full flat tensor (in the compute dtype) in the storage of one leaf
tensor that requires grad; the model's attributes become views of it, so every gradient of the
unit accumulates into that leaf's ``.grad``, already flat and padded for the reduce-scatter.
Freeing resizes the leaf's storage to zero bytes: views saved by autograd keep their shapes and
become valid again when the backward gathers into the same storage.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from minddp.fsdp_comm import FlatCollectives


@dataclass
class ParamSlot:
    """One parameter: its name, the (module, attribute) pairs that hold it, its offset in the flat tensor."""

    name: str
    places: list[tuple[nn.Module, str]]
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


class _State(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"
    GATHERED = "gathered"


class FlatUnit:
    """The parameters of ``module`` named by ``slots``, sharded flat over ``comm``'s group.

    Construction copies the group's first rank's values into every rank's shard (one broadcast of
    the unit), then points the model's attributes at the shard's views. ``on_grad_ready(unit)`` (a
    bound method, held weakly) is called from the backward once the unit's full gradient has
    accumulated.
    """

    def __init__(self, name: str, module: nn.Module, slots: list[ParamSlot], params: list[nn.Parameter],
                 comm: FlatCollectives, compute_dtype: torch.dtype | None,
                 on_grad_ready: Callable[[FlatUnit], None]) -> None:
        self.name = name
        self.module = module
        self.slots = slots
        self._comm = comm
        dtype, device = params[0].dtype, params[0].device
        self.numel = sum(slot.numel for slot in slots)
        self.padded_numel = -(-self.numel // comm.world_size) * comm.world_size
        shard_numel = self.padded_numel // comm.world_size
        self._start = comm.rank * shard_numel  # this rank's shard is flat[start : start + shard_numel]
        with torch.no_grad():
            full = torch.zeros(self.padded_numel, dtype=dtype, device=device)
            for slot, param in zip(slots, params, strict=True):
                full[slot.offset:slot.offset + slot.numel].copy_(param.reshape(-1))
            dist.broadcast(full, src=dist.get_global_rank(comm.group, 0), group=comm.group)
            self.shard = nn.Parameter(full[self._start:self._start + shard_numel].clone())
        del full
        self._views = [nn.Parameter(self.shard.data[self._local_range(slot)]) for slot in slots]
        self._set_attributes(self._views)
        self._split_sizes = [slot.numel for slot in slots] + [self.padded_numel - self.numel]
        self._leaf = torch.empty(self.padded_numel, dtype=compute_dtype or dtype, device=device,
                                 requires_grad=True)
        # Written through .data, whose version counter is separate from the leaf's: refilling the
        # storage for the backward must not look like an in-place change to the views autograd saved.
        self._full = self._leaf.data
        self._leaf.untyped_storage().resize_(0)
        # The hook holds the unit and its owner weakly. The leaf keeps its hooks on the C++ side, where the
        # garbage collector cannot follow a cycle back to the unit: strong ones kept a dropped FSDP's shards
        # and gradients alive (8 GB a rank at xl on 2 GPUs).
        unit, notify = weakref.ref(self), weakref.WeakMethod(on_grad_ready)
        self._leaf.register_post_accumulate_grad_hook(lambda _: _notify_grad_ready(unit, notify))
        self._state = _State.FREE
        self._in_flight: tuple[dist.Work | None, torch.Tensor] | None = None

    # --- gather and free ---------------------------------------------------------------------

    @property
    def gathered_nbytes(self) -> int:
        """Bytes the full parameters occupy now (0 when freed)."""
        return self._leaf.untyped_storage().nbytes()

    def gather(self) -> None:
        """Start the all-gather of the full parameters, unless gathered or gathering already."""
        if self._state is not _State.FREE:
            return
        self._leaf.untyped_storage().resize_(self._full.numel() * self._full.element_size())
        source = self.shard.detach().to(self._full.dtype)  # the compute dtype: half the bytes for bf16
        self._in_flight = (self._comm.all_gather(self._full, source, async_op=True), source)
        self._state = _State.GATHERING

    def wait_gathered(self) -> None:
        """Block until the full parameters are here (gathering them now if nobody started)."""
        self.gather()
        if self._state is _State.GATHERING:
            work, _ = self._in_flight
            if work is not None:
                work.wait()
            self._in_flight = None
            self._state = _State.GATHERED

    def use_full(self) -> None:
        """Point the model's attributes at the full parameters (differentiable views of the leaf)."""
        self.wait_gathered()
        pieces = self._leaf.split(self._split_sizes)
        full = [piece.view(slot.shape) for piece, slot in zip(pieces, self.slots, strict=False)]  # no padding
        self._set_attributes(full)

    def free(self) -> None:
        """Drop the full parameters; the model's attributes go back to views of the shard."""
        if self._state is _State.FREE:
            return
        self.wait_gathered()  # never release storage a collective is still writing
        self._set_attributes(self._views)
        self._leaf.untyped_storage().resize_(0)
        self._state = _State.FREE

    # --- gradients ----------------------------------------------------------------------------

    def take_full_grad(self) -> torch.Tensor:
        """The accumulated full gradient in the shard's dtype; clears the leaf's grad and frees the unit."""
        grad = self._leaf.grad.to(self.shard.dtype)
        self._leaf.grad = None
        self.free()
        return grad

    def has_full_grad(self) -> bool:
        return self._leaf.grad is not None

    def accumulate_shard_grad(self, grad: torch.Tensor) -> None:
        if self.shard.grad is None:
            self.shard.grad = grad
        else:
            self.shard.grad += grad

    def show_shard_grads(self) -> None:
        """Give each model attribute the matching view of the shard's gradient (None if it has none)."""
        grad = self.shard.grad
        for view, slot in zip(self._views, self.slots, strict=True):
            view.grad = None if grad is None else grad[self._local_range(slot)]

    # --- full values (checkpoints) ------------------------------------------------------------

    def gather_master(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value in the shard's dtype, as views of one new flat tensor (collective)."""
        full = self.shard.new_empty(self.padded_numel)
        work = self._comm.all_gather(full, self.shard.detach(), async_op=False)
        if work is not None:
            work.wait()
        return {slot.name: full[slot.offset:slot.offset + slot.numel].view(slot.shape) for slot in self.slots}

    def load_param(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Copy this rank's part of ``value`` (``slot``'s whole parameter) into the shard. No collective."""
        local = self._local_range(slot)
        start = local.start + self._start - slot.offset  # where this rank's part begins within the parameter
        with torch.no_grad():
            self.shard[local].copy_(value.reshape(-1)[start:start + local.stop - local.start])

    # --- internals ----------------------------------------------------------------------------

    def _local_range(self, slot: ParamSlot) -> slice:
        """The slice of the shard that holds part of ``slot``'s parameter (empty if none does)."""
        shard_numel = self.shard.numel()
        begin = min(max(slot.offset - self._start, 0), shard_numel)
        end = min(max(slot.offset + slot.numel - self._start, 0), shard_numel)
        return slice(begin, max(begin, end))

    def _set_attributes(self, tensors: list[torch.Tensor]) -> None:
        # Assigned in _parameters directly: nn.Module.__setattr__ accepts only Parameters there, and
        # the full views are plain tensors with a grad_fn. The key (and so the name order) is kept.
        for slot, tensor in zip(self.slots, tensors, strict=True):
            for module, attr in slot.places:
                module._parameters[attr] = tensor


def _notify_grad_ready(unit: weakref.ref[FlatUnit], notify: weakref.WeakMethod) -> None:
    alive, on_grad_ready = unit(), notify()
    if alive is not None and on_grad_ready is not None:
        on_grad_ready(alive)
