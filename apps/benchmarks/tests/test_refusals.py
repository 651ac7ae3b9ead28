"""No command replaces a result with nothing: bad arguments are refused first, empty tables not written."""

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from benchmarks import common
from benchmarks.common import CAPTURE_FAILED, NOT_AVAILABLE, OOM, SKIPPED, NothingMeasured, save_results
from benchmarks.report import main as report_main


def saver(results, command="python -m benchmarks.test"):
    return argparse.Namespace(results_dir=results, no_save=False, command=command)


def files_in(folder):
    return {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def refused(capsys, run, status=2):
    """The one line run() leaves on stderr as it exits with ``status`` (as Python would print a SystemExit
    that holds a message: the message, status 1)."""
    with pytest.raises(SystemExit) as exit_:
        run()
    code = exit_.value.code
    err = f"{code}\n" if isinstance(code, str) else capsys.readouterr().err
    assert (1 if isinstance(code, str) else code) == status
    assert err.count("\n") == 1, err
    return err


# A run that is not refused stays short.
SMALL = {"flash": ["--seq", "16", "--dims", "16", "--dtypes", "float32", "--shapes", "", "--impls", "naive",
                   "--device", "cpu"],
         "e2e": ["--size", "tiny", "--context", "16", "--warmup", "0", "--steps", "1"]}


# --- the three ways of losing a file ----------------------------------------------------------

@pytest.mark.parametrize(("experiment", "argv", "message"), [
    ("flash", ["--name", ""], "argument --name: expected a file name"),
    ("e2e", ["--name", ""], "argument --name: expected a file name"),
    ("e2e", ["--name", "../e2e_train"], "argument --name: expected a file name"),
    ("flash", ["--max-minutes", "0"], "argument --max-minutes: must be above 0, got 0"),
])
def test_an_argument_that_would_replace_a_table_with_nothing_is_refused(tmp_path, capsys, experiment, argv,
                                                                        message):
    """`--name ""` fell back to the default name; `--max-minutes 0` wrote a table of 'skipped' over it."""
    default = {"flash": "flash", "e2e": "e2e_train"}[experiment]
    save_results(pd.DataFrame({"T": [64], "fwd ms": [1.5]}), default, saver(tmp_path), {"device": "cpu"})
    before = files_in(tmp_path)
    module = importlib.import_module(f"benchmarks.{experiment}")
    err = refused(capsys, lambda: module.main([*SMALL[experiment], *argv, "--results-dir", str(tmp_path)]))
    assert err.startswith(f"python -m benchmarks.{experiment}: error: {message}")
    assert files_in(tmp_path) == before


@pytest.mark.parametrize("results_dir", ["resutls", "empty"])
def test_the_report_refuses_a_results_dir_with_no_results(tmp_path, capsys, results_dir):
    """A mistyped --results-dir replaced the report with one that read "not measured yet" throughout."""
    (tmp_path / "empty" / "cpu").mkdir(parents=True)
    out = tmp_path / "docs" / "report.md"
    out.parent.mkdir()
    out.write_text("the 875-line report\n")
    argv = ["--results-dir", str(tmp_path / results_dir), "--out", str(out)]
    err = refused(capsys, lambda: report_main(argv))
    assert err.startswith(f"python -m benchmarks.report: error: --results-dir {tmp_path / results_dir}: ")
    assert ("no such folder" if results_dir == "resutls" else "no results files") in err
    assert files_in(out.parent) == {"report.md": b"the 875-line report\n"}


# --- the general rule, where results are written --------------------------------------------------------

def sweep(cells):
    """A flash-like table: configuration columns, then a measured column holding ``cells``, and a ratio."""
    return pd.DataFrame({"T": [128 * (i + 1) for i in range(len(cells))], "dtype": "float32", "impl": "naive",
                         "fwd ms": cells, "x flash": [float("nan")] * len(cells)})


NOTHING_MEASURED = {
    "no rows": pd.DataFrame({"T": [], "fwd ms": []}),
    "no columns": pd.DataFrame(),
    "all skipped": sweep([SKIPPED, SKIPPED]),
    "unsupported and blank": sweep([NOT_AVAILABLE, ""]),
    "capture failed": sweep([CAPTURE_FAILED, SKIPPED]),
}


@pytest.mark.parametrize("df", NOTHING_MEASURED.values(), ids=NOTHING_MEASURED.keys())
def test_a_table_with_nothing_measured_is_not_written(tmp_path, capsys, df):
    path = save_results(sweep([1.25, 2.5]), "flash", saver(tmp_path), {"device": "cpu"})
    before = files_in(tmp_path)
    err = refused(capsys, lambda: save_results(df, "flash", saver(tmp_path), {"device": "cpu"}), status=1)
    assert err.startswith("error: nothing was measured") and f"{path} not written" in err
    assert files_in(tmp_path) == before  # the old table, and no temporary file


SOMETHING_MEASURED = {
    "one cell timed": sweep([SKIPPED, 2.5]),
    "out of memory": sweep([OOM, OOM]),  # what trying found: a result
    "numbers only": pd.DataFrame({"symbol": ["S"], "value": [1.0]}),
}


@pytest.mark.parametrize("df", SOMETHING_MEASURED.values(), ids=SOMETHING_MEASURED.keys())
def test_a_table_with_something_measured_is_written(tmp_path, df):
    path = save_results(df, "flash", saver(tmp_path), {"device": "cpu"})
    assert common.read_results(path)[0].shape == df.shape


def test_a_flash_run_that_timed_nothing_keeps_the_old_table(tmp_path, capsys):
    """--max-minutes above 0 but spent before the first cell: every cell reads 'skipped'."""
    path = save_results(sweep([1.25]), "flash", saver(tmp_path), {"device": "cpu"})
    before = files_in(tmp_path)
    flash = importlib.import_module("benchmarks.flash")
    with pytest.raises(NothingMeasured) as exit_:
        flash.main(["--max-minutes", "1e-12", *SMALL["flash"], "--results-dir", str(tmp_path)])
    assert exit_.value.code.startswith("error: nothing was measured") and exit_.value.path == path
    assert files_in(tmp_path) == before


def test_an_experiment_that_measured_nothing_ends_itself_not_the_tour(tmp_path, monkeypatch):
    flash = importlib.import_module("benchmarks.flash")
    monkeypatch.setattr(flash, "TOUR_ARGS", [*SMALL["flash"], "--max-minutes", "1e-12"])
    tour = importlib.import_module("benchmarks.tour")
    assert tour.main(["--only", "flash,precision", "--results-dir", str(tmp_path)]) == 1
    written = {p.name for p in (tmp_path / common.device_slug()).iterdir()}
    assert written == {f"precision_{t}.{ext}" for t in ("accumulation", "autocast") for ext in ("csv", "md")}


# --- unclear errors: one line, exit 2, before any work ---------------------------------------------------

BEFORE_ANY_WORK = [
    ("shardopt", ["--lr", "nan"], "argument --lr: expected a finite number, got 'nan'"),
    ("shardopt", ["--lr", "inf"], "argument --lr: expected a finite number, got 'inf'"),
    ("shardopt", ["--lr", "0"], "argument --lr: must be above 0, got 0"),
    ("e2e", ["--compile", "--compile-backend", "nope"],
     "argument --compile-backend: 'nope' is not a torch.compile backend (torch._dynamo.list_backends(): "),
    ("attention", ["--compile-backend", "nope"], "argument --compile-backend: 'nope' is not a torch.compile"),
    ("e2e", ["--memory", "{tmp}"], "--memory {tmp}: is a folder; name a file"),
    ("report", ["--out", "{tmp}"], "--out {tmp}: is a folder; name a file"),
    ("report", ["--out", "{tmp}/a-file/report.md"], "--out {tmp}/a-file/report.md: cannot write there"),
]
if not torch.cuda.is_available():  # the message a machine without CUDA gives
    BEFORE_ANY_WORK.append(("flash", ["--device", "cuda"],
                            "--device cuda needs a CUDA GPU; this machine has 0"))


@pytest.mark.parametrize(("experiment", "argv", "message"), BEFORE_ANY_WORK,
                         ids=[f"{e} {' '.join(a)}" for e, a, _ in BEFORE_ANY_WORK])
def test_a_bad_argument_is_one_line_before_any_work(tmp_path, capsys, experiment, argv, message):
    """Each of these was a traceback: after the model was built, or from the workers (--lr nan, after its
    spawn), or after the whole report was built (--out), leaving a temporary file."""
    results = tmp_path / "results"
    save_results(sweep([1.25]), "flash", saver(results), {"device": "cpu"})
    (tmp_path / "a-file").write_text("not a folder")
    before = files_in(tmp_path)
    module = importlib.import_module(f"benchmarks.{experiment}")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in [*SMALL.get(experiment, []), *argv]]  # argv wins
    err = refused(capsys, lambda: module.main([*argv, "--results-dir", str(results)]))
    message = message.replace("{tmp}", str(tmp_path))
    assert err.startswith(f"python -m benchmarks.{experiment}: error: {message}")
    assert files_in(tmp_path) == before  # no temporary file, no plot, no table


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    (tmp_path / "report.md").mkdir()
    with pytest.raises(IsADirectoryError):
        common.write_atomically(tmp_path / "report.md", "text")
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_the_host_running_out_of_memory_is_an_oom_cell_as_a_gpu_is():
    too_big = 2**62  # bytes: past any address space, so it fails at once everywhere
    assert common.or_oom(lambda: torch.empty(too_big, dtype=torch.uint8)) == OOM
    assert common.or_oom(lambda: bytearray(too_big)) == OOM  # Python's MemoryError
    assert common.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 EiB"))

    def another_error():
        raise RuntimeError("expected a tensor")

    with pytest.raises(RuntimeError, match="expected a tensor"):  # still raised, not a cell
        common.or_oom(another_error)


def test_e2e_on_a_host_out_of_memory_writes_an_oom_row(tmp_path):
    """A model too big for the host's memory was a traceback on CPU where on a GPU it is an OOM row."""
    e2e = importlib.import_module("benchmarks.e2e")
    e2e.main([*SMALL["e2e"], "--vocab-size", str(10**13), "--results-dir", str(tmp_path)])
    df, _ = common.read_results(tmp_path / common.device_slug() / "e2e_train.csv")
    assert df["step ms"].tolist() == [OOM]


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def flash_table(ms):
    return pd.DataFrame({"batch*heads": [16], "T": [1024], "d": [64], "dtype": ["bfloat16"], "causal": [True],
                         "impl": ["triton"], "fwd ms": [ms], "bwd ms": [ms], "fwd+bwd ms": [ms]})


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("flash_regression.py", ["{old}", "{new}", "--bound", "nan"],
     "argument --bound: expected a finite number, got 'nan'"),
    ("ddp_profile.py", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
])
def test_the_scripts_check_their_numbers_too(tmp_path, script, argv, message):
    """flash_regression --bound nan passed every cell (nothing compares above NaN), a 2x regression too."""
    old, new = (save_results(flash_table(ms), name, saver(tmp_path), {"device": "cpu"})
                for name, ms in (("old", 1.0), ("new", 2.0)))
    argv = [a.replace("{old}", str(old)).replace("{new}", str(new)) for a in argv]
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *argv], capture_output=True, text=True,
                          timeout=300)  # a hang guard: a refusal takes a second
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr
