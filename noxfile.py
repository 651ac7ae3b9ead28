"""Build, test and release sessions for every package of this repository.

    ./nox -l                      list the sessions
    ./nox -s tests                every package's tests plus the cross-package tests
    ./nox -s test-minddp          one package's tests, in a venv holding that package alone
    ./nox -s tour                 a short run of every experiment this machine supports
    ./nox -s build [-- minddp]    wheels and sdists into dist/, each checked in a clean venv
    ./nox -s release -- minddp    check, build and tag minddp-vX.Y.Z (uploads nothing)

Torch: each venv sees the interpreter's own site-packages, so a torch you already have (a CUDA
build, say) is used as it is. Only where none is importable is ``$TORCH_SPEC`` installed
(default ``torch==2.13.0``, which pip takes from a local wheel where one is on its find-links).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))
from tools.release_checks import last_tagged_version, read_version, release_problems  # noqa: E402

ROOT = Path(__file__).parent
DIST = ROOT / "dist"
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")

# dist name -> (directory, import name)
PACKAGES = {
    "flashattn-triton": ("packages/flashattn-triton", "flashattn_triton"),
    "minddp": ("packages/minddp", "minddp"),
    "shardopt": ("packages/shardopt", "shardopt"),
    "profkit": ("packages/profkit", "profkit"),
    "cs336-systems-benchmarks": ("apps/benchmarks", "benchmarks"),
}
ALIASES = {"flash": "flashattn-triton", "benchmarks": "cs336-systems-benchmarks"}
LIBRARIES = [name for name in PACKAGES if name != "cs336-systems-benchmarks"]
PYTEST = ["python", "-m", "pytest", "-p", "no:cacheprovider", "-ra"]

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "tests"]
VENV = ["--system-site-packages"]


def resolve(name: str) -> str:
    dist = ALIASES.get(name, name)
    if dist not in PACKAGES:
        known = ", ".join(sorted([*PACKAGES, *ALIASES]))
        raise SystemExit(f"unknown package {name!r}; choose from: {known}")
    return dist


def install_torch(session: nox.Session) -> None:
    """Install $TORCH_SPEC unless this venv can already import torch (reused venv or user's build)."""
    has_torch = session.run(
        "python", "-c", "import importlib.util; print(importlib.util.find_spec('torch') is not None)",
        silent=True,
    )
    if has_torch is not None and has_torch.strip() == "True":
        session.log("torch already importable here: leaving it as it is")
        return
    session.install(TORCH_SPEC)


def install_local(session: nox.Session, dists: list[str], editable: bool = False) -> None:
    """Install local packages (with their test extras) in one pip call, so names resolve to the repo."""
    args = []
    for dist in dists:
        path = f"./{PACKAGES[dist][0]}[test]"
        args += ["-e", path] if editable else [path]
    session.install(*args)


def package_test_session(dist: str):
    def run(session: nox.Session) -> None:
        install_torch(session)
        needed = LIBRARIES + [dist] if dist == "cs336-systems-benchmarks" else [dist]
        install_local(session, needed)
        session.run(*PYTEST, f"{PACKAGES[dist][0]}/tests", *session.posargs)

    run.__doc__ = f"Run {dist}'s own tests in a venv that holds it (and torch) alone."
    return run


for _name, _dist in [("flash", "flashattn-triton"), ("minddp", "minddp"), ("shardopt", "shardopt"),
                     ("profkit", "profkit"), ("benchmarks", "cs336-systems-benchmarks")]:
    nox.session(name=f"test-{_name}", venv_params=VENV)(package_test_session(_dist))


@nox.session(venv_params=VENV)
def tests(session: nox.Session) -> None:
    """Every package's tests and the cross-package tests in tests/, in one pytest run."""
    install_torch(session)
    install_local(session, list(PACKAGES), editable=True)
    test_dirs = [f"{directory}/tests" for directory, _ in PACKAGES.values()] + ["tests"]
    session.run(*PYTEST, "-c", "pytest.ini", *test_dirs, *session.posargs)


@nox.session(venv_params=VENV)
def tour(session: nox.Session) -> None:
    """The main job: a short run of every experiment this machine supports, printing each table."""
    install_torch(session)
    install_local(session, list(PACKAGES), editable=True)
    session.run("python", "-m", "benchmarks.tour", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")


def build_dists(session: nox.Session, dists: list[str]) -> list[Path]:
    """hatch-build a wheel and an sdist of each package into dist/; return the wheels."""
    DIST.mkdir(exist_ok=True)
    wheels = []
    for dist in dists:
        directory, import_name = PACKAGES[dist]
        version = read_version(ROOT / directory / "src" / import_name / "__init__.py")
        for old in DIST.glob(f"{dist.replace('-', '_')}-{version}*"):
            old.unlink()
        with session.chdir(ROOT / directory):
            session.run("hatch", "build", "-t", "wheel", "-t", "sdist", str(DIST))
        wheels.append(next(DIST.glob(f"{dist.replace('-', '_')}-{version}-*.whl")))
    return wheels


def check_wheel_in_clean_venv(session: nox.Session, wheel: Path, import_name: str) -> None:
    """A fresh venv with only torch, then the wheel (its siblings found in dist/), then import it."""
    with tempfile.TemporaryDirectory(prefix=f"clean-{import_name}-") as tmp:
        python = Path(tmp) / "bin" / "python"
        session.run(sys.executable, "-m", "venv", tmp, external=True)
        session.run(str(python), "-m", "pip", "install", "-q", TORCH_SPEC, external=True)
        session.run(str(python), "-m", "pip", "install", "-q", "--find-links", str(DIST), str(wheel),
                    external=True)
        session.run(str(python), "-c", f"import {import_name}; print({import_name}.__name__, "
                    f"{import_name}.__version__, 'imports from', {import_name}.__file__)", external=True)


@nox.session
def build(session: nox.Session) -> None:
    """Wheel + sdist of every package (or those named after --) into dist/, each imported in a clean venv."""
    dists = [resolve(name) for name in session.posargs] or list(PACKAGES)
    session.install("hatch>=1.12")
    # The app's wheel needs its sibling wheels in dist/ to install.
    if "cs336-systems-benchmarks" in dists:
        dists = list(dict.fromkeys(LIBRARIES + dists))
    wheels = build_dists(session, dists)
    for dist, wheel in zip(dists, wheels, strict=True):
        check_wheel_in_clean_venv(session, wheel, PACKAGES[dist][1])
    session.log("built: " + ", ".join(sorted(p.name for p in DIST.iterdir())))


@nox.session
def release(session: nox.Session) -> None:
    """release -- <package>: refuse unless the version is new and in the CHANGELOG; build; tag it."""
    if len(session.posargs) != 1:
        session.error("usage: ./nox -s release -- <package>   (one of: " + ", ".join(PACKAGES) + ")")
    dist = resolve(session.posargs[0])
    directory, import_name = PACKAGES[dist]
    version = read_version(ROOT / directory / "src" / import_name / "__init__.py")
    tags = subprocess.run(["git", "tag", "--list"], capture_output=True, text=True, cwd=ROOT, check=True)
    last = last_tagged_version(tags.stdout.split(), dist)
    changelog = (ROOT / directory / "CHANGELOG.md").read_text()
    problems = release_problems(version, last, changelog, dist)
    if problems:
        session.error("refusing to release:\n  - " + "\n  - ".join(problems))
    session.install("hatch>=1.12")
    build_dists(session, [dist])
    tag = f"{dist}-v{version}"
    session.run("git", "tag", "-a", tag, "-m", f"{dist} {version}", external=True)
    session.log(f"tagged {tag}; push it with: git push origin {tag}   (nothing was uploaded)")
    session.log(f"to publish: twine upload dist/{dist.replace('-', '_')}-{version}*")
