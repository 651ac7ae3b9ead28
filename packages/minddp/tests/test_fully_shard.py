"""minddp.fully_shard against torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2, 3 and 4 gloo ranks.

Both libraries have the same names, so each check builds the same model twice, once with each module
(``shard_with(minddp, ...)`` / ``shard_with(torch.distributed.fsdp, ...)``), trains both on the same
data with AdamW on ``model.parameters()`` and torch's own ``clip_grad_norm_``, and compares the
parameters (DTensors: compared whole) and the gradient norms. One spawn per world size runs every
check (the machine is small; torch.compile, the slow one, runs at 2 ranks only); each check's
outcome is its own test.

The model has blocks (one unit each), an LM head tied to the embedding (one unit: the root), a frozen
layer, vectors (sharded too) and sizes that need padding, with empty shards at 4 ranks.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import minddp

VOCAB, D, HIDDEN, LAYERS, SEQ, PER_RANK, STEPS = 13, 6, 10, 3, 5, 2, 3


class Block(nn.Module):
    def __init__(self, d: int = D, hidden: int = HIDDEN, checkpointed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d, bias=False)
        self.checkpointed = checkpointed

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # activation checkpointing inside the sharded block
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(
        self, layers: int = LAYERS, d: int = D, hidden: int = HIDDEN, checkpointed: bool = False
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, d)
        self.frozen = nn.Linear(d, d, bias=False).requires_grad_(False)
        self.blocks = nn.ModuleList(Block(d, hidden, checkpointed) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.frozen(self.embedding(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def shard_with(
    lib: Any,
    model: TinyLM,
    mesh: Any,
    mp: dict[str, Any] | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> TinyLM:
    """``model`` under ``lib.fully_shard`` (minddp or torch.distributed.fsdp), each block then the root."""
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": lib.MixedPrecisionPolicy(**(mp or {})),
    }
    if offload:
        kwargs["offload_policy"] = lib.CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        lib.fully_shard(block, **kwargs)
    return lib.fully_shard(model, **kwargs)


def batches(world_size: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (world_size * PER_RANK, SEQ + 1), generator=g) for _ in range(steps)]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())


def train(model: nn.Module, rank: int, world_size: int, micro_batches: int = 1) -> list[float]:
    """AdamW on ``model.parameters()`` with torch's clip_grad_norm_; the norms it returned. With several
    micro-batches, all but the last run with gradient sync off (a sharded model)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    norms = []
    for batch in batches(world_size):
        optimizer.zero_grad(set_to_none=True)
        mine = batch.chunk(world_size)[rank] if hasattr(model, "unshard") else batch
        for i, micro in enumerate(mine.chunk(micro_batches)):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == micro_batches - 1)
            (loss_of(model, micro) / micro_batches).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        optimizer.step()
    return norms


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


def difference(a: nn.Module | dict[str, torch.Tensor], b: nn.Module | dict[str, torch.Tensor]) -> float:
    a, b = (m if isinstance(m, dict) else full_params(m) for m in (a, b))
    assert list(a) == list(b), (list(a), list(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


# --- the checks, each run on every rank ------------------------------------------------------------------

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"mp": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}},
    "bf16-reduce-bf16": {"mp": {"param_dtype": torch.bfloat16}},
    "zero2": {"reshard_after_forward": False},
    "cpu-offload": {"offload": True},
    "checkpointed": {"checkpointed": True},
    "accumulate-without-sync": {"micro_batches": 2},
}


def against_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    """Each config trained by minddp and by torch's FSDP2 (and, fp32, by one process on the whole batch)."""
    mesh = init_device_mesh("cpu", (world_size,))
    report = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        base = TinyLM(checkpointed=config.get("checkpointed", False))
        shard_kwargs = {k: config[k] for k in ("mp", "offload", "reshard_after_forward") if k in config}
        ours = shard_with(minddp, copy.deepcopy(base), mesh, **shard_kwargs)
        theirs = shard_with(torch_fsdp, copy.deepcopy(base), mesh, **shard_kwargs)
        micro = config.get("micro_batches", 1)
        our_norms, their_norms = (train(m, rank, world_size, micro) for m in (ours, theirs))
        report[name] = {
            "params": difference(ours, theirs),
            "moved": difference(ours, base),
            "norms": max(abs(a - b) for a, b in zip(our_norms, their_norms, strict=True)),
            "frozen": difference({"w": ours.frozen.weight.full_tensor()}, {"w": base.frozen.weight}),
            "all DTensors": all(isinstance(p, DTensor) for p in ours.parameters()),
        }
        if name == "fp32":
            single = copy.deepcopy(base)
            train(single, rank, world_size)
            report[name]["one process"] = difference(ours, single)
    return report


def torch_policy_objects(rank: int, world_size: int) -> dict[str, Any]:
    """torch's own MixedPrecisionPolicy and CPUOffloadPolicy objects given to minddp.fully_shard."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    base = TinyLM()
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    ours = shard_with(minddp, copy.deepcopy(base), mesh, mp)
    with_torch_objects = copy.deepcopy(base)
    for module in [*with_torch_objects.blocks, with_torch_objects]:
        minddp.fully_shard(
            module,
            mesh=mesh,
            mp_policy=torch_fsdp.MixedPrecisionPolicy(**mp),
            offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False),
        )
    train(ours, rank, world_size)
    train(with_torch_objects, rank, world_size)
    return {"params": difference(ours, with_torch_objects)}


def explicit_prefetch(rank: int, world_size: int) -> dict[str, Any]:
    """Each block prefetches the next two (CS336 2026): when block i's forward starts, blocks i+1 and i+2 are
    being gathered; the training is unchanged (against FSDP2 with the same prefetch)."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    base = TinyLM(layers=4)
    ours, theirs = (shard_with(lib, copy.deepcopy(base), mesh) for lib in (minddp, torch_fsdp))
    seen: list[list[bool]] = []
    for model in (ours, theirs):
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
            block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0) : i][::-1])
    for i, block in enumerate(ours.blocks):
        block.register_forward_pre_hook(
            lambda *_, i=i: seen.append(
                [b._fsdp_state.group.is_unsharded for b in list(ours.blocks)[i + 1 : i + 3]]
            )
        )
    train(ours, rank, world_size)
    train(theirs, rank, world_size)
    return {"params": difference(ours, theirs), "gathered ahead": seen[:4]}


def unshard_and_reshard(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = shard_with(minddp, TinyLM(), mesh)
    block = model.blocks[0]
    block.unshard()
    unsharded = (type(block.up.weight).__name__, tuple(block.up.weight.shape))
    block.reshard()
    handle = block.unshard(async_op=True)
    handle.wait()
    after_wait = type(block.up.weight).__name__
    block.reshard()
    resharded = type(block.up.weight).__name__
    model.set_reshard_after_backward(False)
    loss_of(model, batches(world_size)[0].chunk(world_size)[rank]).backward()
    kept = [b._fsdp_state.group.is_unsharded for b in model.blocks]
    model.set_reshard_after_backward(True)
    loss_of(model, batches(world_size)[0].chunk(world_size)[rank]).backward()
    freed = [b._fsdp_state.group.is_unsharded for b in model.blocks]
    return {
        "unsharded": unsharded,
        "resharded": resharded,
        "async": after_wait,
        "class": type(model).__name__,
        "is FSDPModule": isinstance(model, minddp.FSDPModule),
        "kept after backward": kept,
        "freed after backward": freed,
        "output dtype": output_dtype(world_size),
    }


def output_dtype(world_size: int) -> str:
    """bf16 compute, the outputs cast back to fp32 by output_dtype."""
    mesh = init_device_mesh("cpu", (world_size,))
    policy = minddp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = minddp.fully_shard(nn.Linear(D, D), mesh=mesh, mp_policy=policy)
    return str(model(torch.randn(2, D)).dtype)


def meta_init_and_broadcast_load(rank: int, world_size: int) -> dict[str, Any]:
    """Built on meta, fully_shard, to_empty, initialised in place; then a full state dict from rank 0 streamed
    in (set_model_state_dict, broadcast_from_rank0); then trained as FSDP2 trains the same values."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    base = TinyLM()
    with torch.device("meta"):
        model = TinyLM()
    shard_with(minddp, model, mesh)
    on_meta = all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()
    initialised = all(
        not p.is_meta and bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters()
    )
    full = base.state_dict() if rank == 0 else {}
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    loaded = difference(model, base)
    theirs = shard_with(torch_fsdp, copy.deepcopy(base), mesh)
    train(model, rank, world_size)
    train(theirs, rank, world_size)
    return {
        "on meta": on_meta,
        "initialised": initialised,
        "loaded": loaded,
        "trained": difference(model, theirs),
    }


def failed_backward_leaves_nothing(rank: int, world_size: int) -> dict[str, Any]:
    """A backward that raises on every rank after some units were reduced; then zero_grad and a good step.
    The model must equal one that only took the good step."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    base = TinyLM()
    failed, clean = (shard_with(minddp, copy.deepcopy(base), mesh) for _ in range(2))
    first, second = batches(world_size, 2)

    def fail(grad: torch.Tensor) -> None:
        raise RuntimeError("boom")

    hook = failed.blocks[0].register_forward_hook(lambda module, args, out: out.register_hook(fail) and None)
    raised = False
    try:
        loss_of(failed, first.chunk(world_size)[rank]).backward()
    except RuntimeError as exc:
        raised = "boom" in str(exc)
    hook.remove()
    results = {}
    for name, model in (("failed", failed), ("clean", clean)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, second.chunk(world_size)[rank]).backward()
        optimizer.step()
        results[name] = full_params(model)
    return {"raised": raised, "difference": difference(results["failed"], results["clean"])}


def state_dict_and_dcp(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """get_state_dict/set_state_dict and torch.distributed.checkpoint round trip (model and AdamW state);
    the full state dict equals FSDP2's after the same training."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    base = TinyLM()
    model, theirs = (
        shard_with(minddp, copy.deepcopy(base), mesh),
        shard_with(torch_fsdp, copy.deepcopy(base), mesh),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for m, opt in ((model, optimizer), (theirs, torch.optim.AdamW(theirs.parameters(), lr=0.05))):
        loss_of(m, batches(world_size)[0].chunk(world_size)[rank]).backward()
        opt.step()
    options = StateDictOptions(full_state_dict=True)
    ours_full, theirs_full = (get_model_state_dict(m, options=options) for m in (model, theirs))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{folder}/dcp{world_size}")
    torch.manual_seed(5)
    fresh = shard_with(minddp, TinyLM(), mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    dcp.load(state, checkpoint_id=f"{folder}/dcp{world_size}")
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    exp_avg = [
        (optimizer.state[p]["exp_avg"].full_tensor(), fresh_opt.state[q]["exp_avg"].full_tensor())
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True)
        if p.requires_grad
    ]
    return {
        "full vs fsdp2": max((ours_full[k] - theirs_full[k]).abs().max().item() for k in theirs_full),
        "same keys": list(ours_full) == list(theirs_full),
        "dcp params": difference(model, fresh),
        "dcp exp_avg": max((a - b).abs().max().item() for a, b in exp_avg),
    }


def memory_per_rank(rank: int, world_size: int) -> dict[str, Any]:
    """The memory report after an AdamW step, and a model whose full fp32 weights exceed a budget trained
    with at most the budget of weights (shards plus gathered units) held at any time, never built whole."""
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = TinyLM(layers=8, d=16, hidden=48)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    padded = padded_bytes(model.parameters(), world_size)
    block = padded_bytes(model.blocks[0].parameters(), world_size)
    # The shards, the root and three blocks gathered at once (in backward: the one running, the one prefetched
    # and the one whose gradient is about to be reduced), padded to whole rows per rank: less than the model.
    budget = padded / world_size + (padded - 8 * block) + 3 * block
    shard_with(minddp, model, mesh)
    model.to_empty(device="cpu")
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()
    peak = [0]

    def sample(*_: Any) -> None:
        report = minddp.memory_report(model)
        peak[0] = max(peak[0], report["parameters"] + report["padding"] + report["gathered"])

    for m in model.modules():
        m.register_forward_hook(sample)
        if m is not model:
            m.register_full_backward_pre_hook(sample)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in batches(world_size, 2):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, batch.chunk(world_size)[rank]).backward()
        optimizer.step()
    report = minddp.memory_report(model, optimizer)
    norm = model.blocks[0].norm.weight
    return {
        "report": report,
        "full": full_bytes,
        "budget": budget,
        "peak": peak[0],
        "padded": padded,
        "vector local rows": norm.to_local().shape[0],
        "vector rows": norm.shape[0],
    }


def padded_bytes(params: Any, world_size: int) -> int:
    """fp32 bytes of ``params`` with dim 0 padded to a multiple of ``world_size`` (as sharded)."""
    return sum(4 * -(-p.shape[0] // world_size) * world_size * p[0].numel() for p in params)


def refused_on_every_rank(rank: int, world_size: int) -> dict[str, str]:
    """Configs that differ across ranks and weights tied across units: the same clear error on every rank."""
    mesh = init_device_mesh("cpu", (world_size,))
    dtype = torch.bfloat16 if rank == 0 else torch.float16
    cases: dict[str, Callable[[], Any]] = {
        "mp policy": lambda: minddp.fully_shard(
            TinyLM(), mesh=mesh, mp_policy=minddp.MixedPrecisionPolicy(param_dtype=dtype)
        ),
        "reshard": lambda: minddp.fully_shard(TinyLM(), mesh=mesh, reshard_after_forward=rank == 0),
        "shapes": lambda: minddp.fully_shard(TinyLM(hidden=HIDDEN + rank), mesh=mesh),
        "tied across units": lambda: tie_across_units(mesh),
        "scalar": lambda: minddp.fully_shard(
            nn.ParameterDict({"s": nn.Parameter(torch.tensor(1.0))}), mesh=mesh
        ),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
        dist.barrier()
    return messages


def tie_across_units(mesh: Any) -> None:
    model = TinyLM()
    model.blocks[1].up.weight = model.blocks[0].up.weight
    shard_with(minddp, model, mesh)


def compiled(rank: int, world_size: int) -> dict[str, Any]:
    """torch.compile of the sharded model (graph breaks at the unit hooks) trains as the eager one."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    base = TinyLM()
    eager = shard_with(minddp, copy.deepcopy(base), mesh)
    model = shard_with(minddp, copy.deepcopy(base), mesh)
    compiled_model = torch.compile(model, backend="aot_eager")
    for m in (eager, compiled_model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        for batch in batches(world_size, 2):
            optimizer.zero_grad(set_to_none=True)
            loss_of(m, batch.chunk(world_size)[rank]).backward()
            optimizer.step()
    return {"params": difference(eager, model), "moved": difference(model, base)}


def hsdp(rank: int, world_size: int) -> dict[str, Any]:
    """A 2-D mesh (replicas x shards: 2 x 1, 3 x 1, 2 x 2) trains as plain FSDP over the same ranks, and as
    torch's HSDP."""
    flat_mesh = init_device_mesh("cpu", (world_size,))
    replicas = 2 if world_size % 2 == 0 else world_size
    mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    base = TinyLM()
    plain = shard_with(minddp, copy.deepcopy(base), flat_mesh)
    ours, theirs = (shard_with(lib, copy.deepcopy(base), mesh) for lib in (minddp, torch_fsdp))
    for model in (plain, ours, theirs):
        train(model, rank, world_size)
    return {
        "vs plain": difference(ours, plain),
        "vs torch hsdp": difference(ours, theirs),
        "placements": str(ours.blocks[0].up.weight.placements),
    }


def all_checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Every check in one spawn; a check that raises is reported by its own test (the others still run)."""
    checks: dict[str, Callable[[], Any]] = {
        "against_fsdp2": lambda: against_fsdp2(rank, world_size),
        "torch_policy_objects": lambda: torch_policy_objects(rank, world_size),
        "explicit_prefetch": lambda: explicit_prefetch(rank, world_size),
        "unshard_and_reshard": lambda: unshard_and_reshard(rank, world_size),
        "meta_init": lambda: meta_init_and_broadcast_load(rank, world_size),
        "failed_backward": lambda: failed_backward_leaves_nothing(rank, world_size),
        "state_dict": lambda: state_dict_and_dcp(rank, world_size, folder),
        "memory": lambda: memory_per_rank(rank, world_size),
        "refused": lambda: refused_on_every_rank(rank, world_size),
        "hsdp": lambda: hsdp(rank, world_size),
    }
    results = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception:  # reported by the check's test; a collective left half-done would time out instead
            results[name] = {"error": traceback.format_exc()}
    return results


WORLD_SIZES = [2, 3, 4]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def outcome(request: pytest.FixtureRequest, ranks: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world_size = request.param
    folder = str(tmp_path_factory.mktemp(f"fully_shard{world_size}"))
    # run_on_ranks' hang guard is under pytest-timeout's (pyproject.toml), so a hang reports which ranks hung.
    return world_size, ranks(all_checks, world_size, folder)


def results_of(outcome: Any, check: str) -> tuple[int, list[Any]]:
    world_size, per_rank = outcome
    for result in per_rank:
        assert "error" not in result[check], result[check]["error"]
    return world_size, [result[check] for result in per_rank]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_trains_as_torch_fsdp2(outcome: Any, config: str) -> None:
    world_size, reports = results_of(outcome, "against_fsdp2")
    tolerance = 0.0 if world_size == 2 else 1e-6
    if "bf16" in config:
        tolerance = 1e-2 if "reduce-bf16" in config else tolerance
    for report in reports:
        result = report[config]
        assert result["moved"] > 1e-2 and result["all DTensors"], result
        assert result["params"] <= tolerance and result["norms"] <= max(tolerance, 1e-6), result
        assert result["frozen"] == 0.0, result  # sharded, never updated
        if config == "fp32":
            assert result["one process"] < 1e-5, result


def test_torch_policy_objects_are_accepted(outcome: Any) -> None:
    for result in results_of(outcome, "torch_policy_objects")[1]:
        assert result["params"] == 0.0, result


def test_explicit_prefetch_two_blocks_ahead(outcome: Any) -> None:
    _, results = results_of(outcome, "explicit_prefetch")
    for result in results:
        assert result["params"] <= 1e-6, result
        assert result["gathered ahead"] == [[True, True], [True, True], [True], []], result


def test_unshard_reshard_and_their_settings(outcome: Any) -> None:
    for result in results_of(outcome, "unshard_and_reshard")[1]:
        assert result == {
            "unsharded": ("Tensor", (HIDDEN, D)),
            "resharded": "DTensor",
            "async": "Tensor",
            "class": "FSDPTinyLM",
            "is FSDPModule": True,
            "kept after backward": [True] * LAYERS,
            "freed after backward": [False] * LAYERS,
            "output dtype": "torch.float32",
        }


def test_meta_init_then_broadcast_load_trains_as_fsdp2(outcome: Any) -> None:
    world_size, results = results_of(outcome, "meta_init")
    for result in results:
        assert result["on meta"] and result["initialised"], result
        assert result["loaded"] == 0.0, result
        assert result["trained"] <= (0.0 if world_size == 2 else 1e-6), result


def test_a_failed_backward_leaves_nothing_pending(outcome: Any) -> None:
    for result in results_of(outcome, "failed_backward")[1]:
        assert result == {"raised": True, "difference": 0.0}


def test_state_dict_and_dcp_round_trip(outcome: Any) -> None:
    world_size, results = results_of(outcome, "state_dict")
    for result in results:
        assert result["same keys"], result
        assert result["full vs fsdp2"] <= (0.0 if world_size == 2 else 1e-6), result
        assert result["dcp params"] == 0.0 and result["dcp exp_avg"] == 0.0, result


def test_memory_is_one_nth_and_a_model_over_budget_trains(outcome: Any) -> None:
    world_size, results = results_of(outcome, "memory")
    for result in results:
        report, full = result["report"], result["full"]
        assert result["peak"] <= result["budget"] < full, result  # never the whole model at once
        assert report["parameters"] + report["padding"] == result["padded"] / world_size, result
        assert report["gradients"] == report["parameters"] - _frozen_bytes(result), result
        assert report["optimizer_state"] == 2 * report["gradients"], result  # AdamW: exp_avg, exp_avg_sq
        assert result["vector local rows"] <= -(-result["vector rows"] // world_size), result
        assert report["gathered"] == 0, result  # everything resharded after the step


def _frozen_bytes(result: dict[str, Any]) -> int:
    return result["report"]["parameters"] - result["report"]["gradients"]


def test_bad_configs_are_refused_on_every_rank(outcome: Any) -> None:
    _, results = results_of(outcome, "refused")
    for messages in results:
        assert "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16" in messages["mp policy"], messages
        assert "reshard_after_forward=True" in messages["reshard"], messages
        assert "parameter blocks.0.up.weight (10, 6)" in messages["shapes"], messages
        assert "parameter 'up.weight' is shared with 'Block.up.weight'" in messages["tied across units"]
        assert "parameter 's' is a scalar" in messages["scalar"], messages


def test_torch_compile_of_the_sharded_model(ranks: Any) -> None:
    """At 2 ranks only (its own spawn): compiling is the slow part; the world size changes nothing in it."""
    # A hang guard under pytest-timeout's: compiling on two ranks takes minutes on a busy 2-core machine.
    for result in ranks(compiled, 2, timeout=1500):
        assert result["moved"] > 1e-2 and result["params"] == 0.0, result


def test_hsdp_equals_plain_fsdp_over_the_same_ranks(outcome: Any) -> None:
    for result in results_of(outcome, "hsdp")[1]:
        assert result["vs plain"] <= 1e-6 and result["vs torch hsdp"] <= 1e-6, result
        assert result["placements"] == "(Replicate(), Shard(dim=0))", result
