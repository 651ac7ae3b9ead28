"""ShardedOptimizer on 2 and 3 gloo processes: one torchrun launch per world size runs all its checks."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("shardopt_distributed_checks",
                                               Path(__file__).with_name("distributed_checks.py"))
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    launched: dict[int, dict[str, str]] = {}

    def of(world_size: int) -> dict[str, str]:
        if world_size not in launched:
            launched[world_size] = checks.launch(world_size, tmp_path_factory.mktemp(f"world{world_size}"))
        return launched[world_size]

    return of


@pytest.mark.parametrize(("world_size", "check"),
                         [(n, name) for n in (2, 3) for name, (_, ns) in checks.CHECKS.items() if n in ns])
def test_distributed(world_size, check, outcomes):
    if checks.UNAVAILABLE.get(check):
        pytest.skip(checks.UNAVAILABLE[check])
    outcome = outcomes(world_size)[check]
    assert outcome == "ok", outcome
