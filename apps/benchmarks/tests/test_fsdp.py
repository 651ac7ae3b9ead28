import pytest

from benchmarks.common import read_results
from benchmarks.fsdp import main


def test_two_cpu_ranks_hold_what_the_memory_model_says(tmp_path):
    main(["--results-dir", str(tmp_path), "--warmup", "0", "--iters", "1", "--trace-steps", "1",
          "--compute", "fp32,bf16", "--timeout", "900"])  # a hang guard for its workers: they take a minute
    table, meta = read_results(tmp_path / "cpu" / "fsdp.csv")
    assert meta["world_size"] == "2" and meta["model"] == "tiny"
    assert "peak_MB" not in table.columns  # no allocator peak on CPU, so no made-up column
    assert len(table) == 8
    by = table.set_index(["strategy", "compute"])
    for strategy in ("torch-ddp", "minddp-bucketed", "torch-fsdp2", "minddp-fsdp"):
        for compute in ("fp32", "bf16"):
            row = by.loc[(strategy, compute)]
            # Measured tensor sizes against the model: padding is the only slack.
            assert row["params_MB"] == pytest.approx(row["model_params_MB"], rel=1e-3)
            assert row["grads_MB"] == pytest.approx(row["model_grads_MB"], rel=1e-3)
            assert row["optimizer_MB"] == pytest.approx(row["model_optimizer_MB"], rel=1e-3)
            assert row["iteration_ms"] > 0
            # from the traces: every strategy communicates; the exposed part is within it
            assert row["comm_ms"] > 0 and 0 <= row["exposed_comm_ms"] <= row["comm_ms"]
            assert 0 <= row["overlap_pct"] <= 100
    ddp = by.loc[("torch-ddp", "fp32"), "params_MB"]
    assert by.loc[("minddp-fsdp", "fp32"), "params_MB"] == pytest.approx(ddp / 2, rel=0.01)


def built_sharded(strategy: str) -> dict[str, object]:
    """On each rank: the device the sharded workload's model was built on, and its full weights after init
    (as numpy arrays: torch tensors would cross to the launcher through shared memory that dies with the
    rank)."""
    import argparse

    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from benchmarks import fsdp
    from benchmarks.model import model_config

    built_on = []
    original = fsdp.TransformerLM.__init__

    def recording_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built_on.append(next(self.parameters()).device.type)

    fsdp.TransformerLM.__init__ = recording_init
    try:
        args = argparse.Namespace(seed=0, attention="naive", lr=1e-4)
        work = fsdp.Workload(strategy, "fp32", model_config("tiny", 16), args, torch.device("cpu"), 0)
    finally:
        fsdp.TransformerLM.__init__ = original
    full = get_model_state_dict(work.wrapped, options=StateDictOptions(full_state_dict=True))
    rope = work.wrapped.blocks[0].attn.rope
    return {"built_on": built_on, "weights": {name: t.numpy() for name, t in full.items()},
            "cos": rope.cos.numpy(), "sin": rope.sin.numpy()}


@pytest.mark.parametrize("strategy", ["torch-fsdp2", "minddp-fsdp"])
def test_sharded_strategies_build_on_meta_and_initialise_every_weight(strategy):
    import torch

    from benchmarks.model import TransformerLM, model_config
    from minddp.launch import spawn

    # a hang guard for the two gloo ranks, not a time limit: they take seconds
    per_rank = spawn(built_sharded, 2, (strategy,), start_method="fork", timeout_s=900)
    reference = TransformerLM(model_config("tiny", 16))
    for got in per_rank:
        assert got["built_on"] == ["meta"]  # no rank ever held the whole model
        weights = got["weights"]
        assert set(weights) == set(reference.state_dict())
        for name, array in weights.items():
            tensor = torch.from_numpy(array)
            if name.endswith("norm.weight"):
                assert bool((tensor == 1).all()), name
            else:  # trunc_normal(0.02) within +-0.06, as at construction; never to_empty's leftovers
                assert bool(tensor.abs().max() <= 0.06) and tensor.std() == pytest.approx(0.02, rel=0.2), name
        rope = reference.blocks[0].attn.rope
        assert torch.equal(torch.from_numpy(got["cos"]), rope.cos)
        assert torch.equal(torch.from_numpy(got["sin"]), rope.sin)
