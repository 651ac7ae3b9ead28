"""The parameters of one ``fully_shard`` call: DTensor shards over one flat buffer, gathered and reduced flat.

Each parameter is sharded on dim 0 as a DTensor ``Shard(0)`` does (``torch.chunk``: ``ceil(rows / N)``
rows a rank, the last ranks short or empty); its chunk is padded to that size inside the rank's flat
shard, so every rank's flat shard has the same length ``S`` and one all-gather of ``N x S`` elements
brings the whole unit (rank-major). The gathered parameters live in one flat *leaf* tensor,
parameter-major (each parameter whole, padded to ``N`` chunks): the module's attributes are views of
it during forward and backward, so autograd sums every use of the unit into the leaf's one gradient,
and a hook on that leaf says when the unit's backward is done. Reducing it is one reduce-scatter of
the gradient rearranged rank-major. At one rank both layouts coincide and nothing is rearranged.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from minddp.fsdp_comm import FlatCollectives, PendingReduce


@dataclass
class ShardedParam:
    """One parameter: where the module holds it, its shape and its chunk of the rank's flat shard."""

    fqn: str  # relative to the module fully_shard was called on
    places: list[tuple[nn.Module, str]]
    shape: torch.Size
    rows_per_rank: int
    row_numel: int
    local_rows: int
    offset: int  # of its chunk in the flat shard, in elements
    param: nn.Parameter  # the DTensor registered in the module
    local: torch.Tensor | None = (
        None  # the local tensor the DTensor had when it was pointed at the flat shard
    )

    @property
    def chunk_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.local_rows, *self.shape[1:])


class _State(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ParamGroup:
    """The sharded parameters of one unit, their all-gather into full parameters, their gradients' reduction.

    ``on_grad_ready(group)`` (held weakly) runs in the backward once the unit's full gradient has
    accumulated.
    """

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]],
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        comm: FlatCollectives,
        compute_device: torch.device,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        offload: bool,
        pin_memory: bool,
        on_grad_ready: Callable[[ParamGroup], None],
    ) -> None:
        self.mesh, self.placements, self._comm = mesh, placements, comm
        self.compute_device, self.offload, self._pin = compute_device, offload, pin_memory
        self.world_size, rank = comm.world_size, comm.rank
        dtypes = {p.dtype for _, p, _ in named}
        if len(dtypes) > 1:
            listed = ", ".join(f"{n} {p.dtype}" for n, p, _ in named)
            raise ValueError(
                f"module: one fully_shard call needs parameters of one dtype, got {listed}; "
                "call fully_shard on the submodules of each dtype first"
            )
        self.params: list[ShardedParam] = []
        offset = 0
        for fqn, param, places in named:
            if param.dim() == 0:
                raise ValueError(
                    f"module: parameter {fqn!r} is a scalar; fully_shard shards dim 0, as FSDP2 "
                    "does: make it a 1-D tensor of one element"
                )
            rows = param.shape[0]
            row_numel = param.shape[1:].numel()
            per_rank = -(-rows // self.world_size)
            local_rows = min(max(rows - rank * per_rank, 0), per_rank)
            self.params.append(
                ShardedParam(fqn, places, param.shape, per_rank, row_numel, local_rows, offset, param)
            )
            offset += per_rank * row_numel
        self.shard_numel = offset
        # The leaf split into each parameter and the padding after it. One split node (not a slice per
        # parameter) makes autograd build the leaf's gradient with one concatenation, not one full-size
        # zero-filled tensor per parameter summed up.
        self._split_sizes = [
            n
            for i in self.params
            for n in (i.shape.numel(), self.world_size * i.chunk_numel - i.shape.numel())
        ]
        first = named[0][1]
        self.flat = self._new_flat(first.dtype, first.device)
        with torch.no_grad():
            if not first.is_meta:
                for info, (_, param, _) in zip(self.params, named, strict=True):
                    start = rank * info.rows_per_rank
                    self._local_view(info).copy_(param.detach()[start : start + info.local_rows])
        for info, (_, param, _) in zip(self.params, named, strict=True):
            info.param = nn.Parameter(self._as_dtensor(self._local_view(info), info), param.requires_grad)
            info.local = info.param._local_tensor
            self._register(info)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self._on_grad_ready = weakref.WeakMethod(on_grad_ready)
        self._leaf: torch.Tensor | None = None
        self._state = _State.FREE
        self._in_flight: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None

    # --- dtypes ---------------------------------------------------------------------------------------

    @property
    def orig_dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def unsharded_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.unsharded_dtype

    # --- sharded parameters ---------------------------------------------------------------------------

    def rehome(self) -> None:
        """Point every DTensor back at the flat shard after something replaced its local tensor (``to_empty``,
        ``.to()``, ``load_state_dict(assign=True)``), copying the values in."""
        for info in self.params:
            module, attr = info.places[0]
            current = module._parameters[attr]
            if current is not info.param and isinstance(current, DTensor):
                info.param = current  # replaced, not swapped: adopt it and register it everywhere
                self._register(info)
        if all(info.param._local_tensor is info.local for info in self.params):
            return
        first = self.params[0].param._local_tensor
        self.flat = self._new_flat(first.dtype, first.device)  # (on the CPU when offloading)
        with torch.no_grad():
            for info in self.params:
                view = self._local_view(info)
                if not first.is_meta:
                    view.copy_(info.param._local_tensor)
                info.param._local_tensor = view
                info.local = view
        self._leaf = None  # the dtype or device may have changed

    def _new_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        device = torch.device("cpu") if self.offload else device
        flat = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        return flat.pin_memory() if self._pin and torch.cuda.is_available() else flat

    def _local_view(self, info: ShardedParam, flat: torch.Tensor | None = None) -> torch.Tensor:
        """``info``'s local rows in a flat shard (default: the parameters' own, ``self.flat``)."""
        flat = self.flat if flat is None else flat
        return flat[info.offset : info.offset + info.local_rows * info.row_numel].view(info.local_shape)

    def _as_dtensor(self, local: torch.Tensor, info: ShardedParam) -> DTensor:
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=info.shape,
            stride=_contiguous_strides(info.shape),
        )

    @staticmethod
    def _register(info: ShardedParam) -> None:
        """Make the DTensor the module's parameter (straight into _parameters: the key and order are kept)."""
        for module, attr in info.places:
            module._parameters[attr] = info.param

    @staticmethod
    def _show(info: ShardedParam, full: torch.Tensor | None) -> None:
        """Let the module's code see ``full`` as the attribute (None: the DTensor parameter again).

        The full tensor goes in the instance ``__dict__``, which attribute lookup reads before
        nn.Module.__getattr__ reaches ``_parameters``: the forward sees it, while ``parameters()``,
        ``state_dict()`` and an optimizer built at any moment (even after a backward that raised)
        see the DTensor.
        """
        for module, attr in info.places:
            if full is None:
                module.__dict__.pop(attr, None)
            else:
                module.__dict__[attr] = full

    # --- gather and free ------------------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return self._state is not _State.FREE

    @property
    def gathered_nbytes(self) -> int:
        """Bytes the full parameters occupy now (0 when resharded)."""
        return 0 if self._leaf is None else self._leaf.untyped_storage().nbytes()

    def unshard(self) -> None:
        """Start the all-gather of the full parameters, unless gathered or gathering already."""
        if self._state is not _State.FREE:
            return
        if self.flat.is_meta:
            raise RuntimeError(
                f"fully_shard: parameter {self.params[0].fqn!r} is on the meta device; call "
                "model.to_empty(device=...) and initialise the parameters before the forward"
            )
        full = self._full_data()
        full.untyped_storage().resize_(full.numel() * full.element_size())
        source = self.flat.to(self.compute_device, non_blocking=True).to(self.unsharded_dtype)
        if self.world_size == 1:
            full.copy_(source)
            self._state = _State.GATHERED
            return
        gathered = torch.empty(self.world_size * self.shard_numel, dtype=full.dtype, device=full.device)
        self._in_flight = (self._comm.all_gather(gathered, source, async_op=True), source, gathered)
        self._state = _State.GATHERING

    def wait_unsharded(self) -> None:
        """Block until the full parameters are here (gathering them now if nobody started)."""
        self.unshard()
        if self._state is not _State.GATHERING:
            return
        work, _, gathered = self._in_flight
        work.wait()
        self._in_flight = None
        full = self._full_data()
        torch.split_with_sizes_copy(  # rank-major -> parameter-major
            gathered.view(self.world_size, self.shard_numel),
            [i.chunk_numel for i in self.params],
            dim=1,
            out=self._per_param_chunks(full),
        )
        self._state = _State.GATHERED

    def use_unsharded(self) -> None:
        """Point the module's attributes at the full parameters (views of the leaf; frozen ones detached)."""
        self.wait_unsharded()
        pieces = self._leaf.split(self._split_sizes)
        for info, piece in zip(self.params, pieces[::2], strict=True):
            full = piece.view(info.shape)
            self._show(info, full if info.param.requires_grad else full.detach())

    def reshard(self) -> None:
        """Free the full parameters; the module's attributes go back to the DTensor parameters."""
        if self._state is _State.FREE:
            return
        self.wait_unsharded()  # never free storage a collective is still writing
        for info in self.params:
            self._show(info, None)
        self._leaf.untyped_storage().resize_(0)
        self._state = _State.FREE

    def _full_data(self) -> torch.Tensor:
        if self._leaf is None:
            self._leaf = torch.empty(
                self.world_size * self.shard_numel,
                dtype=self.unsharded_dtype,
                device=self.compute_device,
                requires_grad=True,
            )
            self._leaf.untyped_storage().resize_(0)
            # The hook holds the group weakly: the leaf keeps it on the C++ side, where the garbage collector
            # cannot follow a cycle back, and a strong one kept a dropped model's shards and gradients alive.
            group, notify = weakref.ref(self), self._on_grad_ready
            self._leaf.register_post_accumulate_grad_hook(lambda _: _notify(group, notify))
        # Written through .data, whose version counter is separate from the leaf's: refilling the storage
        # for the backward must not look like an in-place change to the views autograd saved.
        return self._leaf.data

    # --- gradients ------------------------------------------------------------------------------------

    @property
    def has_unreduced_grad(self) -> bool:
        return self._leaf is not None and self._leaf.grad is not None

    def drop_unreduced_grad(self) -> None:
        if self._leaf is not None:
            self._leaf.grad = None

    def start_reduce(self) -> PendingReduce:
        """Take the accumulated full gradient and start its mean-reduce-scatter in ``grad_reduce_dtype``."""
        grad = self._leaf.grad
        self._leaf.grad = None
        if self.world_size == 1:
            return self._comm.reduce_scatter_mean(grad.to(self.grad_reduce_dtype))
        rank_major = grad.new_empty((self.world_size, self.shard_numel), dtype=self.grad_reduce_dtype)
        torch.cat(self._per_param_chunks(grad), dim=1, out=rank_major)  # cast on the way
        return self._comm.reduce_scatter_mean(rank_major.view(-1))

    def _per_param_chunks(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's padded segment of a parameter-major ``full`` tensor as (ranks, chunk) views."""
        n = self.world_size
        return [
            full[n * i.offset : n * (i.offset + i.chunk_numel)].view(n, i.chunk_numel) for i in self.params
        ]

    def shard_grad(self, reduced: torch.Tensor) -> torch.Tensor:
        """A reduced flat gradient shard in the parameters' dtype, where the shards live."""
        # Blocking: under CPU offload the optimizer reads it on the host right after backward.
        return reduced.to(device=self.flat.device, dtype=self.orig_dtype)

    def accumulate_grads(self, flat_grad: torch.Tensor) -> None:
        """Give each trainable parameter its DTensor gradient from the flat shard (added if it has one)."""
        for info in self.params:
            if not info.param.requires_grad:
                continue
            local = self._local_view(info, flat_grad)
            if info.param.grad is None:
                info.param.grad = self._as_dtensor(local, info)
            else:
                info.param.grad._local_tensor.add_(local)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _notify(group: weakref.ref[ParamGroup], notify: weakref.WeakMethod) -> None:
    alive, callback = group(), notify()
    if alive is not None and callback is not None:
        callback(alive)
