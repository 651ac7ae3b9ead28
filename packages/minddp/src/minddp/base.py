"""What every data-parallel wrapper shares: torch DDP's arguments, checks, buffers, no_sync, hooks and join.

Every collective here is issued in the same order on every rank; anything that could make one
rank raise while another goes on to the next collective is first agreed on by all ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from minddp.buckets import assign_buckets_in_order
from minddp.collectives import all_gather_objects, backend_per_device_type, broadcast_coalesced
from minddp.nested import map_tensors, tensors_in
from minddp.reducer import CommHook, Reducer

# Backends whose all-reduce can average in place (ReduceOp.AVG); the others get a pre-scaled SUM.
_BACKENDS_WITH_AVG = {"nccl"}
# torch DDP's dist._DEFAULT_FIRST_BUCKET_BYTES: with the default bucket size the first bucket closes at
# 1 MiB, so that communication starts with backward's first gradients.
FIRST_BUCKET_BYTES = 2**20
MiB = 2**20

__all__ = ["DataParallel"]


class DataParallel(nn.Module, Joinable):
    """Base class of the minddp wrappers: ``module`` replicated on every rank of ``process_group``.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel``: its arguments have torch's
    meaning, and ``loss.backward()`` returns with every ``.grad`` averaged over the ranks.
    A strategy (subclass) sets the buckets (:attr:`bucket_limits`) and whether they are reduced
    during backward or after it (:attr:`overlap`).

    At construction it checks that every rank holds the same parameters and buffers (names,
    shapes, dtypes, ``requires_grad``) on devices the group's backend can serve, and wraps them
    the same way; then it copies rank 0's parameters (and buffers, if ``broadcast_buffers``) to
    every rank.

    Args:
        module: the model; its forward is called unchanged.
        device_ids: for a module on one CUDA device, ``None`` or ``[that device]``: inputs are
            moved there before forward. ``None`` for CPU modules.
        output_device: accepted for torch's sake (``None`` or ``device_ids[0]``); outputs stay
            where the module puts them, as in torch DDP.
        process_group: the group to average over (default: the default group).
        broadcast_buffers: copy rank 0's buffers to every rank at construction and at the start
            of every forward whose backward is averaged (BatchNorm statistics stay in step).
        find_unused_parameters: ``False``: every trainable parameter gets a gradient in every
            averaged backward. ``True``: a parameter without a gradient on some rank counts as
            zero there, and one no rank has a gradient for keeps ``grad=None`` (the counts travel
            in the step's closing flag all-reduce, see :mod:`minddp.reducer`).
        gradient_as_bucket_view: the ``.grad`` of a bucket's parameters are views of its flat
            buffer (no copy out after averaging); ``False`` copies.
    """

    #: The bytes at which a bucket closes (torch's rule, see :func:`~minddp.buckets.assign_buckets`): the
    #: first bucket's, the second's, ..., the last serving for the rest. (0,): one parameter per bucket;
    #: (inf,): one bucket per device and dtype.
    bucket_limits: tuple[float, ...] = (math.inf,)
    #: Reduce each bucket as soon as backward has produced it, rather than after backward.
    overlap: bool = False

    def __init__(self, module: nn.Module, device_ids: Sequence[int | torch.device] | None = None,
                 output_device: int | torch.device | None = None, *,
                 process_group: dist.ProcessGroup | None = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{type(self).__name__} needs an initialized process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up its environment)")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.process_group)
        if self.rank < 0:
            raise ValueError("process_group: this rank is not a member of the given process group")
        self.world_size = dist.get_world_size(self.process_group)
        self.device_ids, self.output_device = _check_device_ids(module, device_ids, output_device)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self._backends = backend_per_device_type(self.process_group)

        # parameters() yields a tied tensor once, so tied parameters are communicated once.
        named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in named_params]
        # Buckets fill in reverse parameter order, roughly the order backward produces gradients, until the
        # first averaged backward has shown the order (then the reducer rebuilds them in it).
        buckets = assign_buckets_in_order(params, range(len(params) - 1, -1, -1), self.bucket_limits)
        self._check_same_on_every_rank(buckets)

        self._comm_device = self._device_for_collectives(first=next(iter([*params, *module.buffers()]), None))
        self._broadcast_from(0, [*module.parameters(), *(module.buffers() if self.broadcast_buffers else ())])
        device = params[0].device if params else self._comm_device
        average_in_collective = self._backends.get(device.type) in _BACKENDS_WITH_AVG
        self._reducer = Reducer(named_params, buckets, self.process_group, average_in_collective,
                                self.overlap, self.gradient_as_bucket_view, self.find_unused_parameters,
                                self._comm_device, rebuild_limits=self.bucket_limits)
        self._sync_enabled = True  # torch DDP's require_backward_grad_sync: False inside no_sync()
        self._buffers_due = True  # torch DDP's require_forward_param_sync: the last forward was averaged
        self._divide_by_initial_world_size = True
        self._has_buffers = any(True for _ in module.buffers())  # which ones is re-read at each sync

    # --- training ---------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._reducer.settle_last_round()
        averaged = torch.is_grad_enabled() and self._sync_enabled
        if averaged:
            self._reducer.prepare_for_backward()
        elif torch.is_grad_enabled():
            self._reducer.accumulate_locally()
        join_work = Join.notify_join_context(self)
        self._reducer.divisor = self.world_size
        if join_work is not None and not self._divide_by_initial_world_size:
            join_work.wait()  # its result: how many ranks are still training
            self._reducer.divisor = int(join_work.result()[0].item())
        if self._buffers_to_sync():
            self._broadcast_from(self._common_rank(True) if self._join_config.enable else 0,
                                 list(self.module.buffers()))
        if self._join_config.enable:
            self._all_reduce_flag(averaged)
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = map_tensors((inputs, kwargs), lambda t: t.to(device, non_blocking=True))
        output = self.module(*inputs, **kwargs)
        self._buffers_due = averaged
        if averaged and self.find_unused_parameters:
            # A rank whose loss reaches no parameter still has to take part in the averaging.
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._queue_finish)
        return output

    def _apply(self, fn: Any, recurse: bool = True) -> DataParallel:
        """``.to()``, ``.double()``, ``.cuda()``...: refused, before any tensor changes, where it would change
        the dtype or device of a parameter or buffer (their buckets and checks were made for those)."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        for tensor in {(t.dtype, t.device): t for t in tensors}.values():
            probe = fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device))
            if (probe.dtype, probe.device) != (tensor.dtype, tensor.device):
                raise RuntimeError(
                    f"{type(self).__name__}: this would turn {tensor.dtype} tensors on {tensor.device} into "
                    f"{probe.dtype} on {probe.device} after wrapping, but the gradient buckets were laid out "
                    "for the model as it was wrapped. Wrap after .to(): convert the model first, then wrap "
                    f"it, as with torch DDP: {type(self).__name__}(model.to(...))")
        return super()._apply(fn, recurse)

    @property
    def bucket_names(self) -> list[list[str]]:
        """The parameter names of each bucket, in launch order (rebuilt after the first averaged backward,
        in the order it produced the gradients, unless ``find_unused_parameters``)."""
        return [list(bucket.names) for bucket in self._reducer.buckets]

    def _queue_finish(self, grad: torch.Tensor) -> None:
        self._reducer.queue_finish()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward passes inside accumulate gradients locally; the next averaged step
        averages the sum (as in torch DDP, what counts is where the forward runs)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_synchronization(self) -> None:
        """Kept for the CS336 assignment's interface: gradients are averaged by the time ``backward()``
        returns, so nothing is ever pending here and this does nothing."""

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Average each bucket with ``hook(state, bucket)`` instead of an all-reduce, as torch DDP's
        ``register_comm_hook``: ``bucket`` has ``GradBucket``'s methods and ``hook`` returns a
        ``Future`` of the reduced flat tensor. torch's ``default_hooks`` (``allreduce_hook``,
        ``fp16_compress_hook``, ``bf16_compress_hook``) work unchanged. Register once, before training."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self._reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        self._reducer.comm_hook, self._reducer.comm_hook_state = hook, state

    # --- uneven inputs ----------------------------------------------------------------------

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context manager for training on uneven inputs, as torch DDP's ``join()``.

        Ranks that run out of data shadow the collectives of the others' iterations (contributing
        zero gradients) until every rank is done; then every rank takes the model of the last rank
        to finish. Gradients are divided by the initial world size, or, with
        ``divide_by_initial_world_size=False``, by the number of ranks still training.
        ``throw_on_early_termination=True`` raises on every rank as soon as one runs out instead.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _DataParallelJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._comm_device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # --- collectives beyond the gradients ----------------------------------------------------

    def _buffers_to_sync(self) -> bool:
        return self.broadcast_buffers and self._buffers_due and self._has_buffers

    def _broadcast_from(self, src: int, tensors: list[torch.Tensor]) -> None:
        broadcast_coalesced(tensors, src, self.process_group)

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank among those passing ``candidate=True`` (one all-reduce)."""
        rank = torch.tensor([self.rank if candidate else -1], device=self._comm_device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(rank.item())

    def _all_reduce_flag(self, flag: bool) -> bool:
        """Whether any rank passed ``flag=True``: the ones still training tell the joined ones whether
        this iteration's backward is averaged. Waits only where ``flag`` is False."""
        value = torch.tensor([1.0 if flag else 0.0], device=self._comm_device)
        work = dist.all_reduce(value, group=self.process_group, async_op=True)
        if flag:
            return True
        work.wait()
        return bool(value.item() != 0)

    # --- construction ------------------------------------------------------------------------

    def _config(self) -> dict[str, object]:
        """What every rank must wrap alike, so that their collectives match."""
        return {"strategy": type(self).__name__, "broadcast_buffers": self.broadcast_buffers,
                "find_unused_parameters": self.find_unused_parameters}

    def _check_same_on_every_rank(self, buckets: list[list[int]]) -> None:
        """Raise the same error on every rank if any rank's model or wrapper differs from rank 0's, or sits
        on a device the backend cannot serve (one all-gather, so no rank is left waiting)."""
        signature = [(f"parameter {n!r}", tuple(p.shape), str(p.dtype), p.requires_grad)
                     for n, p in self.module.named_parameters()]
        signature += [(f"buffer {n!r}", tuple(b.shape), str(b.dtype), False)
                      for n, b in self.module.named_buffers()]
        config = {**self._config(), "bucket sizes (parameters per bucket)": [len(b) for b in buckets]}
        gathered = all_gather_objects((self._local_device_problem(), signature, config), self.process_group,
                                      self._device_for_collectives(first=None))
        for rank, (rank_problem, _, _) in enumerate(gathered):
            if rank_problem:
                raise ValueError(f"rank {rank}: {rank_problem}")
        reference, reference_config = gathered[0][1], gathered[0][2]
        for rank, (_, rank_signature, rank_config) in enumerate(gathered[1:], start=1):
            mismatch = _first_difference(reference, rank_signature, rank)
            if mismatch:
                raise ValueError(f"module: {mismatch}; every rank must build the same model")
            for key, value in reference_config.items():
                if rank_config[key] != value:
                    raise ValueError(f"{key}: {value!r} on rank 0 but {rank_config[key]!r} on rank {rank}; "
                                     "every rank must wrap its model with the same strategy and arguments")

    def _local_device_problem(self) -> str | None:
        tensors = [*self.module.named_parameters(), *self.module.named_buffers()]
        for name, tensor in tensors:
            if self._backends and tensor.device.type not in self._backends:
                served = ", ".join(f"{d} ({b})" for d, b in self._backends.items())
                return (f"module: {name!r} is on device {tensor.device}, which the process group's "
                        f"backend cannot serve (it serves {served}); move the module to a served device "
                        "(e.g. model.to(f'cuda:{local_rank}') for NCCL) before wrapping it")
        return None

    def _device_for_collectives(self, first: torch.Tensor | None) -> torch.device:
        """``first``'s device if the backend serves it, else the CPU (gloo) or the current GPU (NCCL)."""
        if first is not None and (not self._backends or first.device.type in self._backends):
            return first.device
        if not self._backends or "cpu" in self._backends:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())


class _DataParallelJoinHook(JoinHook):
    """What a rank that has run out of data does while others train: the same collectives, with zeros."""

    def __init__(self, ddp: DataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp._buffers_to_sync():
            ddp._broadcast_from(ddp._common_rank(False), list(ddp.module.buffers()))
        averaged = ddp._all_reduce_flag(False)
        ddp._buffers_due = averaged
        if averaged:
            ddp._reducer.shadow_backward(ddp._divide_by_initial_world_size)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        buffers = list(ddp.module.buffers()) if ddp.broadcast_buffers else []
        ddp._broadcast_from(ddp._common_rank(is_last_joiner), [*ddp.module.parameters(), *buffers])


def bucket_limits(bucket_size_mb: float | None, argument: str, default: bool) -> tuple[float, ...]:
    """:attr:`DataParallel.bucket_limits` for a bucket size in MiB, as torch DDP sets them: the size in
    whole bytes, after a first bucket of 1 MiB where the size is the ``default``; ``None``: one bucket."""
    if bucket_size_mb is None:
        return (math.inf,)
    # 1e308 MiB is a finite size whose bytes are not: that too is refused here, not by int().
    if isinstance(bucket_size_mb, bool) or not (isinstance(bucket_size_mb, (int, float))
                                                and 0 <= float(bucket_size_mb) * MiB < math.inf):
        raise ValueError(f"{argument} must be a non-negative number of MiB whose bytes are finite (or None "
                         f"for one bucket), got {bucket_size_mb!r}")
    cap = int(bucket_size_mb * MiB)
    return (min(cap, FIRST_BUCKET_BYTES), cap) if default else (cap,)


def _check_device_ids(module: nn.Module, device_ids: Sequence[int | torch.device] | None,
                      output_device: int | torch.device | None) -> tuple[list[int] | None, int | None]:
    """torch DDP's rule: device ids only for a module on one CUDA device, and then that device."""
    devices = {p.device for p in module.parameters()}
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"device_ids can only be None or contain a single element, got {device_ids}")
    if not device_ids:
        if output_device is not None:
            raise ValueError("output_device: only allowed together with device_ids, for a module on one "
                             f"CUDA device; got output_device={output_device}, device_ids={device_ids}")
        return None, None
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"device_ids and output_device only work with a module on one CUDA device; got "
                         f"device_ids {list(device_ids)}, output_device {output_device}, and module "
                         f"parameters on {sorted(map(str, devices))} (pass device_ids=None for CPU modules)")
    index = _cuda_index(device_ids[0])
    (module_device,) = devices
    if index != module_device.index:
        raise ValueError(f"device_ids: the module is on {module_device} but device_ids={list(device_ids)}")
    output = index if output_device is None else _cuda_index(output_device)
    return [index], output


def _cuda_index(device: int | torch.device) -> int | None:
    return device if isinstance(device, int) else torch.device(device).index


def _first_difference(reference: Sequence[tuple], other: Sequence[tuple], rank: int) -> str | None:
    """The first entry of two model signatures (name, shape, dtype, requires_grad) that differs."""
    for ref, oth in zip(reference, other, strict=False):  # the lengths are compared below
        if ref[0] != oth[0]:
            return f"rank 0 has {ref[0]} where rank {rank} has {oth[0]}"
        if ref[1:] != oth[1:]:
            return (f"{ref[0]} has shape {ref[1]}, {ref[2]}, requires_grad={ref[3]} on rank 0 but "
                    f"shape {oth[1]}, {oth[2]}, requires_grad={oth[3]} on rank {rank}")
    if len(reference) != len(other):
        longer, owner = (reference, "rank 0") if len(reference) > len(other) else (other, f"rank {rank}")
        return f"only {owner} has {longer[min(len(reference), len(other))][0]}"
    return None
