"""The main job: a short run of every experiment this machine supports, printing each table.

Each experiment module has ``main(argv)`` and ``TOUR_ARGS``, the arguments of its short run
(small CPU sizes without a GPU; the experiment picks real sizes when it finds one).

Without a GPU the tour shows that every experiment runs end to end; its timings are a few
steps of tiny models on shared CPU cores, and it says so. Where a table has a spread, a
difference within it prints as "~0 (noise)", not as a finding.
"""

from __future__ import annotations

import importlib
import shlex
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import NothingMeasured, ResultsNotSaved, console, make_parser, parse_args, str_list

CPU_NOTE = ("[bold yellow]No GPU: these timings are noise-level[/bold yellow] (a few steps of tiny models "
            "on shared CPU cores). What a CPU run shows is that each experiment runs, its correctness, "
            "memory and structure; speed needs a GPU. A timing that the noise rule flags (negative, within "
            "its spread, or a fwd+bwd below its fwd) prints with '(noise)', and no sign or ratio is read "
            "from it. Performance figures come from GPU runs (docs/report.md).")
# The report comes last: it reads what the others wrote.
EXPERIMENTS = ["precision", "e2e", "attention", "flash", "checkpointing", "allreduce", "ddp", "shardopt",
               "fsdp", "accounting", "report"]


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("tour", __doc__)
    parser.set_defaults(results_dir="out/tour")
    parser.add_argument("--only", type=str_list(EXPERIMENTS), default=",".join(EXPERIMENTS),
                        help="comma-separated experiments to run, in this order")
    args = parse_args(parser, argv)
    names = args.only
    shared = ["--results-dir", str(args.results_dir)] + (["--no-save"] if args.no_save else [])
    if not torch.cuda.is_available():
        console.print(CPU_NOTE, soft_wrap=False)  # wrapped between words at the terminal's width
    outcomes = []
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        console.rule(f"[bold]{name}")
        beside = ["--out", str(Path(args.results_dir) / "report.md")] if name == "report" else []
        argv = [*module.TOUR_ARGS, *shared, *beside]
        command = shlex.join(["python", "-m", f"benchmarks.{name}", *argv])
        console.print(f"$ {command}", markup=False, highlight=False, soft_wrap=True)  # whole, on its own line
        start = time.perf_counter()
        try:
            status = module.main(argv)
            ok = not (isinstance(status, int) and status != 0)  # mains return an exit status, a table or None
            outcomes.append((name, "ok" if ok else "FAILED", time.perf_counter() - start))
        except (Exception, ResultsNotSaved, NothingMeasured):  # a save failed or refused: only this one ends
            # as text: a gloo traceback's '[/.../pair.cc:537]' is not markup
            console.print(traceback.format_exc(), style="red", markup=False, highlight=False)
            outcomes.append((name, "FAILED", time.perf_counter() - start))
    console.rule("[bold]tour")
    width = max(len(name) for name, _, _ in outcomes) if outcomes else 0
    for name, outcome, seconds in outcomes:
        console.print(f"{name:<{width}}  {outcome:<7} {seconds:7.1f} s")
    failed = [name for name, outcome, _ in outcomes if outcome != "ok"]
    console.print(f"{len(outcomes) - len(failed)} of {len(outcomes)} experiments ran"
                  + (f"; failed: {', '.join(failed)}" if failed else ""))
    if not torch.cuda.is_available():
        console.print(CPU_NOTE, soft_wrap=False)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
