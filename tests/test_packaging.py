"""Each distribution is installed from this repo, versioned in one place, and independent of the others."""

import ast
import importlib
import importlib.metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTS = {
    "flashattn-triton": ("packages/flashattn-triton", "flashattn_triton"),
    "minddp": ("packages/minddp", "minddp"),
    "shardopt": ("packages/shardopt", "shardopt"),
    "profkit": ("packages/profkit", "profkit"),
    "cs336-systems-benchmarks": ("apps/benchmarks", "benchmarks"),
}
LIBRARY_IMPORTS = {name for dist, (_, name) in DISTS.items() if dist != "cs336-systems-benchmarks"}


@pytest.mark.parametrize("dist", DISTS)
def test_installed_version_is_the_single_sourced_one(dist):
    directory, import_name = DISTS[dist]
    module = importlib.import_module(import_name)
    assert importlib.metadata.version(dist) == module.__version__
    assert (ROOT / directory / "src" / import_name / "py.typed").exists()


@pytest.mark.parametrize("dist", [d for d in DISTS if d != "cs336-systems-benchmarks"])
def test_library_imports_no_other_package_of_this_repo(dist):
    directory, import_name = DISTS[dist]
    others = LIBRARY_IMPORTS - {import_name} | {"benchmarks"}
    for source in (ROOT / directory / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in others, f"{source} imports {name}"


def test_app_depends_on_every_library_by_name():
    requires = importlib.metadata.requires("cs336-systems-benchmarks") or []
    names = {r.split(">")[0].split("=")[0].split(";")[0].strip() for r in requires}
    assert {"flashattn-triton", "minddp", "shardopt", "profkit"} <= names
