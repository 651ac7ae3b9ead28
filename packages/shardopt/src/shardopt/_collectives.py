"""The few collectives ShardedOptimizer needs beyond torch.distributed's: objects and state moves."""

from __future__ import annotations

import ctypes
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_objects(obj: Any, group: ProcessGroup, device: torch.device) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, through tensors on ``device``.

    Unlike ``dist.all_gather_object`` this names the device, so it works with NCCL whether or
    not the caller ran ``torch.cuda.set_device``.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    lengths = torch.zeros(world_size, dtype=torch.int64, device=device)
    all_gather_single(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device), group=group)
    lengths_list = lengths.tolist()
    longest = max(lengths_list)
    gathered = torch.zeros(world_size * longest, dtype=torch.uint8, device=device)
    own = gathered.narrow(0, rank * longest, longest)
    own[: payload.numel()] = payload
    all_gather_single(gathered, own, group=group)
    host_copy = gathered.cpu()
    host = ctypes.string_at(host_copy.data_ptr(), host_copy.numel())  # the bytes, without needing numpy
    return [pickle.loads(host[r * longest: r * longest + n]) for r, n in enumerate(lengths_list)]


def raise_on_every_rank(problem: str | None, group: ProcessGroup, device: torch.device) -> None:
    """Raise ValueError on every rank if any rank found a ``problem``, so no rank goes on alone.

    Each rank's message is its own problem, or else the first other rank's, naming that rank.
    """
    problems = all_gather_objects(problem, group, device)
    if problem is not None:
        raise ValueError(problem)
    for rank, other in enumerate(problems):
        if other is not None:
            raise ValueError(f"{other} (found on rank {rank} of process_group; every rank raises)")


@dataclass(frozen=True)
class TensorSpec:
    """Where a tensor sent point-to-point sits in a state skeleton."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def split_tensors(value: Any, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): ``value`` with its tensors on ``device`` replaced by TensorSpecs.

    Those tensors travel point-to-point; everything else (scalars, CPU step counters next to
    CUDA parameters) travels pickled inside the skeleton.
    """
    tensors: list[torch.Tensor] = []

    def strip(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.device == device:
            tensors.append(v.detach().contiguous())
            return TensorSpec(tuple(v.shape), v.dtype)
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(strip(x) for x in v)
        return v

    return strip(value), tensors


def tensor_specs(skeleton: Any) -> list[TensorSpec]:
    """The TensorSpecs of a skeleton, in the order split_tensors collected their tensors."""
    if isinstance(skeleton, TensorSpec):
        return [skeleton]
    if isinstance(skeleton, dict):
        return [s for v in skeleton.values() for s in tensor_specs(v)]
    if isinstance(skeleton, (list, tuple)):
        return [s for v in skeleton for s in tensor_specs(v)]
    return []


def join_tensors(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """Inverse of split_tensors: the skeleton with its TensorSpecs replaced by ``tensors`` in order."""
    if isinstance(skeleton, TensorSpec):
        return next(tensors)
    if isinstance(skeleton, dict):
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join_tensors(v, tensors) for v in skeleton)
    return skeleton


def move_objects(outgoing: dict[int, tuple[int, Any]], group: ProcessGroup, device: torch.device,
                 result_device: torch.device) -> dict[int, Any]:
    """Send each ``outgoing[key] = (destination rank, value)`` there; return what arrives here, by key.

    Every rank calls this (with its own ``outgoing``, possibly empty). Skeletons go to every rank
    in one object all-gather; tensors then go point-to-point in one order that all ranks share
    (source rank, then key), so each send meets its receive and nothing waits on a cycle.
    Received tensors land on ``result_device`` one at a time, so at most one extra tensor sits
    on ``device`` while they arrive.
    """
    rank = dist.get_rank(group)
    split = {key: (dst, *split_tensors(value, device)) for key, (dst, value) in outgoing.items()}
    announced = all_gather_objects({key: (dst, skeleton) for key, (dst, skeleton, _) in split.items()},
                                   group, device)
    received: dict[int, Any] = {}
    for src, entries in enumerate(announced):
        for key in sorted(entries):
            dst, skeleton = entries[key]
            if rank == src:
                for tensor in split[key][2]:
                    dist.send(tensor, dst=dist.get_global_rank(group, dst), group=group)
            elif rank == dst:
                arrived = []
                for spec in tensor_specs(skeleton):
                    buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                    dist.recv(buffer, src=dist.get_global_rank(group, src), group=group)
                    arrived.append(buffer.to(result_device))
                received[key] = join_tensors(skeleton, iter(arrived))
    return received
