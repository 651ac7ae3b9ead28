"""Each distribution is installed from this repo, versioned in one place, and independent of the others."""

import ast
import importlib
import importlib.metadata
import re
import sys
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


def imported_top_levels(folder: Path) -> set[str]:
    """Top-level names of the absolute imports in folder's .py files, except optional ones.

    An import inside ``try: ... except ImportError`` (or ModuleNotFoundError) is optional: the
    code works without it, so it needs no declaration.
    """
    names: set[str] = set()
    for source in folder.rglob("*.py"):
        tree = ast.parse(source.read_text())
        optional = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                    for h in node.handlers):
                optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


ANY_EXTRA = "*"


def declared_requirements(dist: str, extra: str | None = None) -> set[str]:
    """Distribution names a package requires, with those of one extra if named (of every extra for
    ``ANY_EXTRA``)."""
    found = set()
    for requirement in importlib.metadata.requires(dist) or []:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
        markers = requirement.partition(";")[2]
        needed_extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", markers)
        if needed_extra is None or extra in (needed_extra.group(1), ANY_EXTRA):
            found.add(normalized(name))
    return found


def undeclared(dist: str, folder: Path, extra: str | None) -> list[str]:
    own = {DISTS[dist][1]} | {p.stem for p in folder.rglob("*.py")}  # the package and local test modules
    providers = importlib.metadata.packages_distributions()
    declared = declared_requirements(dist, extra)
    missing = []
    for name in sorted(imported_top_levels(folder) - own - set(sys.stdlib_module_names)):
        dists = {normalized(d) for d in providers.get(name, [name])}
        if not dists & declared:
            missing.append(f"{name} (from {', '.join(sorted(dists))})")
    return missing


@pytest.mark.parametrize("dist", DISTS)
def test_every_import_of_the_code_is_declared(dist):
    """In the requirements, or in an extra for an import the code makes only when it is installed
    (flashattn-triton's Triton, which CUDA builds of torch bring: `nox -s build` runs each README example
    with no extra installed)."""
    directory, import_name = DISTS[dist]
    assert undeclared(dist, ROOT / directory / "src" / import_name, extra=ANY_EXTRA) == []


@pytest.mark.parametrize("dist", DISTS)
def test_every_import_of_the_tests_is_declared_in_the_test_extra(dist):
    directory, _ = DISTS[dist]
    assert undeclared(dist, ROOT / directory / "tests", extra="test") == []
