"""What every experiment shares: device facts, result files with metadata, tables, OOM cells.

Results go to ``<results-dir>/<device>/<experiment>.csv`` (metadata as leading ``# key: value``
lines; read back with :func:`read_results`) with a Markdown copy beside it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import shlex
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()
T = TypeVar("T")
OOM = "OOM"


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
    """--help keeps the description's paragraphs as written and shows every option's default."""


def make_parser(experiment: str, description: str) -> argparse.ArgumentParser:
    """An experiment's parser (description: its module docstring), with the options every experiment has."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{experiment}", description=description,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=Path("results"),
                        help="write <results-dir>/<device>/<name>.csv and .md")
    parser.add_argument("--no-save", action="store_true", help="print the tables, write no files")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args that also records the command line (args.command) for the results' metadata."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.command = " ".join([parser.prog, *map(shlex.quote, argv)])
    return args


def save_results(df: pd.DataFrame, name: str, args: argparse.Namespace,
                 metadata: dict[str, str] | None = None) -> Path | None:
    """Write the table as <results-dir>/<device>/<name>.csv (metadata first) and .md; None with --no-save.

    ``args`` comes from :func:`parse_args`; ``metadata`` overrides or extends :func:`run_metadata`.
    """
    if args.no_save:
        return None
    meta = {**run_metadata(args.command), **(metadata or {})}
    folder = Path(args.results_dir) / device_slug(meta["device"])
    folder.mkdir(parents=True, exist_ok=True)
    csv_path = folder / f"{name}.csv"
    with csv_path.open("w") as f:
        for key, value in meta.items():
            f.write(f"# {key}: {value}\n")
        df.to_csv(f, index=False)
    header = "\n".join(f"- {key}: `{value}`" for key, value in meta.items())
    csv_path.with_suffix(".md").write_text(f"# {name}\n\n{header}\n\n{df.to_markdown(index=False)}\n")
    console.print(f"[dim]wrote {csv_path} and {csv_path.with_suffix('.md').name}[/dim]")
    return csv_path


def read_results(path: Path) -> tuple[pd.DataFrame, dict[str, str]]:
    """A results CSV and its metadata."""
    meta = {}
    with Path(path).open() as f:
        for line in f:
            if not line.startswith("# "):
                break
            key, _, value = line[2:].partition(": ")
            meta[key] = value.rstrip("\n")
    return pd.read_csv(path, skiprows=len(meta)), meta


def print_table(df: pd.DataFrame, title: str, float_format: str = "{:.3g}") -> None:
    table = Table(title=title, title_justify="left")
    for column in df.columns:
        numeric = pd.api.types.is_numeric_dtype(df[column])
        table.add_column(str(column), justify="right" if numeric else "left")
    for row in df.itertuples(index=False):
        table.add_row(*(float_format.format(v) if isinstance(v, float) else escape(str(v)) for v in row))
    console.print(table)


def is_oom(exc: BaseException) -> bool:
    """Whether exc, or an error it wraps (torch.compile wraps the real one), ran out of device memory."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen)
        if isinstance(seen, torch.OutOfMemoryError) or (
                isinstance(seen, RuntimeError) and ("out of memory" in text or "OutOfResources" in text)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def or_oom(fn: Callable[[], T]) -> T | str:
    """fn(), or the cell 'OOM' if it ran out of device memory (memory is freed before returning)."""
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


def progress() -> Progress:
    """A rich progress bar for a sweep: `with progress() as p: for x in p.track(items, description=...)`."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def int_list(text: str) -> list[int]:
    """argparse type for '128,256,512'."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type for a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def str_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """argparse type for 'a,b' whose items must be among choices ('all' means every choice)."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        items = allowed if text == "all" else [x for x in text.split(",") if x]
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(bad)} not among {', '.join(allowed)} (or 'all')")
        return items

    return parse


def as_cell(value: Any, digits: int = 3) -> Any:
    """Round floats for tables; leave 'OOM' and other strings alone."""
    return round(value, digits) if isinstance(value, float) else value
