"""Small collectives the wrappers build on: coalesced broadcasts and an all-gather of bytes."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

_BROADCAST_CHUNK_BYTES = 256 * 2**20
T = TypeVar("T", bound=torch.Tensor)


def all_gather_objects(obj: Any, group: dist.ProcessGroup, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order: two all-gathers of tensors on ``device``.

    ``dist.all_gather_object`` does the same but needs numpy, which minddp does not depend on.
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    world_size = dist.get_world_size(group)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(bytes(t[:n].tolist())) for t, n in zip(gathered, lengths, strict=True)]


def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
    """Copy group rank ``src``'s values into ``tensors``, small ones coalesced into broadcasts of <= 256 MiB.

    Written through ``.data``, so buffers that autograd saved for a backward still to come are
    not flagged as modified in place (as torch DDP does for its buffer broadcasts).
    """
    source = dist.get_global_rank(group, src)
    with torch.no_grad():
        for chunk_tensors in group_by_size([t.data for t in tensors], _BROADCAST_CHUNK_BYTES):
            if len(chunk_tensors) == 1 and chunk_tensors[0].is_contiguous():
                dist.broadcast(chunk_tensors[0], src=source, group=group)
                continue
            flat = torch.cat([t.reshape(-1) for t in chunk_tensors])
            dist.broadcast(flat, src=source, group=group)
            for t, part in zip(chunk_tensors, flat.split([t.numel() for t in chunk_tensors]), strict=True):
                t.copy_(part.view_as(t))


def group_by_size(tensors: Sequence[T], max_bytes: float,
                  first_max_bytes: float | None = None) -> list[list[T]]:
    """Consecutive runs of ``tensors`` of one device and dtype holding at most ``max_bytes`` each.

    A tensor larger than the limit forms a group of its own; ``max_bytes=0`` gives one group per
    tensor and ``math.inf`` one group per (device, dtype) run. ``first_max_bytes`` limits the
    first group instead, where given.
    """
    groups: list[list[T]] = []
    group_bytes = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        current = groups[-1] if groups else None
        limit = first_max_bytes if first_max_bytes is not None and len(groups) == 1 else max_bytes
        if (current is None or (t.device, t.dtype) != (current[0].device, current[0].dtype)
                or group_bytes + size > limit):
            groups.append([t])
            group_bytes = size
        else:
            current.append(t)
            group_bytes += size
    return groups


def backend_per_device_type(group: dist.ProcessGroup) -> dict[str, str]:
    """{'cpu': 'gloo', 'cuda': 'gloo'} for gloo, {'cuda': 'nccl'} for NCCL, from the group's backend config.

    Empty where the config does not say (a third-party backend): then no device is refused here
    and the backend raises its own error.
    """
    items = (item.split(":", 1) for item in str(dist.get_backend_config(group)).split(",") if ":" in item)
    return {device.strip(): backend.strip() for device, backend in items}
