"""ShardedOptimizer in one process: the shard assignment, argument errors, and a one-rank group."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardopt import ShardedOptimizer, balanced_owners


def test_balanced_owners_assigns_every_item_once_within_the_greedy_bound():
    generator = torch.Generator().manual_seed(0)
    for world_size in (1, 2, 3, 8):
        sizes = torch.randint(1, 1000, (57,), generator=generator).tolist()
        owners = balanced_owners(sizes, world_size)
        assert len(owners) == len(sizes) and set(owners) == set(range(world_size))
        loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(world_size)]
        assert max(loads) <= sum(sizes) / world_size + max(sizes)
        assert owners == balanced_owners(list(sizes), world_size)


def test_balanced_owners_puts_the_largest_first_onto_the_least_loaded_rank():
    assert balanced_owners([5, 10, 3, 4], 2) == [1, 0, 1, 1]
    assert balanced_owners([4, 4, 4, 4], 2) == [0, 1, 0, 1]  # ties: lower index, lower rank
    assert balanced_owners([7], 3) == [0]
    with pytest.raises(ValueError, match="world_size"):
        balanced_owners([1], 0)


def linear_params():
    return list(nn.Linear(4, 3).parameters())


class LineSearchSGD(torch.optim.SGD):
    """A stand-in for an optimizer whose step() must re-evaluate the loss."""

    def step(self, closure):  # noqa: D102
        return super().step(closure)


@pytest.mark.parametrize("optimizer_cls", [torch.optim.LBFGS, LineSearchSGD])
def test_optimizers_that_need_more_than_per_parameter_state_are_refused(optimizer_cls):
    with pytest.raises(ValueError, match=f"^optimizer_cls: {optimizer_cls.__name__} needs more than "
                                         "per-parameter state"):
        ShardedOptimizer(linear_params(), optimizer_cls, lr=0.1)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam",
                                  "RAdam", "Rprop", "ASGD", "Adafactor", "Muon"])
def test_per_parameter_optimizers_pass_the_check(name, one_rank_group):
    if not hasattr(torch.optim, name):
        pytest.skip(f"torch {torch.__version__} has no torch.optim.{name}")
    ShardedOptimizer([nn.Parameter(torch.zeros(3, 2))], getattr(torch.optim, name), lr=0.1)


@pytest.mark.parametrize(("params", "optimizer_cls", "error", "argument"), [
    (linear_params, nn.Linear, TypeError, "optimizer_cls"),
    (linear_params, "adamw", TypeError, "optimizer_cls"),
    (linear_params, lambda: torch.optim.SGD(linear_params(), lr=0.1), TypeError, "optimizer_cls"),
    (linear_params, ShardedOptimizer, TypeError, "optimizer_cls"),
    (lambda: [], torch.optim.AdamW, ValueError, "params"),
    (lambda: [{"params": []}, {"params": []}], torch.optim.AdamW, ValueError, "params"),
    (lambda: [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))], torch.optim.AdamW,
     ValueError, "params"),
    (lambda: nn.Parameter(torch.zeros(2)), torch.optim.AdamW, TypeError, "params"),
    (lambda: [p := nn.Parameter(torch.zeros(2)), p], torch.optim.AdamW, ValueError, "params"),
    (linear_params, torch.optim.AdamW, RuntimeError, "process_group"),  # torch.distributed not initialized
])
def test_bad_input_gets_an_error_naming_the_argument(params, optimizer_cls, error, argument):
    assert not dist.is_initialized()
    if callable(optimizer_cls) and not isinstance(optimizer_cls, type):
        optimizer_cls = optimizer_cls()
    with pytest.raises(error, match=f"^{argument}:"):
        ShardedOptimizer(params(), optimizer_cls, lr=0.1)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_with_named_parameters_matches_and_saves_like_torch(one_rank_group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 2))
    reference = copy.deepcopy(model)
    optimizer = ShardedOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.named_parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, optimizer), (reference, reference_optimizer)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    full, expected = optimizer.consolidate_state_dict(), reference_optimizer.state_dict()
    assert full["param_groups"] == expected["param_groups"]
    assert full["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(torch.equal(full["state"][i][k], v) for i, state in expected["state"].items()
               for k, v in state.items())
    # A state dict from plain torch.optim loads too.
    optimizer.load_state_dict(copy.deepcopy(expected))
    loaded, saved = optimizer.state[model[0].weight], reference_optimizer.state[reference[0].weight]
    assert torch.equal(loaded["exp_avg"], saved["exp_avg"])
    with pytest.raises(ValueError, match="^state_dict:"):
        optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})


def trained_state(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> dict:
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    model(torch.randn(4, model[0].in_features)).square().mean().backward()
    optimizer.step()
    return optimizer.state_dict()


@pytest.mark.parametrize(("foreign", "message"), [
    # Another model with as many parameters: torch's AdamW loads it, then fails at the first step.
    (lambda: trained_state(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)), torch.optim.AdamW, lr=0.1),
     r"^state_dict: state\[0\]\['exp_avg'\] has shape \(3, 5\) where AdamW keeps \(7, 5\) for parameter 0 "
     r"of shape \(7, 5\): is it another model's"),
    # Another optimizer's state for the same model (torch's AdamW: KeyError: 'step' at load).
    (lambda: trained_state(nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2)), torch.optim.SGD, lr=0.1,
                           momentum=0.9),
     r"^state_dict: the state of parameter 0 holds \['momentum_buffer'\] where AdamW keeps \['exp_avg', "
     r"'exp_avg_sq', 'step'\]: is it another optimizer's"),
])
def test_a_state_dict_that_does_not_fit_is_refused_at_load_not_at_step(one_rank_group, foreign, message):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    plain = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=0.1)
    for p in plain.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises((RuntimeError, KeyError)):  # torch: a shape error at the first step, or KeyError
        plain.load_state_dict(foreign())
        plain.step()
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(foreign())
    model(torch.randn(4, 5)).square().mean().backward()
    optimizer.step()  # the optimizer is as it was


@pytest.mark.parametrize(("optimizer_cls", "kwargs"), [
    (torch.optim.AdamW, {"amsgrad": True}), (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
    (torch.optim.Adagrad, {}), (torch.optim.SGD, {"momentum": 0.9}),
    *([(torch.optim.Adafactor, {})] if hasattr(torch.optim, "Adafactor") else []),  # factored: (7, 1), (1, 5)
])
def test_a_state_dict_of_the_same_model_and_optimizer_loads(one_rank_group, optimizer_cls, kwargs):
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    saved = trained_state(copy.deepcopy(model), optimizer_cls, lr=0.01, **kwargs)
    optimizer = ShardedOptimizer(model.parameters(), optimizer_cls, lr=0.5)  # hyperparameters come with it
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert all(torch.equal(optimizer.state[p][k], v) for p, (_, state) in zip(model.parameters(),
               sorted(saved["state"].items()), strict=True) for k, v in state.items()
               if isinstance(v, torch.Tensor))
