"""The report's sections, in the order they appear; ``python -m benchmarks.report`` walks this list.

Each experiment's section lives in its own module here (``benchmarks/report/<experiment>.py``)
and ends with one ``SECTION = Section(key, title, command, matches, render)``:

- ``key``: a short id (tests find a section's title by it);
- ``title``: the ``## heading`` in the report and its table of contents;
- ``command``: what to run when no results exist yet ("Not measured yet: run ...");
- ``matches(name) -> bool``: which result files are the section's, by file stem
  (``prefixed("fsdp")`` takes ``fsdp.csv`` and ``fsdp_<part>.csv``);
- ``render(ctx) -> list[str]``: the section's Markdown lines. ``ctx.files`` holds the section's
  files from one device (a GPU's over the CPU's, the latest among GPUs), ``ctx.get(name)`` one
  of them, ``ctx.table(f, title)`` a Markdown table with its csv link, ``ctx.figure(name, fig,
  caption)`` a plot saved beside the report. The build writes the heading, the metadata and
  the regenerating command before these lines; if ``render`` raises, the report says so and
  shows the section's tables instead, and the other sections are unaffected.

To add a section (say ``fsdp``): write ``benchmarks/report/fsdp.py`` with its ``render_fsdp`` and
``SECTION``, using the helpers of :mod:`benchmarks.report.core`; import the module below and put
its ``SECTION`` in ``SECTIONS`` where it should appear. A results file no section matches is
not shown; every section's files must be told apart by ``matches``.
"""

from __future__ import annotations

from benchmarks.report import (
    accounting,
    allreduce,
    attention,
    checkpointing,
    ddp,
    e2e,
    flash,
    fsdp,
    memory,
    precision,
    shardopt,
)
from benchmarks.report.core import Section

SECTIONS: list[Section] = [
    e2e.SECTION,
    attention.SECTION,
    flash.SECTION,
    precision.SECTION,
    memory.SECTION,
    checkpointing.SECTION,
    allreduce.SECTION,
    ddp.SECTION,
    shardopt.SECTION,
    fsdp.SECTION,
    accounting.SECTION,
]
