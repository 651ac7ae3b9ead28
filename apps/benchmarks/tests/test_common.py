"""Results files are written atomically, read strictly, and every experiment's arguments are checked first."""

import argparse
import errno
import importlib
import multiprocessing
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pandas as pd
import pytest

from benchmarks import common
from benchmarks.common import ResultsNotSaved, UnreadableResults, read_results, save_results
from benchmarks.report import build_report
from benchmarks.report import main as report_main


def saver(results: Path, command: str = "python -m benchmarks.test") -> argparse.Namespace:
    return argparse.Namespace(results_dir=results, no_save=False, command=command)


def table(rows: int, tag: str) -> pd.DataFrame:
    return pd.DataFrame({"row": range(rows), "tag": [tag] * rows, "ms": [i / 7 for i in range(rows)]})


def metadata() -> dict[str, str]:
    return {"device": "cpu"}


def test_a_save_reads_back_exactly(tmp_path):
    df = table(5, "a")
    path = save_results(df, "x", saver(tmp_path), metadata())
    back, meta = read_results(path)
    pd.testing.assert_frame_equal(back, df)
    assert meta["command"] == "python -m benchmarks.test"
    assert path.with_suffix(".md").read_text().startswith("# x\n")
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.csv", "x.md"]  # no temporary files left


def test_a_write_failing_midway_leaves_the_old_file_whole(tmp_path, monkeypatch, capsys):
    old = table(3, "old")
    path = save_results(old, "x", saver(tmp_path), metadata())
    before = path.read_bytes(), path.with_suffix(".md").read_bytes()

    real_fdopen = os.fdopen

    class DiskFullAfter:
        """A file that takes the first 40 bytes, then fails as a full disk does."""

        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, text):
            if self.written + len(text) > 40:
                self.f.write(text[: 40 - self.written])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(text)
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(common.os, "fdopen", lambda fd, mode: DiskFullAfter(real_fdopen(fd, mode)))
    with pytest.raises(ResultsNotSaved) as failure:
        save_results(table(1000, "new"), "x", saver(tmp_path), metadata())
    message = str(failure.value.code)
    assert "\n" not in message and "No space left on device" in message and str(path) in message
    assert (path.read_bytes(), path.with_suffix(".md").read_bytes()) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.csv", "x.md"]


def test_the_csv_is_not_replaced_when_its_markdown_copy_cannot_be_written(tmp_path, monkeypatch):
    path = save_results(table(3, "old"), "x", saver(tmp_path), metadata())
    before = path.read_bytes(), path.with_suffix(".md").read_bytes()
    real_staged = common._staged

    def full_for_markdown(target, text):
        if target.suffix == ".md":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_staged(target, text)

    monkeypatch.setattr(common, "_staged", full_for_markdown)
    with pytest.raises(ResultsNotSaved, match=r"x\.md \(No space left on device\)"):
        save_results(table(5, "new"), "x", saver(tmp_path), metadata())
    assert (path.read_bytes(), path.with_suffix(".md").read_bytes()) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.csv", "x.md"]


def test_a_failed_save_exits_with_status_1_and_one_line(tmp_path):
    """The command-line view of the case above, as a user sees it: stderr and the exit status."""
    code = (f"import errno, os, argparse, pandas as pd\n"
            f"from benchmarks import common\n"
            f"def full(*a, **k): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
            f"common._staged = full\n"
            f"args = argparse.Namespace(results_dir={str(tmp_path)!r}, no_save=False, command='c')\n"
            f"common.save_results(pd.DataFrame({{'a': [1]}}), 'x', args, {{'device': 'cpu'}})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900)  # a hang guard; it takes seconds
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: could not write {tmp_path / 'cpu' / 'x.csv'} (No space left on device); "
        "the earlier file, if any, is unchanged"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 KiB tmpfs (root only); skipped where mounting is not allowed."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk_leaves_the_old_file_whole(small_tmpfs):
    path = save_results(table(20, "old"), "x", saver(small_tmpfs), metadata())
    before = path.read_bytes()
    with pytest.raises(ResultsNotSaved, match="No space left on device"):
        save_results(table(20_000, "new"), "x", saver(small_tmpfs), metadata())
    assert path.read_bytes() == before
    pd.testing.assert_frame_equal(read_results(path)[0], table(20, "old"))
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.csv", "x.md"]


def _save_repeatedly(results: str, tag: str, start, times: int) -> None:
    start.wait()
    for _ in range(times):
        save_results(table(2000, tag), "x", saver(Path(results)), metadata())


def test_concurrent_saves_never_tear_the_file(tmp_path):
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(2)
    writers = [ctx.Process(target=_save_repeatedly, args=(str(tmp_path), tag, start, 15)) for tag in "ab"]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=900)  # a hang guard; they take seconds
    assert [w.exitcode for w in writers] == [0, 0]
    path = tmp_path / "cpu" / "x.csv"
    df, _ = read_results(path)
    winner = df["tag"].iloc[0]
    pd.testing.assert_frame_equal(df, table(2000, winner))  # one writer's file, whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.csv", "x.md"]


TORN = {
    "cut mid-row": lambda text: text[: text.rindex("\n", 0, len(text) - 1) + 5],
    "NUL bytes": lambda text: text[:200] + "\0" * 64 + text[264:],
    "rows of two runs": lambda text: text + "1,a\n",
}


@pytest.mark.parametrize("damage", list(TORN))
def test_read_results_refuses_a_torn_file(tmp_path, damage):
    path = save_results(table(10, "a"), "x", saver(tmp_path), metadata())
    path.write_text(TORN[damage](path.read_text()))
    with pytest.raises(UnreadableResults, match=str(path)):
        read_results(path)


def test_the_report_names_a_torn_file_and_exits_1(tmp_path):
    results = tmp_path / "results"
    whole = save_results(pd.DataFrame({"symbol": ["S"], "value": [1.0]}), "accounting_memory",
                         saver(results, "python -m benchmarks.accounting"), {"device": "analytic"})
    torn = save_results(table(10, "a"), "precision_accumulation", saver(results), metadata())
    torn.write_text(TORN["cut mid-row"](torn.read_text()))
    out = tmp_path / "docs" / "report.md"
    assert report_main(["--results-dir", str(results), "--out", str(out)]) == 1
    text = out.read_text()
    assert "**Not read**" in text and str(torn) in text
    assert "Not measured yet: run `python -m benchmarks.precision --results-dir" in text  # nothing made up
    assert str(whole) not in text.split("## ")[0]  # the whole file is read as usual
    unreadable: list[str] = []
    build_report(results, out, unreadable)
    assert len(unreadable) == 1 and "cut off" in unreadable[0]


# --- arguments: checked by argparse before any work -------------------------------------------------------

BAD_ARGUMENTS = [
    ("e2e", ["--context", ","], "--context: expected at least one value"),
    ("e2e", ["--precision", ""], "--precision: expected at least one value"),
    ("e2e", ["--size", ","], "--size: expected at least one value"),
    ("e2e", ["--steps", "0"], "--steps: must be at least 1, got 0"),
    ("flash", ["--seq", "0"], "--seq: every value must be at least 1, got 0"),
    ("flash", ["--dims", "0"], "--dims: every value must be at least 1, got 0"),
    ("flash", ["--batch", "-2"], "--batch: must be at least 1, got -2"),
    ("flash", ["--batch", "0"], "--batch: must be at least 1, got 0"),
    ("flash", ["--rep", "-5"], "--rep: must be above 0, got -5"),
    ("flash", ["--impls", ","], "--impls: expected at least one value"),
    ("shardopt", ["--nproc", "0"], "--nproc: must be at least 1, got 0"),
    ("shardopt", ["--optimizers", ""], "--optimizers: expected at least one value"),
    ("shardopt", ["--iters", "0"], "--iters: must be at least 1, got 0"),
    ("ddp", ["--nproc", "0"], "--nproc: must be at least 1, got 0"),
    ("ddp", ["--bucket-mb", ","], "--bucket-mb: expected at least one value"),
    ("ddp", ["--steps", "-1"], "--steps: must be at least 1, got -1"),
    ("allreduce", ["--sizes-mb", ","], "--sizes-mb: expected at least one value"),
    ("allreduce", ["--world-sizes", "0"], "--world-sizes: every value must be at least 1, got 0"),
    ("attention", ["--T", "0,64"], "--T: every value must be at least 1, got 0"),
    ("attention", ["--passes", "0"], "--passes: must be at least 1, got 0"),
    ("accounting", ["--tokens", ","], "--tokens: expected at least one value"),
    ("accounting", ["--flops", "nan"], "--flops: expected a finite number"),
    ("tour", ["--only", ","], "--only: expected at least one value"),
]


@pytest.mark.parametrize(("experiment", "argv", "message"), BAD_ARGUMENTS,
                         ids=[f"{e} {' '.join(a)}" for e, a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_and_exit_2_before_any_work(tmp_path, capsys, experiment, argv, message):
    results = tmp_path / "results"
    module = importlib.import_module(f"benchmarks.{experiment}")
    with pytest.raises(SystemExit) as exit_:
        module.main([*argv, "--results-dir", str(results)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"python -m benchmarks.{experiment}: error: argument ")
    assert message in err
    assert not results.exists()  # nothing created, nothing measured


def test_an_existing_result_survives_an_empty_list(tmp_path):
    """The issue's case: `e2e --context ,` used to overwrite e2e_train.csv with a header-only table."""
    path = save_results(table(3, "old"), "e2e_train", saver(tmp_path), metadata())
    before = path.read_bytes()
    done = subprocess.run([sys.executable, "-m", "benchmarks.e2e", "--context", ",", "--results-dir",
                           str(tmp_path)], capture_output=True, text=True,
                          timeout=900)  # a hang guard; it takes seconds
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert path.read_bytes() == before


@pytest.mark.parametrize("experiment", ["e2e", "flash", "accounting", "shardopt"])
def test_an_unwritable_results_dir_is_refused_before_any_work(tmp_path, capsys, experiment):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    module = importlib.import_module(f"benchmarks.{experiment}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--results-dir", str(blocker / "results")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--results-dir {blocker / 'results'}: cannot write there" in err


def test_a_read_only_results_dir_is_refused(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders; the unwritable case above covers root")
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    with pytest.raises(SystemExit):
        importlib.import_module("benchmarks.accounting").main(["--results-dir", str(folder)])
    assert "cannot write there (Permission denied)" in capsys.readouterr().err


def test_no_save_needs_no_writable_results_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    importlib.import_module("benchmarks.accounting").main(["--results-dir", str(blocker), "--no-save"])


# --- tables ------------------------------------------------------------------------------------------

def test_piped_tables_are_markdown_and_uncut(tmp_path):
    """`benchmarks.accounting | cat`: no cell cut to 'ex…' at 80 columns."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.accounting", "--no-save"], capture_output=True,
                          text=True, timeout=900,  # a hang guard; it takes seconds
                          env={**os.environ, "COLUMNS": "80", "TERM": "dumb"})
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout
    assert "| symbol" in done.stdout and "exposed" in done.stdout
    assert "activations, 16384 tokens" in done.stdout


def test_undefined_cells_print_alike(capsys):
    df = pd.DataFrame({"a": [1.0, float("nan")], "b": ["x", None], "c": [common.OOM, "y"]})
    common.print_table(df, "t")
    printed = capsys.readouterr().out
    for text in (printed, common.to_markdown(df)):
        cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.split("|")]
        assert cells.count(common.UNDEFINED) == 2 and "nan" not in text and "None" not in text


def test_unique_temporary_names(tmp_path):
    """Two writers in one folder never share a temporary file (the rename is what makes it atomic)."""
    target = tmp_path / f"{uuid.uuid4().hex}.csv"
    common.write_atomically(target, "a\n")
    common.write_atomically(target, "b\n")
    assert target.read_text() == "b\n" and [p.name for p in tmp_path.iterdir()] == [target.name]
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~common._UMASK)


def test_the_noise_rule_flags_negative_times_and_differences_within_their_spread():
    assert common.within_noise(-203.682, 4.0)  # results/cpu/ddp.md's exposed comm: far below 0, still noise
    assert common.within_noise(-1.5, 4.0) and common.within_noise(3.9, 4.0) and common.within_noise(-0.01)
    assert not common.within_noise(30.0, 4.0) and not common.within_noise(0.0)
    assert not common.within_noise(1e-3)
    assert not common.within_noise(float("nan"), 4.0) and not common.within_noise(5.0, float("nan"))


def test_derived_cells_within_noise_are_marked_not_printed_as_facts():
    df = pd.DataFrame({"exposed ms": [-1.5, 30.0, 0.0, -203.682],
                       "exposed std": [4.0, 4.0, float("nan"), 4.0], "x single": [0.98, 1.3, 1.0, 0.739]})
    noisy = [common.within_noise(d, s) for d, s in zip(df["exposed ms"], df["exposed std"], strict=True)]
    near = {"exposed ms": "~0", "x single": "~1"}
    shown = common.with_noise_marked(df, noisy, list(near), near)
    assert shown["exposed ms"].tolist() == ["~0 (noise)", 30.0, 0.0, "~0 (noise)"]
    assert shown["x single"].tolist() == ["~1 (noise)", 1.3, 1.0, "~1 (noise)"]
    plain = common.with_noise_marked(df, noisy, ["x single"])
    assert plain["x single"].tolist() == ["0.98 (noise)", 1.3, 1.0, "0.739 (noise)"]
    assert df["exposed ms"].tolist() == [-1.5, 30.0, 0.0, -203.682]  # the data itself is kept


def test_terminal_tables_at_80_columns_cut_no_cell(monkeypatch):
    """The issue's cuts at 80-120 columns ('stra…', 'float…', '2.34e…'): a wide table is printed in parts,
    each with the columns that name a row, and every cell whole."""
    import io

    from rich.console import Console

    screen = io.StringIO()
    terminal = Console(file=screen, width=80, force_terminal=True, color_system=None)
    monkeypatch.setattr(common, "console", terminal)
    wide = {f"column {i} with a long name": [1.23456e-7 * i, 12345.678, -0.00021] for i in range(8)}
    df = pd.DataFrame({"strategy": ["single", "bucketed", "torch"], "bucket MiB": [float("nan"), 25.0, 100.0],
                       "dtype": "float32", "exposed comm ms": ["~0 (noise)", 2.34567e-05, 0.000943], **wide})
    common.print_table(df, "a table wider than the terminal")
    text = screen.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    cells = {common.cell_text(v) for column in df.columns for v in df[column]}
    lines = [line.split("│") for line in text.splitlines()]
    shown = {cell.strip() for line in lines for cell in line}
    assert cells <= shown, cells - shown  # every number whole, in one cell
    assert text.count("part 1 of") == 1 and shown >= {"single", "bucketed", "torch"}
    assert "a table wider than the terminal (part 1 of" in text
    headers = " ".join(text.split())
    assert all(word in headers for column in df.columns for word in column.split())


def test_a_table_that_names_its_rows_last_names_them_in_every_part(monkeypatch):
    """A kernel summary opens with measurements and ends with the kernel's Name: split to fit 80
    columns, every part still says which kernel each row is."""
    import io

    from rich.console import Console

    screen = io.StringIO()
    terminal = Console(file=screen, width=80, force_terminal=True, color_system=None)
    monkeypatch.setattr(common, "console", terminal)
    names = ["aten::mm", "aten::_log_softmax", "aten::mul"]
    measured = {header: [59.6 * (i + 1), 1477230.4, 93319.5] for i, header in enumerate(
        ["Time (%)", "Total Time (ns)", "Avg (ns)", "Med (ns)", "Min (ns)", "Max (ns)", "StdDev (ns)"])}
    common.print_table(pd.DataFrame({**measured, "Name": names}), "forward: top 3 kernels")
    parts = screen.getvalue().split("forward: top 3 kernels")[1:]
    assert len(parts) > 1
    assert all(name in part for part in parts for name in names)
