"""Build, test and release sessions for every package of this repository.

    ./nox -l                      list the sessions
    ./nox -s tests                every package's tests plus the cross-package tests (CI)
    ./nox -s test-minddp          one package's tests, in a venv holding torch and that package alone
    ./nox -s test-oldest-torch    each library's tests on its oldest declared torch (not in CI)
    ./nox -s tour                 a short run of every experiment this machine supports
    ./nox -s build [-- minddp]    wheels and sdists into dist/, each installed in a clean venv and
                                  its README's first example run
    ./nox -s release -- minddp    check, build and tag minddp-vX.Y.Z (uploads nothing)

Torch: the test sessions make clean venvs (no system site-packages), so an undeclared import
fails there as it would for a user; they install ``$TORCH_SPEC`` (default ``torch==2.13.0``,
which pip takes from a local wheel where one is on its find-links, in seconds). The tour's venv
sees the interpreter's own site-packages, so a torch you already have (a CUDA build, say) is
used as it is; only where none is importable is ``$TORCH_SPEC`` installed there.
"""

from __future__ import annotations

import os
import re
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
SYSTEM_SITE = ["--system-site-packages"]  # the tour only: it uses the torch you have


def resolve(name: str) -> str:
    dist = ALIASES.get(name, name)
    if dist not in PACKAGES:
        known = ", ".join(sorted([*PACKAGES, *ALIASES]))
        raise SystemExit(f"unknown package {name!r}; choose from: {known}")
    return dist


def install_torch(session: nox.Session, spec: str = TORCH_SPEC) -> None:
    """Install ``spec`` into a clean venv (a no-op when a reused venv has it already)."""
    session.install(spec)


def install_torch_unless_present(session: nox.Session) -> None:
    """Install $TORCH_SPEC unless this venv can already import torch (the user's build, say)."""
    has_torch = session.run(
        "python", "-c", "import importlib.util; print(importlib.util.find_spec('torch') is not None)",
        silent=True,
    )
    if has_torch is not None and has_torch.strip() == "True":
        session.log("torch already importable here: leaving it as it is")
        return
    session.install(TORCH_SPEC)


def torch_floor(dist: str) -> str | None:
    """The version in a package's declared ``"torch>=X"`` requirement, or None."""
    match = re.search(r'"torch\s*>=\s*([0-9.]+)"', (ROOT / PACKAGES[dist][0] / "pyproject.toml").read_text())
    return match.group(1) if match else None


def install_local(session: nox.Session, dists: list[str], editable: bool = False, extras: str = "[test]",
                  silent: bool | None = None) -> None:
    """Install local packages (with ``extras``) in one pip call, so names resolve to the repo;
    ``silent=False`` shows pip's lines as it goes (what it downloads, builds and installs)."""
    args = []
    for dist in dists:
        path = f"./{PACKAGES[dist][0]}{extras}"
        args += ["-e", path] if editable else [path]
    session.install(*args, silent=silent)


def package_test_session(dist: str):
    def run(session: nox.Session) -> None:
        install_torch(session)
        needed = LIBRARIES + [dist] if dist == "cs336-systems-benchmarks" else [dist]
        install_local(session, needed)  # not editable: the tests import the installed package
        session.run(*PYTEST, f"{PACKAGES[dist][0]}/tests", *session.posargs)

    run.__doc__ = f"{dist}'s own tests in a clean venv holding torch and it (with its test extra) alone."
    return run


for _name, _dist in [("flash", "flashattn-triton"), ("minddp", "minddp"), ("shardopt", "shardopt"),
                     ("profkit", "profkit"), ("benchmarks", "cs336-systems-benchmarks")]:
    nox.session(name=f"test-{_name}")(package_test_session(_dist))


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's tests and the cross-package tests in tests/, in one pytest run (a clean venv)."""
    session.log(f"set-up 1/2: {TORCH_SPEC} into .nox/tests (a no-op once there)")
    install_torch(session)
    session.log("set-up 2/2: the five packages of this repository, editable, with their test extras "
                "(pytest, Triton for the interpreter tests) and packaging for tests/")
    install_local(session, list(PACKAGES), editable=True)
    session.install("packaging>=23")  # tools/release_checks.py, tested in tests/
    test_dirs = [f"{directory}/tests" for directory, _ in PACKAGES.values()] + ["tests"]
    session.run(*PYTEST, "-c", "pytest.ini", *test_dirs, *session.posargs)


@nox.session(name="test-oldest-torch")
def test_oldest_torch(session: nox.Session) -> None:
    """Each library's tests on the oldest torch it declares (``torch>=X``): a floor is a version tested.

    ``-- minddp shardopt`` picks libraries (default: all four). For each floor, lowest first, it
    installs ``torch==X`` (or ``$OLDEST_TORCH_SPEC``, to pick a build this machine can install)
    and runs the tests of the libraries with that floor. Not part of CI: an older torch is a large
    download, where the default one is a local wheel.
    """
    dists = [resolve(name) for name in session.posargs] or LIBRARIES
    by_floor: dict[str, list[str]] = {}
    for dist in dists:
        floor = torch_floor(dist)
        if floor is None:
            session.error(f"{dist} declares no torch>=X floor")
        by_floor.setdefault(floor, []).append(dist)
    for floor in sorted(by_floor, key=lambda v: tuple(map(int, v.split(".")))):
        spec = os.environ.get("OLDEST_TORCH_SPEC", f"torch=={floor}")
        session.log(f"{', '.join(by_floor[floor])}: declared torch>={floor}; installing {spec}")
        install_torch(session, spec)
        install_local(session, by_floor[floor])
        session.run("python", "-c", "import torch; print('testing on torch', torch.__version__)")
        for dist in by_floor[floor]:
            session.run(*PYTEST, f"{PACKAGES[dist][0]}/tests")


@nox.session(venv_params=SYSTEM_SITE)
def tour(session: nox.Session) -> None:
    """The main job: a short run of every experiment this machine supports, printing each table."""
    session.log("set-up 1/2: torch: the one this interpreter already has (a CUDA build, say), else "
                f"{TORCH_SPEC}")
    install_torch_unless_present(session)
    session.log("set-up 2/2: the five packages of this repository, editable, and what they import (rich, "
                "pandas, matplotlib, tabulate); a first run downloads those, later runs reuse .nox/tour. "
                "No test extras: a CPU machine gets no Triton, a CUDA build of torch brings its own")
    install_local(session, list(PACKAGES), editable=True, extras="", silent=False)
    session.log("running the tour: its results go to out/tour (not tracked by git)")
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


def readme_example(directory: str) -> str:
    """The first ```python block of a package's README: what a user tries first."""
    text = (ROOT / directory / "README.md").read_text()
    match = re.search(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise ValueError(f"{directory}/README.md has no ```python example")
    return match.group(1)


def check_wheel_in_clean_venv(session: nox.Session, wheel: Path, dist: str) -> None:
    """A fresh venv with only torch, then the wheel (its siblings found in dist/); import it and run
    its README's first example there, from an empty folder, under torchrun when the example says so."""
    directory, import_name = PACKAGES[dist]
    with tempfile.TemporaryDirectory(prefix=f"clean-{import_name}-") as tmp:
        python = str(Path(tmp) / "venv" / "bin" / "python")
        session.run(sys.executable, "-m", "venv", str(Path(tmp) / "venv"), external=True)
        session.run(python, "-m", "pip", "install", "-q", TORCH_SPEC, external=True)
        session.run(python, "-m", "pip", "install", "-q", "--find-links", str(DIST), str(wheel),
                    external=True)
        session.run(python, "-c", f"import {import_name}; print({import_name}.__name__, "
                    f"{import_name}.__version__, 'imports from', {import_name}.__file__)", external=True)
        example = readme_example(directory)
        script = Path(tmp) / "work" / "example.py"
        script.parent.mkdir()
        script.write_text(example)
        torchrun = re.match(r"#.*torchrun (--nproc-per-node[ =](\d+))", example)
        command = ([python, "-m", "torch.distributed.run", "--nproc-per-node", torchrun.group(2), str(script)]
                   if torchrun else [python, str(script)])
        with session.chdir(script.parent):
            session.run(*command, external=True)


@nox.session
def build(session: nox.Session) -> None:
    """Wheel + sdist of every package (or those named after --) into dist/, each tried in a clean venv."""
    requested = [resolve(name) for name in session.posargs] or list(PACKAGES)
    session.install("hatch>=1.12")
    # The app's wheel needs its sibling wheels in dist/ to install.
    app = "cs336-systems-benchmarks"
    built = list(dict.fromkeys(LIBRARIES + requested)) if app in requested else requested
    wheels = dict(zip(built, build_dists(session, built), strict=True))
    for dist in requested:
        check_wheel_in_clean_venv(session, wheels[dist], dist)
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
