"""profkit's command line: summarize traces, break down memory snapshots.

    python -m profkit summarize trace_rank0.json.gz [trace_rank1.json.gz ...]
    python -m profkit memory step.pickle [--png step.png]

Tables are Markdown when the output is a pipe or a file, aligned text in a terminal (``--markdown``
/ ``--plain`` choose).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from profkit.breakdown import memory_breakdown
from profkit.comm import analyze_comm
from profkit.kernels import DEFAULT_PHASES, events_from_chrome, summarize_kernels
from profkit.memory import load_snapshot, render_memory_timeline
from profkit.tables import format_table
from profkit.traces import PROFKIT_TRACK, load_trace, trace_files

_STEP = re.compile(r"^(?:step|warmup) \d+$")
MEMORY_VIZ = ("open it at https://pytorch.org/memory_viz (drop the file on the page: it is read in your "
              "browser, not uploaded), or write a page that embeds it: python -m torch.cuda._memory_viz "
              "trace_plot SNAPSHOT -o trace.html (the page loads the viewer's script from the web)")


def phases_of(document: dict[str, Any]) -> tuple[str, ...]:
    """The names on the trace's profkit track, in order of first use, less step ranges; else the defaults."""
    tracks = {e.get("tid") for e in document["traceEvents"]
              if e.get("ph") == "M" and e.get("name") == "thread_name"
              and str(e.get("args", {}).get("name", "")).startswith(PROFKIT_TRACK)}
    ranges = sorted((e for e in document["traceEvents"] if e.get("ph") == "X" and e.get("tid") in tracks),
                    key=lambda e: e["ts"])
    names = dict.fromkeys(str(e["name"]) for e in ranges if not _STEP.match(str(e["name"])))
    return tuple(names) or DEFAULT_PHASES


def _shorten(name: str, width: int = 90) -> str:
    """A kernel name cut to ``width`` characters (CUDA template names run to a thousand)."""
    return name if len(name) <= width else name[: width - 1] + "…"


def summarize(paths: Sequence[str], markdown: bool | None, limit: int) -> str:
    files = trace_files(paths)
    if not files:
        raise SystemExit("summarize: no trace files found in " + ", ".join(paths))
    documents = [load_trace(f) for f in files]
    parts = []
    for path, document in zip(files, documents, strict=True):
        steps = int(document.get("profkit", {}).get("steps", 1))
        report = summarize_kernels(events_from_chrome(document), phases_of(document), steps)
        parts.append(format_table(report.summary(), markdown,
                                  title=f"{path.name}: {report.source} per phase, per step ({steps} steps)"))
        if len(files) == 1:
            for phase, table in report.tables.items():
                rows = [{**row, "Name": _shorten(str(row["Name"]))} for row in table.rows(limit)]
                parts.append(format_table(rows, markdown, title=f"{phase}: top {limit}"))
    if len(files) > 1:
        parts.append(analyze_comm(documents).format(markdown))
    return "\n\n".join(parts)


def memory(snapshot: str, png: str | None, device: int | None, markdown: bool | None) -> str:
    data = load_snapshot(snapshot)  # once: both the breakdown and the timeline read it
    result = memory_breakdown(data, device=device)
    out = Path(png) if png else Path(snapshot).with_suffix(".png")
    timeline = render_memory_timeline(data, out, device=device)
    return "\n\n".join([
        result.format(markdown),
        f"Timeline: {out} (peak {timeline.peak_bytes / 2**20:.1f} MiB at event {timeline.peak_position:,} "
        f"of {timeline.events:,}). Without the model, parameters count as other: use "
        "profkit.memory_breakdown(snapshot, model=..., optimizer=...) in the process that owns them.",
        "Interactive: " + MEMORY_VIZ.replace("SNAPSHOT", snapshot),
    ])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m profkit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    output = argparse.ArgumentParser(add_help=False)
    style = output.add_mutually_exclusive_group()
    style.add_argument("--markdown", dest="markdown", action="store_true", default=None,
                       help="Markdown tables even in a terminal")
    style.add_argument("--plain", dest="markdown", action="store_false", help="aligned text even in a pipe")
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("summarize", parents=[output],
                            help="kernel (or CPU operator) summary per phase; with several ranks' traces, "
                                 "the communication table (compute, exposed comm, overlap, waits)")
    s.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.gz), or folders of them")
    s.add_argument("--limit", type=int, default=10,
                   help="kernels per phase table with one trace (default 10)")
    m = commands.add_parser("memory", parents=[output],
                            help="peak memory by category, and the active memory timeline as a PNG")
    m.add_argument("snapshot", help="a pickle from profkit.record_memory_history / torch's _dump_snapshot")
    m.add_argument("--png", default=None, help="where to draw the timeline (default: SNAPSHOT with .png)")
    m.add_argument("--device", type=int, default=None, help="CUDA device in the snapshot (default: busiest)")
    args = parser.parse_args(argv)
    try:
        if args.command == "summarize":
            if args.limit < 1:
                parser.error(f"--limit {args.limit}: must be >= 1")
            text = summarize(args.traces, args.markdown, args.limit)
        else:
            text = memory(args.snapshot, args.png, args.device, args.markdown)
    except (FileNotFoundError, ValueError) as exc:
        parser.exit(2, f"python -m profkit {args.command}: {exc}\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
