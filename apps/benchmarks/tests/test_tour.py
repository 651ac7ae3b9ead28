"""The tour and the README's commands as a user runs them in a checkout: nothing tracked changes."""

import os
import shutil
import subprocess
import sys

import pytest

# A hang guard, not a time limit: these few tiny experiments take well under a minute on a busy machine.
HANG_GUARD_S = 900


def run(command: list[str], cwd, env) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture
def checkout(tmp_path):
    """A git checkout holding a committed report and committed results, out/ ignored as in this repository."""
    if shutil.which("git") is None:
        pytest.fail("git is needed to check that a checkout stays clean")
    repo = tmp_path / "checkout"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "report.md").write_text("# the committed report\n")
    (repo / "results" / "analytic").mkdir(parents=True)
    (repo / "results" / "analytic" / "accounting_memory.csv").write_text("# device: analytic\nsymbol,value\n")
    (repo / ".gitignore").write_text("/out/\n")
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "checkout"], cwd=repo, check=True)
    return repo


def test_the_tour_and_the_readme_commands_leave_a_checkout_clean(checkout):
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "COLUMNS": "80"}
    tour = run([sys.executable, "-m", "benchmarks.tour", "--only", "precision,accounting,report"], checkout,
               env)
    run([sys.executable, "-m", "benchmarks.accounting"], checkout, env)
    run([sys.executable, "-m", "benchmarks.report"], checkout, env)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=checkout, capture_output=True, text=True,
                            check=True).stdout
    assert status == "", f"tracked files changed or untracked files appeared:\n{status}"
    assert (checkout / "out" / "tour" / "report.md").is_file()
    assert (checkout / "out" / "analytic" / "accounting_memory.csv").is_file()
    assert (checkout / "out" / "report.md").is_file()
    assert (checkout / "docs" / "report.md").read_text() == "# the committed report\n"
    # each section heading is followed by its whole command, on a line of its own
    assert "$ python -m benchmarks.report --results-dir out/tour --out out/tour/report.md\n" in tour


def test_a_failed_experiment_is_reported_and_the_tour_goes_on(monkeypatch, capsys):
    """A gloo error's text ('[/.../pair.cc:537] Connection closed by peer') was read as rich markup: the
    tour itself died with a MarkupError instead of naming the failed experiment."""
    from benchmarks import accounting, precision, tour

    def fails(argv):
        raise RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection closed")

    monkeypatch.setattr(precision, "main", fails)
    assert tour.main(["--only", "precision,accounting", "--no-save"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "pair.cc:537] Connection closed" in out and "failed: precision" in out
    assert accounting.TOUR_ARGS == [] and "accounting ok" in out  # the next experiment still ran
