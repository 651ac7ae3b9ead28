import math
import pickle

import pytest
import torch
from torch import nn

import profkit
from profkit.breakdown import memory_breakdown

FORWARD = {"filename": "/repo/model.py", "line": 5, "name": "forward"}
MAIN = {"filename": "/repo/train.py", "line": 9, "name": "main"}
INIT_GROUP = {
    "filename": "/venv/lib/python3.11/site-packages/torch/optim/adam.py",
    "line": 1,
    "name": "_init_group",
}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": list(frames)}


def free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size, "stream": 0, "frames": []}


def trained():
    """A CPU model after one Adam step: parameters, gradients and state exist, at real addresses."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def storages(tensors):
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]


def snapshot_of(model, optimizer, activation_bytes):
    """Parameters allocated before recording (live blocks at the end); then a forward, a backward, a step."""
    params = storages(model.parameters())
    grads = storages(p.grad for p in model.parameters())
    state = storages(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    trace = [
        alloc(1, activation_bytes, MAIN, FORWARD),  # saved for backward
        alloc(2, 64, MAIN),  # the batch
        *(alloc(ptr, size) for ptr, size in grads),  # autograd's thread: no Python frames
        alloc(3, 500),  # an activation gradient
        free(3, 500),
        free(1, activation_bytes),
        *(alloc(ptr, size, MAIN, INIT_GROUP) for ptr, size in state),
        alloc(4, 32, MAIN, INIT_GROUP),  # a state tensor the optimizer no longer holds
    ]
    blocks = [
        {"address": ptr, "size": size, "state": "active_allocated", "frames": []} for ptr, size in params
    ]
    return {"segments": [{"device": 0, "address": 0, "blocks": blocks}], "device_traces": [trace]}


def test_peak_in_backward_by_pointer_and_stack(tmp_path):
    model, optimizer = trained()
    params = sum(size for _, size in storages(model.parameters()))
    grads = sum(size for _, size in storages(p.grad for p in model.parameters()))
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot_of(model, optimizer, activation_bytes=100_000)))
    result = memory_breakdown(path, model=model, optimizer=optimizer)
    assert result.source == "snapshot"
    assert result.bytes == {
        "parameters": params,
        "gradients": grads + 500,
        "optimizer state": 0,
        "activations": 100_000,
        "other": 64,
    }
    assert result.peak_bytes == params + grads + 500 + 100_000 + 64
    assert result.blocks["activations"] == 1 and result.blocks["parameters"] == 4
    # without the model and optimizer, the stacks alone: parameters (allocated before) become other
    alone = memory_breakdown(path)
    assert alone.bytes["parameters"] == 0 and alone.bytes["other"] == params + 64
    assert alone.bytes["gradients"] == grads + 500


def test_peak_at_the_optimizer_step():
    model, optimizer = trained()
    params = sum(size for _, size in storages(model.parameters()))
    grads = sum(size for _, size in storages(p.grad for p in model.parameters()))
    result = memory_breakdown(
        snapshot_of(model, optimizer, activation_bytes=10), model=model, optimizer=optimizer
    )
    assert result.bytes["optimizer state"] == 2 * params + 32  # Adam's two moments, and one by stack
    assert result.bytes["activations"] == 0 and result.bytes["gradients"] == grads
    assert result.peak_bytes == math.fsum(result.bytes.values())
    text = result.format(markdown=True)
    assert "| optimizer state " in text and "| peak " in text


def test_without_a_snapshot_tensor_sizes_match_torch():
    model, optimizer = trained()
    result = memory_breakdown(model=model, optimizer=optimizer)
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert result.source == "tensor sizes"
    assert result.bytes["parameters"] == expected and result.bytes["gradients"] == expected
    assert result.bytes["optimizer state"] == sum(
        v.nbytes for s in optimizer.state.values() for v in s.values() if v.dim() > 0
    )
    assert math.isnan(result.bytes["activations"]) and math.isnan(result.peak_bytes)
    # a flat buffer's views count once, with their buffer
    flat = torch.zeros(10)
    shared = nn.Module()
    shared.a, shared.b = nn.Parameter(flat[:5]), nn.Parameter(flat[5:])
    assert memory_breakdown(model=shared).bytes["parameters"] == 40
    with pytest.raises(ValueError, match="needs a snapshot"):
        memory_breakdown()


def test_exported_from_the_package():
    assert profkit.memory_breakdown is memory_breakdown
