"""minddp.FSDP on 2 and 3 gloo ranks trains exactly like one process, with 1/N of the memory per rank.

The reference is one process that runs each rank's micro-batch in turn on the full model,
accumulates the gradients and divides by N: mathematically the mean over the concatenated batch,
and in floating point the same sums FSDP does, so at 2 ranks (a sum of two is order-free) the
parameters must match bit for bit. They must also match a plain backward over the concatenated
batch to rounding (that backward sums inside each matmul, in an order no data-parallel wrapper
can reproduce); torch's own FSDP2 and DDP, trained beside it, match it bit for bit at 2 ranks.
The model has Transformer-style blocks, an LM head tied to the embedding, a frozen layer,
1-D parameters and sizes that need padding at 2 and 3 ranks. ``FSDP`` is a thin layer over
``fully_shard``, whose own tests (test_fully_shard.py) cover memory, meta init, HSDP and the rest.
"""

from __future__ import annotations

import copy
import gc
import itertools
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from minddp import FSDP

VOCAB, D, HIDDEN, SEQ, PER_RANK, STEPS = 11, 5, 7, 4, 3, 3
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.01),
              "adamw": lambda params: torch.optim.AdamW(params, lr=0.05)}
COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Blocks of 35 + 35 weights (padded at 3 ranks) in an nn.Sequential, a tied 55-weight embedding (padded
    at 2)."""

    def __init__(self, layers: int = 2, d: int = D, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d)
        self.frozen = nn.Linear(d, d, bias=False).requires_grad_(False)
        self.blocks = nn.Sequential(*(Block(d, hidden) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.frozen(self.embedding(tokens)))))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def batches(world_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (world_size * PER_RANK, SEQ + 1), generator=g) for _ in range(STEPS)]


def cast_copy(model: nn.Module, dtype: torch.dtype | None,
              keep: tuple[type[nn.Module], ...] = ()) -> nn.Module:
    """A copy with the weights FSDP computes with: every parameter in ``dtype`` (if given) but those of
    ``keep``'s modules."""
    low = copy.deepcopy(model)
    if dtype is not None:
        kept = {id(p) for m in low.modules() if isinstance(m, keep) for p in m.parameters(recurse=False)}
        for p in low.parameters():
            if id(p) not in kept:
                p.data = p.data.to(dtype)
    return low


def reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, world_size: int,
                   dtype: torch.dtype | None, keep: tuple[type[nn.Module], ...] = ()) -> None:
    """Each rank's micro-batch in turn, gradients summed in fp32 then divided by the world size."""
    optimizer.zero_grad(set_to_none=True)
    for micro in batch.chunk(world_size):
        low = cast_copy(model, dtype, keep)
        loss_of(low, micro).backward()
        for p, q in zip(model.parameters(), low.parameters(), strict=True):
            if q.grad is not None:
                grad = q.grad.float()
                p.grad = grad if p.grad is None else p.grad + grad
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= world_size
    optimizer.step()


def concatenated_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    optimizer.step()


def largest_difference(full: dict[str, torch.Tensor], model: nn.Module) -> float:
    return max((full[n] - p).abs().max().item() for n, p in model.named_parameters())


def train_and_compare(rank: int, world_size: int) -> dict[str, Any]:
    """Every (optimizer, compute dtype) case; per case the largest differences from both references."""
    report = {}
    for opt_name, dtype_name in itertools.product(OPTIMIZERS, COMPUTE_DTYPES):
        dtype = COMPUTE_DTYPES[dtype_name]
        torch.manual_seed(0)
        base = TinyLM()
        reference, concatenated = copy.deepcopy(base), copy.deepcopy(base)
        torch.manual_seed(100 + rank)  # other ranks start elsewhere: FSDP must take rank 0's values
        own = copy.deepcopy(base) if rank == 0 else TinyLM()
        fsdp = FSDP(own, compute_dtype=dtype)
        optimizer = OPTIMIZERS[opt_name](fsdp.parameters())
        ref_opt = OPTIMIZERS[opt_name](reference.parameters())
        cat_opt = OPTIMIZERS[opt_name](concatenated.parameters())
        for batch in batches(world_size):
            optimizer.zero_grad(set_to_none=True)
            loss_of(fsdp, batch.chunk(world_size)[rank]).backward()
            fsdp.finish_gradient_synchronization()
            optimizer.step()
            reference_step(reference, ref_opt, batch, world_size, dtype)
            concatenated_step(concatenated, cat_opt, batch)
        full = fsdp.gather_full_params()
        assert list(full) == [n for n, _ in base.named_parameters()]
        report[f"{opt_name}-{dtype_name}"] = {"vs_reference": largest_difference(full, reference),
                                               "vs_concatenated": largest_difference(full, concatenated),
                                               "moved": largest_difference(full, base)}
    return report


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def training_reports(request: pytest.FixtureRequest, ranks: Any) -> tuple[int, list[dict[str, Any]]]:
    return request.param, ranks(train_and_compare, request.param)


@pytest.mark.parametrize("case", [f"{o}-{d}" for o, d in itertools.product(OPTIMIZERS, COMPUTE_DTYPES)])
def test_training_matches_one_process(training_reports: tuple[int, list[dict[str, Any]]], case: str) -> None:
    world_size, reports = training_reports
    for report in reports:
        result = report[case]
        assert result["moved"] > 1e-3  # training changed the parameters, so equality means something
        if world_size == 2:
            assert result["vs_reference"] == 0.0, result
        else:
            assert result["vs_reference"] < 1e-6, result
        tolerance = 1e-5 if case.endswith("fp32") else 5e-2
        assert result["vs_concatenated"] < tolerance, result


def torch_fsdp2(model: TinyLM, dtype: torch.dtype | None, world_size: int) -> nn.Module:
    """``model`` under torch's FSDP2 with the same units and the precision minddp.FSDP uses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    # compute_dtype casts every parameter; gradients are reduced in fp32 (FSDP2's default: in param_dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def against_torch(rank: int, world_size: int) -> dict[str, float]:
    """minddp.FSDP, torch's FSDP2 and (fp32) torch's DDP trained side by side; the largest differences.

    All three add up the ranks' gradients of the same micro-batches. At 2 ranks that sum is one
    addition, so they must agree bit for bit. At 3 ranks gloo's ring adds each element in an order
    that depends on where it sits in the buffer (FSDP2 pads each parameter, DDP divides before
    summing), so they agree to rounding.
    """
    from torch.nn.parallel import DistributedDataParallel

    differences = {}
    for opt_name, dtype_name in itertools.product(OPTIMIZERS, COMPUTE_DTYPES):
        dtype = COMPUTE_DTYPES[dtype_name]
        torch.manual_seed(0)
        base = TinyLM()
        theirs = {"fsdp2": torch_fsdp2(copy.deepcopy(base), dtype, world_size)}
        if dtype is None:
            theirs["ddp"] = DistributedDataParallel(copy.deepcopy(base))
        ours = FSDP(copy.deepcopy(base), compute_dtype=dtype)
        models = {"minddp": ours, **theirs}
        optimizers = {name: OPTIMIZERS[opt_name](m.parameters()) for name, m in models.items()}
        for batch in batches(world_size):
            for name, model in models.items():
                optimizers[name].zero_grad(set_to_none=True)
                loss_of(model, batch.chunk(world_size)[rank]).backward()
                if model is ours:
                    ours.finish_gradient_synchronization()
                optimizers[name].step()
        full = ours.gather_full_params()
        assert largest_difference(full, base) > 1e-3  # trained, so equality means something
        fsdp2 = {n: p.full_tensor() for n, p in theirs["fsdp2"].named_parameters()}
        differences[f"{opt_name}-{dtype_name} vs fsdp2"] = max((full[n] - t).abs().max().item()
                                                               for n, t in fsdp2.items())
        if "ddp" in theirs:
            differences[f"{opt_name}-{dtype_name} vs ddp"] = largest_difference(full, theirs["ddp"].module)
    return differences


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_is_bitwise_torch_fsdp2_and_ddp(ranks: Any, world_size: int) -> None:
    tolerance = 0.0 if world_size == 2 else 1e-6
    for differences in ranks(against_torch, world_size):
        assert differences and all(d <= tolerance for d in differences.values()), differences


def norms_in_their_dtype(rank: int, world_size: int) -> dict[str, float]:
    """bf16 compute with the LayerNorms kept in fp32 (keep_dtype_modules), against one process doing
    the same and against one casting everything."""
    torch.manual_seed(0)
    base = TinyLM()
    fsdp = FSDP(copy.deepcopy(base), compute_dtype=torch.bfloat16, keep_dtype_modules=[nn.LayerNorm])
    optimizer = OPTIMIZERS["sgd"](fsdp.parameters())
    references = {keep: copy.deepcopy(base) for keep in ((nn.LayerNorm,), ())}
    ref_opts = {keep: OPTIMIZERS["sgd"](model.parameters()) for keep, model in references.items()}
    for batch in batches(world_size):
        optimizer.zero_grad(set_to_none=True)
        loss_of(fsdp, batch.chunk(world_size)[rank]).backward()
        fsdp.finish_gradient_synchronization()
        optimizer.step()
        for keep, model in references.items():
            reference_step(model, ref_opts[keep], batch, world_size, torch.bfloat16, keep)
    full = fsdp.gather_full_params()
    return {"kept": largest_difference(full, references[(nn.LayerNorm,)]),
            "all cast": largest_difference(full, references[()])}


def test_keep_dtype_modules_compute_those_modules_in_their_dtype(ranks: Any) -> None:
    for report in ranks(norms_in_their_dtype, 2):
        assert report["kept"] == 0.0, report
        assert report["all cast"] > 1e-4, report  # the norms' dtype changes the result


def accumulate(rank: int, world_size: int) -> dict[str, float]:
    """Two backward passes before one synchronization, and two forwards before one backward."""
    differences = {}
    for mode in ("two backwards", "two forwards"):
        torch.manual_seed(0)
        base = TinyLM()
        reference = copy.deepcopy(base)
        fsdp = FSDP(copy.deepcopy(base))
        first, second = batches(world_size)[:2]
        mine = [first.chunk(world_size)[rank], second.chunk(world_size)[rank]]
        if mode == "two backwards":
            loss_of(fsdp, mine[0]).backward()
            loss_of(fsdp, mine[1]).backward()
        else:
            (loss_of(fsdp, mine[0]) + loss_of(fsdp, mine[1])).backward()
        fsdp.finish_gradient_synchronization()
        torch.optim.SGD(fsdp.parameters(), lr=1.0).step()
        for batch in (first, second):
            for micro in batch.chunk(world_size):
                (loss_of(reference, micro) / world_size).backward()
        torch.optim.SGD(reference.parameters(), lr=1.0).step()
        differences[mode] = largest_difference(fsdp.gather_full_params(), reference)
    return differences


def test_gradients_accumulate_until_synchronized(ranks: Any) -> None:
    for differences in ranks(accumulate, 2):
        assert differences["two backwards"] < 1e-6 and differences["two forwards"] < 1e-6, differences

def alive_after_training_and_dropping(wrap: Any) -> tuple[int, int]:
    """Trains ``wrap(TinyLM())`` a few AdamW steps and drops it; how many of its parameters, gradients and
    (minddp's) units are still alive, and how many gradients there were."""
    torch.manual_seed(0)
    wrapped = wrap(TinyLM())
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.05)
    for tokens in batches(1):
        loss_of(wrapped, tokens).backward()
        getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
        optimizer.step()
    grads = [weakref.ref(p.grad) for p in wrapped.parameters() if p.grad is not None]
    refs = [weakref.ref(p) for p in wrapped.parameters()] + grads
    refs += [weakref.ref(u) for u in getattr(wrapped, "units", ())]
    del wrapped, optimizer
    gc.collect()
    return sum(r() is not None for r in refs), len(grads)


@pytest.mark.parametrize("compute", COMPUTE_DTYPES)
def test_a_dropped_fsdp_frees_its_shards_and_gradients(single_rank_group: None, compute: str) -> None:
    """Once trained and dropped, nothing keeps an FSDP's shards, gradients or units alive (the gradient
    hooks, held by C++, once did: a benchmark's next model ran with the last one's memory taken), as
    nothing keeps torch's FSDP2's, trained on the same data."""
    dtype = COMPUTE_DTYPES[compute]
    ours, our_grads = alive_after_training_and_dropping(lambda model: FSDP(model, compute_dtype=dtype))
    theirs, their_grads = alive_after_training_and_dropping(lambda model: torch_fsdp2(model, dtype, 1))
    assert our_grads and their_grads
    assert (ours, theirs) == (0, 0)


# --- checkpoints ------------------------------------------------------------------------------------

def train_and_save(rank: int, world_size: int, folder: str) -> None:
    """One AdamW step at this world size, then a full state dict (rank 0) and a sharded checkpoint (DCP)."""
    torch.manual_seed(0)
    fsdp = FSDP(TinyLM())
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=0.05)
    loss_of(fsdp, batches(world_size)[0].chunk(world_size)[rank]).backward()
    fsdp.finish_gradient_synchronization()
    optimizer.step()
    full = fsdp.full_state_dict()
    if rank == 0:
        torch.save(full, f"{folder}/full.pt")
    dcp.save(fsdp.sharded_state_dict(), checkpoint_id=f"{folder}/sharded")


def load_and_compare(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """Both checkpoints loaded into a fresh model at this world size; differences from the saved values."""
    saved = torch.load(f"{folder}/full.pt")
    torch.manual_seed(1)  # different initial values, overwritten by the loads
    fsdp = FSDP(TinyLM())
    fsdp.load_full_state_dict(saved)
    from_full = fsdp.full_state_dict()
    torch.manual_seed(2)
    fsdp = FSDP(TinyLM())
    state = fsdp.sharded_state_dict()
    dcp.load(state, checkpoint_id=f"{folder}/sharded")
    fsdp.load_sharded_state_dict(state)
    from_sharded = fsdp.full_state_dict()
    assert list(from_full) == list(saved) == list(from_sharded)
    return {"full": max((from_full[k] - v).abs().max().item() for k, v in saved.items()),
            "sharded": max((from_sharded[k] - v).abs().max().item() for k, v in saved.items())}


@pytest.mark.parametrize(("save_at", "load_at"), [(2, 3), (3, 2)])
def test_checkpoints_move_between_world_sizes(ranks: Any, tmp_path: Any, save_at: int, load_at: int) -> None:
    ranks(train_and_save, save_at, str(tmp_path))
    for differences in ranks(load_and_compare, load_at, str(tmp_path)):
        assert differences == {"full": 0.0, "sharded": 0.0}


# --- bad input --------------------------------------------------------------------------------------

def error_messages(rank: int, world_size: int) -> dict[str, str]:
    cases = {
        "differs": lambda: FSDP(TinyLM(hidden=HIDDEN + rank)),
        "integer dtype": lambda: FSDP(TinyLM(), compute_dtype=torch.int32),
        "shared by two blocks": lambda: FSDP(tied_across_blocks()),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
        except ValueError as exc:
            messages[name] = str(exc)
        dist.barrier()
    return messages


def tied_across_blocks() -> TinyLM:
    model = TinyLM()
    model.blocks[1].up.weight = model.blocks[0].up.weight
    return model


def test_bad_input_gets_a_clear_error_on_every_rank(ranks: Any) -> None:
    for messages in ranks(error_messages, 2):
        assert "fully_shard: rank 0 has parameter up.weight (7, 5)" in messages["differs"]
        assert "rank 1 has parameter up.weight (8, 5)" in messages["differs"]
        assert "compute_dtype=torch.int32 is not a floating-point" in messages["integer dtype"]
        assert "parameter 'up.weight' is shared with 'Block.up.weight'" in messages["shared by two blocks"]


def call_the_inner_module(rank: int, world_size: int) -> float:
    """``fsdp.module(x)`` is the sharded model itself: the same output as ``fsdp(x)``."""
    torch.manual_seed(0)
    fsdp = FSDP(TinyLM())
    tokens = batches(world_size)[0].chunk(world_size)[rank]
    return (fsdp.module(tokens) - fsdp(tokens)).abs().max().item()


def test_calling_the_inner_module_is_calling_the_model(ranks: Any) -> None:
    assert ranks(call_the_inner_module, 2) == [0.0, 0.0]
