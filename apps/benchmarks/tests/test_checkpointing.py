"""Checkpointing policies of the reference model, the activation-memory model, the context search."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from benchmarks import checkpointing
from benchmarks.model import CHECKPOINT_POLICIES, TransformerLM, checkpoint_segments, model_config


def gradients(policy: str, tokens: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = TransformerLM(replace(model_config("tiny", 16), num_layers=3), checkpoint=policy)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("policy", CHECKPOINT_POLICIES[1:])
def test_every_policy_computes_the_gradients_of_no_checkpointing(policy: str) -> None:
    tokens = torch.randint(0, 10_000, (2, 17), generator=torch.Generator().manual_seed(1))
    for ours, reference in zip(gradients(policy, tokens), gradients("none", tokens), strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_segments() -> None:
    assert checkpoint_segments("sqrt", 10) == [(0, 4, True), (4, 8, True), (8, 10, True)]
    assert [r for _, _, r in checkpoint_segments("every-k", 5, every=2)] == [True, False, True, False, True]
    assert all(r for _, _, r in checkpoint_segments("blocks", 3))
    assert not any(r for _, _, r in checkpoint_segments("attention", 3))
    with pytest.raises(ValueError, match="checkpoint='all' is not one of"):
        checkpoint_segments("all", 3)


@pytest.mark.parametrize("context", [16, 48])
def test_activation_model_counts_what_autograd_saves(context: int) -> None:
    """Bytes of the distinct storages saved for the backward (no checkpointing) against the prediction."""
    cfg = model_config("tiny", context)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and t.is_floating_point() and t.dim() > 0:  # not the loss
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.vocab_size, (2, context + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    masks = cfg.num_layers * context * context  # bool, not counted above
    predicted = checkpointing.predicted_activation_bytes(cfg, "none", 2, 2, context) - masks
    assert sum(saved.values()) == predicted


def test_policies_are_predicted_to_hold_less() -> None:
    cfg = model_config("small", 2048)
    held = {p: checkpointing.predicted_activation_bytes(cfg, p, 2, 4, 2048) for p in CHECKPOINT_POLICIES}
    assert held["sqrt"] < held["blocks"] < held["attention"] < held["every-k"] < held["none"]


@pytest.mark.parametrize("threshold", [0, 300, 1000, 4096, 5000])
def test_largest_context_search(threshold: int) -> None:
    tried = []

    def fits(context: int) -> bool:
        tried.append(context)
        return context <= threshold

    found = checkpointing.largest_context(fits, start=256, limit=4096, granularity=64)
    assert found <= max(threshold, 0) and (found == 0 or fits(found))
    assert found == 0 if threshold < 256 else threshold - found < 64 or found == 4096
    assert len(tried) < 15


def test_cpu_run_prints_a_row_per_policy_and_context(tmp_path) -> None:
    checkpointing.main(["--results-dir", str(tmp_path), "--contexts", "8", "--policies", "none,sqrt",
                        "--warmup", "0", "--iters", "1"])
    table = (tmp_path / "cpu" / "checkpointing.csv").read_text()
    assert "none,8," in table and "sqrt,8," in table
