"""No command replaces a result with nothing: bad arguments are refused first, empty tables not written."""

import argparse
import importlib

import pandas as pd
import pytest

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
    err = refused(capsys, lambda: module.main([*argv, *SMALL[experiment], "--results-dir", str(tmp_path)]))
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
