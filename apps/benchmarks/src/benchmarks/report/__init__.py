"""A report and its plots from every results file, with a section per experiment (by default from out/ into
out/report.md; ``--results-dir results --out docs/report.md`` rebuilds the committed one).

Reads ``<results-dir>/<device>/<name>.csv`` (metadata in leading ``# key: value`` lines). For each
experiment it picks one device's results (a GPU's over the CPU's; the latest run among GPUs),
shows the tables, the metadata and the command that regenerates them, draws plots beside the
report, and states what the numbers say, computed from the data. An experiment without results
gets a line saying which command to run. Needs no GPU.

Each experiment's section is a module of this package; :mod:`benchmarks.report.registry` lists
them in order and says how to add one.
"""

from __future__ import annotations

from benchmarks.report.allreduce import LinkFit, fit_allreduce
from benchmarks.report.build import build_report, main
from benchmarks.report.core import Context, ResultFile, Section, load_results
from benchmarks.report.registry import SECTIONS

TOUR_ARGS: list[str] = []  # the tour adds --out <its results dir>/report.md (never docs/report.md)

__all__ = ["SECTIONS", "TOUR_ARGS", "Context", "LinkFit", "ResultFile", "Section", "build_report",
           "fit_allreduce", "load_results", "main"]
