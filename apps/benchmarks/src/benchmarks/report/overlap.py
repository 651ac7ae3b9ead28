"""Communication overlap from traced runs, shared by the data-parallel sections: a sentence and a panel."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd

from benchmarks.report.core import Context, axes, numeric, style

# The columns benchmarks.fsdp and benchmarks.shardopt take from their traces.
TRACED_COLUMNS = ["comm_ms", "exposed_comm_ms", "overlap_pct"]


def overlap_lines(ctx: Context, labels: Sequence[str], df: pd.DataFrame, figure: str,
                  caption: str) -> list[str]:
    """Each case's communication per iteration (df's TRACED_COLUMNS), overlapped and exposed: a sentence and
    a plot."""
    traced = [df[c] for c in TRACED_COLUMNS]
    sentence = overlap_sentence(labels, *traced, unit="iteration")
    if sentence is None:
        return []
    fig, (ax,) = axes(1)
    overlap_panel(ax, labels, *traced, unit="iteration")
    return [sentence, "", ctx.figure(figure, fig, caption)]


def overlap_sentence(labels: Sequence[str], comm: pd.Series, exposed: pd.Series, overlap: pd.Series,
                     unit: str = "step") -> str | None:
    """'- Communication from the traces, per step and rank (...): a 5 of 20 ms exposed (75% overlapped).'"""
    parts = [f"{label} {e:.3g} of {c:.3g} ms exposed ({o:.0f}% overlapped)"
             for label, c, e, o in zip(labels, numeric(comm), numeric(exposed), numeric(overlap), strict=True)
             if c > 0 and not math.isnan(o)]
    if not parts:
        return None
    return (f"- Communication from the traces, per {unit} and rank (exposed: a collective runs and no "
            "compute does): " + ", ".join(parts) + ".")


def overlap_panel(ax: plt.Axes, labels: Sequence[str], comm: pd.Series, exposed: pd.Series,
                  overlap: pd.Series, unit: str = "step") -> None:
    """Each run's communication, split into overlapped and exposed, with the overlap % at its end."""
    comm, exposed = numeric(comm).fillna(0).to_numpy(), numeric(exposed).fillna(0).to_numpy()
    labels = list(labels)
    ax.barh(labels, comm - exposed, color="tab:green", label="overlapped with compute")
    ax.barh(labels, exposed, left=comm - exposed, color="tab:red", label="exposed")
    for y, (total, pct) in enumerate(zip(comm, numeric(overlap), strict=True)):
        if not math.isnan(pct):
            ax.annotate(f"{pct:.0f}%", (total, y), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=8)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    style(ax, f"communication per {unit} and rank (ms), from traces", "", "Overlap of communication",
          logx=False, logy=False)
