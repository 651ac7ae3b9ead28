"""What every experiment shares: device facts, checked arguments, result files, tables, OOM cells.

Results go to ``<results-dir>/<device>/<experiment>.csv`` (``<results-dir>`` is the untracked ``out/``
unless ``--results-dir`` names another folder, so a checkout stays clean; metadata as leading
``# key: value`` lines; read back with :func:`read_results`) with a Markdown copy beside it. Each file
is written whole to a temporary file in its folder and then renamed over the old one, so a full disk, a
crash or a second run writing the same file never leaves a torn file: the old one stays, or the
last complete one wins.

A table with nothing measured in it (no rows, or cells that all say why they were not measured:
:data:`NOT_MEASURED`) is never written: the earlier file stays, and the command exits 1.

Arguments are checked by argparse before any work: the ``type=`` helpers below refuse empty
lists, out-of-range or non-finite numbers, file names that are not one and unknown torch.compile
backends; :func:`parse_args` makes sure ``--results-dir`` can be written (:func:`check_writable`
does the same for any output path) and :func:`require_gpus` that ``--device cuda`` has its GPUs.
Each failure is one line on stderr and exit status 2.

Running out of memory, a GPU's or the host's, is a cell reading OOM (:func:`or_oom`), not a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import io
import math
import numbers
import os
import re
import shlex
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pandas as pd
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console(soft_wrap=True)  # long lines are not cut or folded at 80 columns when piped
T = TypeVar("T")
OOM = "OOM"
UNDEFINED = "-"  # how a cell with no value (NaN, None) prints, in every table and Markdown file
DEFAULT_RESULTS_DIR = Path("out")  # untracked: running an experiment leaves a checkout clean
NOISE = "(noise)"  # after a cell that the noise rule (within_noise) flags: "~0 (noise)", "31.9 (noise)"
# Cells that say why a measurement was not made. OOM is not one of them: it is what the attempt found.
NOT_AVAILABLE = "unsupported"  # not "n/a": pandas reads that back as NaN
SKIPPED = "skipped"
CAPTURE_FAILED = "capture failed"
NOT_MEASURED = (NOT_AVAILABLE, SKIPPED, CAPTURE_FAILED)
# How a RuntimeError says memory ran out: CUDA's allocator (also inside a worker's traceback), Triton's
# shared memory, torch's CPU allocator.
OOM_MESSAGES = ("out of memory", "OutOfResources", "DefaultCPUAllocator: can't allocate memory")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name() -> str:
    """'NVIDIA H100 80GB HBM3', or 'cpu'."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def device_slug(name: str | None = None) -> str:
    """A folder name for a device: 'nvidia-h100-80gb-hbm3', 'cpu'."""
    return re.sub(r"[^a-z0-9]+", "-", (name or device_name()).lower()).strip("-")


def run_metadata(command: str) -> dict[str, str]:
    """Where, when and how a result was measured."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "device": device_name(),
        "gpu_count": str(torch.cuda.device_count()),
        "torch": torch.__version__,
        "triton": triton_version,
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's paragraphs as written and shows every option's default, once: not
    where the help states it already, nor a None that means 'chosen at run time' (the help says how)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line on stderr (exit status 2), not the usage and a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def make_parser(experiment: str, description: str) -> ArgumentParser:
    """An experiment's parser (description: its module docstring), with the options every experiment has."""
    parser = ArgumentParser(prog=f"python -m benchmarks.{experiment}", description=description,
                            formatter_class=HelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR,
                        help="write <results-dir>/<device>/<name>.csv and .md (the default, out/, is not "
                             "tracked by git; the committed results are in results/)")
    parser.add_argument("--no-save", action="store_true", help="print the tables, write no files")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None,
               writes_results: bool = True) -> argparse.Namespace:
    """parse_args that also records the command line (args.command) for the results' metadata.

    Unless ``--no-save`` (or ``writes_results=False``: a command that only reads results), the
    results directory is created and tested for writing here, before any work, so that a long
    run never ends in a failed save of that kind.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command = " ".join([parser.prog, *map(shlex.quote, argv)])
    if writes_results and not args.no_save:
        check_writable(parser, "--results-dir", Path(args.results_dir), folder=True)
    return args


def check_writable(parser: argparse.ArgumentParser, option: str, path: Path, folder: bool = False) -> None:
    """The one-line error (exit 2) naming ``option`` where path cannot be written: a folder to write files in
    (``folder``), else a file."""
    problem = unwritable(path) if folder else unwritable_file(path)
    if problem:
        parser.error(f"{option} {path}: {problem}")


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written in folder (created if missing), or None if they can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f"cannot write there ({exc.strerror or exc})"
    return None


def unwritable_file(path: Path) -> str | None:
    """Why a file cannot be written at path (its folder created if missing), or None if it can."""
    if path.is_dir():
        return "is a folder; name a file"
    return unwritable(path.parent)


class ResultsNotSaved(SystemExit):
    """A results file could not be written; the earlier file is left as it was. Exits with status 1."""

    def __init__(self, path: Path, exc: OSError) -> None:
        super().__init__(f"error: could not write {path} ({exc.strerror or exc}); "
                         "the earlier file, if any, is unchanged")
        self.path = path


class NothingMeasured(SystemExit):
    """A table with nothing measured in it was not written; the earlier file is left as it was. Exits 1."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"error: nothing was measured (no rows, or only cells reading "
                         f"{', '.join(NOT_MEASURED)}): {path} not written; the earlier file, if any, "
                         "is unchanged")
        self.path = path


def measured_nothing(df: pd.DataFrame) -> bool:
    """Whether a table holds no measurement: no rows, or columns of :data:`NOT_MEASURED` cells (and blanks)
    with not one value among them. Tables without such cells (configurations and numbers) hold one."""
    if df.empty:
        return True
    cells = df.astype(object)
    unmade = cells.isin(NOT_MEASURED)
    examined = unmade.any()  # the columns that say "not measured" somewhere: the measurements' columns
    if not examined.any():
        return False
    blank = cells.isna() | cells.eq("")
    return bool((unmade | blank).loc[:, examined].all().all())


def write_atomically(path: Path, text: str) -> None:
    """Replace path by a file holding text, or leave it as it was: never a part-written path.

    The text goes to a temporary file in the same folder (so the rename stays on one file
    system), is flushed to the disk, and is renamed over path; two writers each rename a
    complete file of their own, and the last one wins.
    """
    _replace(_staged(path, text), path)


def _replace(tmp: str, path: Path) -> None:
    """os.replace(tmp, path); tmp removed if that fails (path a folder, say)."""
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _staged(path: Path, text: str) -> str:
    """A complete temporary copy of text beside path, on the disk; nothing left behind on failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes it private; results are ordinary files
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def save_results(df: pd.DataFrame, name: str, args: argparse.Namespace,
                 metadata: dict[str, str] | None = None) -> Path | None:
    """Write the table as <results-dir>/<device>/<name>.csv (metadata first) and .md; None with --no-save.

    ``args`` comes from :func:`parse_args`; ``metadata`` overrides or extends :func:`run_metadata`.
    Both files are written atomically (:func:`write_atomically`), and neither replaces its old
    one until both are complete on the disk. If either cannot be written (a full disk, say),
    :class:`ResultsNotSaved` exits the command with status 1 and a one-line message, leaving the
    earlier files whole; a table with nothing measured (:func:`measured_nothing`) is not written
    either, and :class:`NothingMeasured` exits 1 likewise.
    """
    if args.no_save:
        return None
    meta = {**run_metadata(args.command), **(metadata or {})}
    folder = Path(args.results_dir) / device_slug(meta["device"])
    csv_path = folder / f"{name}.csv"
    if measured_nothing(df):
        raise NothingMeasured(csv_path)
    csv_text = io.StringIO()
    for key, value in meta.items():
        csv_text.write(f"# {key}: {value}\n")
    df.to_csv(csv_text, index=False)
    header = "\n".join(f"- {key}: `{value}`" for key, value in meta.items())
    markdown = f"# {name}\n\n{header}\n\n{to_markdown(df)}\n"
    staged: list[tuple[str, Path]] = []  # both files complete on the disk before either replaces its old one
    for path, text in ((csv_path, csv_text.getvalue()), (csv_path.with_suffix(".md"), markdown)):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            staged.append((_staged(path, text), path))
        except OSError as exc:
            for tmp, _ in staged:
                os.unlink(tmp)
            raise ResultsNotSaved(path, exc) from exc
    for i, (tmp, path) in enumerate(staged):
        try:
            _replace(tmp, path)
        except OSError as exc:
            for later, _ in staged[i + 1:]:
                os.unlink(later)
            raise ResultsNotSaved(path, exc) from exc
    console.print(f"[dim]wrote {csv_path} and {csv_path.with_suffix('.md').name}[/dim]")
    return csv_path


class UnreadableResults(ValueError):
    """A results file that does not parse as one: torn, cut short, or not written by save_results."""


def read_results(path: Path) -> tuple[pd.DataFrame, dict[str, str]]:
    """A results CSV and its metadata; :class:`UnreadableResults` if the file is not a whole results file.

    A file cut off mid-row (short rows, or NUL bytes from a torn write) is refused, not read
    with NaN cells where the missing values were.
    """
    path = Path(path)
    text = path.read_text(errors="replace")
    if "\x00" in text:
        raise UnreadableResults(f"{path}: NUL bytes (a torn write)")
    meta = {}
    lines = text.splitlines(keepends=True)
    for line in lines:
        if not line.startswith("# "):
            break
        key, _, value = line[2:].partition(": ")
        meta[key] = value.rstrip("\n")
    body = lines[len(meta):]
    if not body:
        raise UnreadableResults(f"{path}: no table after the metadata")
    if not text.endswith("\n"):
        raise UnreadableResults(f"{path}: the last row is cut off (no final newline)")
    rows = list(csv.reader(body))
    ragged = next((i for i, row in enumerate(rows) if len(row) != len(rows[0])), None)
    if ragged is not None:  # pandas would pad a short row with NaN
        raise UnreadableResults(f"{path}: line {len(meta) + ragged + 1} has {len(rows[ragged])} fields, "
                                f"the header {len(rows[0])} (a torn or mixed write)")
    try:
        df = pd.read_csv(io.StringIO("".join(body)), on_bad_lines="error")
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise UnreadableResults(f"{path}: {str(exc).strip()}") from exc
    return df, meta


def cell_text(value: Any, float_format: str = "{:.3g}") -> str:
    """How a table cell prints, in every experiment: floats formatted, no value as UNDEFINED."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return UNDEFINED
    if isinstance(value, float):
        return float_format.format(value)
    return str(value)


def to_markdown(df: pd.DataFrame, float_format: str = "{:.6g}") -> str:
    """The table as Markdown, with cells as :func:`cell_text` prints them."""
    shown = df.astype(object).map(lambda v: cell_text(v, float_format)) if len(df) else df
    return shown.to_markdown(index=False, disable_numparse=True,
                             colalign=["right" if pd.api.types.is_numeric_dtype(df[c]) else "left"
                                       for c in df.columns] or None)


def within_noise(difference: float, spread: float = 0.0) -> bool:
    """The noise rule: the one test every table and the report apply before a timing is read as a finding.

    ``difference`` is a measured time, or the part of one that a difference of times measures, that
    cannot be negative: a time itself, what a data-parallel step adds to one device's (its step minus
    the single step), the backward inside a fwd+bwd (fwd+bwd minus fwd). It is noise when it is not
    above its spread (one std of it; 0 where none was measured): negative, or within one spread of
    zero. Then neither its value, its sign nor a ratio built on it is a finding. A signed comparison of
    two alternatives (ours against torch's) passes the size of their difference, ``abs(a - b)``.
    """
    return not (math.isnan(difference) or math.isnan(spread)) and difference < spread


def is_measured(value: Any) -> bool:
    """Whether a cell holds a number (not a reason such as OOM, nor NaN)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def noise_text(value: Any, near: str | None = None, float_format: str = "{:.3g}") -> str:
    """How a cell that :func:`within_noise` flags prints: '~0 (noise)' with ``near='~0'``, else
    '12.3 (noise)'."""
    return f"{near if near is not None else cell_text(value, float_format)} {NOISE}"


def with_noise_marked(df: pd.DataFrame, noisy: Iterable[bool], columns: Iterable[str],
                      near: dict[str, str] | None = None) -> pd.DataFrame:
    """A copy for printing in which, on the ``noisy`` rows, each of ``columns`` reads as :func:`noise_text`
    writes it (``near`` gives a column the value the noise is about, '~0' or '~1', instead of its own).

    The numbers stay in the saved results (with their spread where one was measured); what is printed
    as a finding is only what the measurement can tell apart.
    """
    flags = list(noisy)
    columns = [c for c in columns if c in df.columns]
    shown = df.astype({column: object for column in columns})
    for column in columns:
        for index, flagged in zip(shown.index, flags, strict=True):
            value = df.at[index, column]
            if flagged and is_measured(value):  # 'OOM', 'unsupported' or no value stay as they are
                shown.at[index, column] = noise_text(value, (near or {}).get(column))
    return shown


def print_table(df: pd.DataFrame, title: str, float_format: str = "{:.3g}") -> None:
    """A rich table on a terminal; where stdout is not one (a pipe, a file), the Markdown form, uncut.

    On a terminal no cell is ever cut: a table wider than the terminal is printed in parts, each
    holding the leading columns that name a row (:func:`key_columns`) and as many others as fit; a
    number is never folded, and only headers and text wrap, inside their cells.
    """
    if not console.is_terminal:
        console.print(f"\n{title}\n\n{to_markdown(df, float_format)}\n", markup=False, highlight=False,
                      soft_wrap=True)
        return
    cells = {str(c): [cell_text(v, float_format) for v in df[c]] for c in df.columns}
    numeric = {str(c): pd.api.types.is_numeric_dtype(df[c]) for c in df.columns}
    fractional = {str(c): any(map(_is_fraction, df[c])) for c in df.columns}  # times, say: no row names
    parts = column_parts(cells, console.width, fractional)
    for index, widths in enumerate(parts):
        suffix = f" (part {index + 1} of {len(parts)}, split to fit the terminal)" if len(parts) > 1 else ""
        console.print(title + suffix, markup=False, highlight=False, soft_wrap=False)  # wrapped between words
        table = Table()
        for column, width in widths.items():
            table.add_column(escape(column), justify="right" if numeric[column] else "left", overflow="fold",
                             width=width)
        for row in zip(*(cells[c] for c in widths), strict=True):
            table.add_row(*map(escape, row))
        console.print(table)


_TEXT_WRAP_WIDTH = 24  # a text cell longer than this may wrap inside its column (a number never does)
_CELL_FRAME = 3  # rich's padding on either side of a cell and the border after it


def _is_number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == UNDEFINED
    return True


def _is_fraction(value: Any) -> bool:
    """Whether a cell holds a number with a fractional part (a measurement, not a count or a size)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return is_measured(value) and not float(value).is_integer()


def _needed_width(header: str, texts: list[str]) -> int:
    """The narrowest a column may be with nothing cut: every number whole, the header's longest word whole,
    text cells wrapped at _TEXT_WRAP_WIDTH at most."""
    words = max((len(word) for word in header.split()), default=1)
    numbers = max((len(t) for t in texts if _is_number_text(t)), default=0)
    text = min(max((len(t) for t in texts if not _is_number_text(t)), default=0), _TEXT_WRAP_WIDTH)
    return max(words, numbers, text, 1)


def _comfortable_width(header: str, texts: list[str]) -> int:
    """A column's width with its header on one line and its cells unwrapped."""
    return max(len(header), *(len(t) for t in texts), 1)


def key_columns(cells: dict[str, list[str]], width: int, fractional: dict[str, bool]) -> list[str]:
    """The columns that name a row, repeated in every part of a table too wide for the terminal: the
    leading ones up to the first holding a fraction (such as a time), or, where a table opens with
    measurements and names its rows last (a kernel summary's Name), its text columns; as many of them as
    fit in 40% of its width."""
    keys: list[str] = []
    for column in cells:
        if fractional[column]:
            break
        keys.append(column)
    if not keys:
        keys = [c for c in cells if not any(map(_is_number_text, cells[c]))]
    keys = keys[:-1] if len(keys) == len(cells) else keys
    while keys[1:] and sum(_needed_width(k, cells[k]) + _CELL_FRAME for k in keys) > 0.4 * width:
        constant = [k for k in keys if len(set(cells[k])) == 1]  # the first part shows those
        keys.remove(constant[0] if constant else keys[-1])
    return keys or list(cells)[:1]


def column_parts(cells: dict[str, list[str]], width: int,
                 fractional: dict[str, bool]) -> list[dict[str, int]]:
    """Each part a table is printed in at ``width`` (terminal columns), as {column: its width}: one part
    where the columns fit, else the key columns and, in order, as many of the others as fit beside them
    (at least one each); the room left in a part widens its columns towards unwrapped headers and cells."""
    comfortable = {c: _comfortable_width(c, texts) for c, texts in cells.items()}
    if sum(comfortable.values()) + _CELL_FRAME * len(cells) + 1 <= width:
        return [comfortable]
    needed = {c: _needed_width(c, texts) for c, texts in cells.items()}
    keys = key_columns(cells, width, fractional)
    room = width - 1 - sum(needed[k] + _CELL_FRAME for k in keys)  # what the other columns of a part get
    cost = {c: needed[c] + _CELL_FRAME for c in cells}
    groups: list[list[str]] = []
    for column in (c for c in cells if c not in keys):
        if not groups or sum(cost[c] for c in groups[-1]) + cost[column] > room:
            groups.append([])
        groups[-1].append(column)
    parts = []
    order = list(cells)
    for group in groups or [[]]:
        widths = {c: needed[c] for c in sorted([*keys, *group], key=order.index)}  # the table's own order
        spare = width - 1 - sum(w + _CELL_FRAME for w in widths.values())
        for column in sorted(widths, key=lambda c: comfortable[c] - widths[c]):  # most headers whole
            grow = max(0, min(comfortable[column] - widths[column], spare))
            widths[column] += grow
            spare -= grow
        parts.append(widths)
    return parts


def is_oom(exc: BaseException) -> bool:
    """Whether exc, or an error it wraps (torch.compile wraps the real one), ran out of memory: a GPU's
    (torch.OutOfMemoryError, Triton's OutOfResources) or the host's (torch's CPU allocator, MemoryError)."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, (torch.OutOfMemoryError, MemoryError)) or (
                isinstance(seen, RuntimeError) and any(sign in text for sign in OOM_MESSAGES)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def or_oom(fn: Callable[[], T]) -> T | str:
    """fn(), or the cell 'OOM' if it ran out of memory, a device's or the host's (:func:`is_oom`; memory is
    freed before returning)."""
    try:
        return fn()
    except Exception as exc:
        if not is_oom(exc):
            raise
        free_device_memory()
        return OOM


def free_device_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def held_bytes(tensors: Iterable[Any], device: torch.device) -> int:
    """Bytes of the distinct tensors among ``tensors`` that this rank holds on ``device``: a DTensor counts
    its local shard; non-tensors and 0-dim tensors (optimizers' step counters) do not count."""
    from torch.distributed.tensor import DTensor

    seen = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device == device:
            seen[(t.data_ptr(), t.nbytes)] = t.nbytes
    return sum(seen.values())


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """--device for the multi-process benchmarks; choose_device reads it."""
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default=None,
        help="default: cuda (NCCL) when there is a GPU per worker, else cpu (gloo)",
    )  # fmt: skip


def choose_device(parser: argparse.ArgumentParser, args: argparse.Namespace, workers: int) -> bool:
    """Settles args.device (where --device was left out: cuda when there is a GPU per worker, else cpu)
    and args.backend (NCCL on CUDA, else gloo); whether the run is on CUDA."""
    gpus = torch.cuda.device_count()
    if args.device is None:
        args.device = "cuda" if 0 < workers <= gpus else "cpu"
        if 0 < gpus < workers:
            console.print(f"[yellow]{gpus} GPU(s) for {workers} workers: running {workers} CPU processes")
    elif args.device == "cuda":
        require_gpus(parser, workers)
    args.backend = "nccl" if args.device == "cuda" else "gloo"
    return args.device == "cuda"


def require_gpus(parser: argparse.ArgumentParser, needed: int) -> None:
    """The one-line error of --device cuda where this machine has fewer than ``needed`` CUDA GPUs."""
    gpus = torch.cuda.device_count()
    if gpus < needed:
        what = "a CUDA GPU" if needed == 1 else f"a GPU per worker ({needed})"
        parser.error(f"--device cuda needs {what}; this machine has {gpus}")


def progress() -> Progress:
    """A rich progress bar for a sweep: `with progress() as p: for x in p.track(items, description=...)`."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


# --- argparse types: every experiment's options are checked with these, before any work -------------

def _number(kind: Callable[[str], T], text: str) -> T:
    try:
        value = kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _bounded(kind: Callable[[str], T], low: float, above: bool, doc: str) -> Callable[[str], T]:
    """An argparse type: ``kind`` of ``text``, at least ``low`` (above it where ``above``)."""

    def check(text: str) -> T:
        value = _number(kind, text)
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {low}, got {text}")
        return value

    check.__doc__ = doc
    return check


positive_int = _bounded(int, 1, False, "argparse type for a count of at least 1 (sizes, steps, ranks).")
nonnegative_int = _bounded(int, 0, False, "argparse type for a count that may be 0 (warm-up steps).")
positive_float = _bounded(float, 0, True, "argparse type for a finite quantity above 0 (times, bandwidths).")
nonnegative_float = _bounded(float, 0, False, "argparse type for a finite quantity that may be 0.")


def _items(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected at least one value, got {text!r}")
    return items


def _int_list(text: str, minimum: int) -> list[int]:
    values = [_number(int, x) for x in _items(text)]
    bad = [v for v in values if v < minimum]
    if bad:
        raise argparse.ArgumentTypeError(f"every value must be at least {minimum}, "
                                         f"got {', '.join(map(str, bad))}")
    return values


def int_list(text: str) -> list[int]:
    """argparse type for '128,256,512': at least one item, each a whole number of at least 1."""
    return _int_list(text, 1)


def nonnegative_int_list(text: str) -> list[int]:
    """argparse type for '0,4096': at least one item, each a whole number of at least 0."""
    return _int_list(text, 0)


def float_list(text: str) -> list[float]:
    """argparse type for '1,2.5,100': at least one item, each a finite number of at least 0."""
    values = [_number(float, x) for x in _items(text)]
    bad = [v for v in values if v < 0]
    if bad:
        raise argparse.ArgumentTypeError(f"every value must be at least 0, got {', '.join(map(str, bad))}")
    return values


def results_name(text: str) -> str:
    """argparse type for a results file's name (``--name``): letters, digits, '.', '_' and '-', not starting
    with '.' (no path, no hidden file, never empty: '' would fall back to the default name and replace it)."""
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", text):
        raise argparse.ArgumentTypeError("expected a file name of letters, digits, '.', '_' and '-' "
                                         f"(no folder, not starting with '.'), got {text!r}")
    return text


def compile_backend(text: str) -> str:
    """argparse type for torch.compile's ``backend=``: a name torch._dynamo has registered (debug ones too),
    checked before any model is built."""
    if text == "inductor":  # torch.compile's default is always there: no need to import dynamo to know
        return text
    from torch._dynamo import list_backends

    if text not in list_backends(exclude_tags=()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch.compile backend (torch._dynamo."
                                         f"list_backends(): {', '.join(list_backends())}; debug ones such as "
                                         "eager and aot_eager too)")
    return text


def str_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """argparse type for 'a,b': at least one item, each among choices ('all' means every choice)."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        items = allowed if text.strip() == "all" else _items(text)
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)} not among {', '.join(allowed)} (or 'all')")
        return items

    return parse


def median_time(values: list[float | str]) -> float | str:
    """The median of a cell's timed repeats; the first repeat's reason (OOM, skipped, capture failed, ...)
    if none was timed."""
    times = [v for v in values if isinstance(v, float)]
    return statistics.median(times) if times else values[0]


def as_cell(value: Any, digits: int = 3) -> Any:
    """Round floats for tables; leave 'OOM' and other strings alone."""
    return round(value, digits) if isinstance(value, float) else value
