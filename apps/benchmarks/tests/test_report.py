import argparse
from pathlib import Path

import pandas as pd
import pytest

from benchmarks.common import save_results
from benchmarks.report import SECTIONS, build_report, main

H100 = "NVIDIA H100 80GB HBM3"


def write(results: Path, name: str, df: pd.DataFrame, device: str = H100, command: str | None = None,
          date: str = "2026-01-01 00:00 UTC") -> Path:
    """A results file exactly as an experiment writes it."""
    args = argparse.Namespace(results_dir=results, no_save=False,
                              command=command or f"python -m benchmarks.{name.split('_')[0]}")
    return save_results(df, name, args, metadata={"device": device, "date": date})


def section(report: str, title: str) -> str:
    """The text of one '## title' section."""
    start = report.index(f"## {title}\n")
    end = report.find("\n## ", start + 1)
    return report[start:] if end < 0 else report[start:end]


def title_of(key: str) -> str:
    return next(s.title for s in SECTIONS if s.key == key)


@pytest.fixture
def accounting_results(tmp_path):
    from benchmarks.accounting import main as accounting

    accounting(["--results-dir", str(tmp_path / "results"), "--ddp-size", "tiny"])
    return tmp_path / "results"


def test_missing_experiments_say_which_command_to_run(tmp_path):
    out, plots = build_report(tmp_path / "nothing", tmp_path / "docs" / "report.md")
    text = out.read_text()
    assert plots == []
    for s in SECTIONS:
        assert f"Not measured yet: run `{s.command}`." in section(text, s.title)


def test_main_writes_the_report_where_asked(tmp_path, accounting_results):
    out = tmp_path / "site" / "report.md"
    main(["--results-dir", str(accounting_results), "--out", str(out)])
    text = out.read_text()
    assert "python -m benchmarks.accounting --results-dir" in section(text, title_of("accounting"))
    assert (out.parent / "accounting_fsdp_memory.png").stat().st_size > 10_000


def test_precision_names_the_least_and_most_accurate_sum(tmp_path):
    results = tmp_path / "results"
    sums = {("float32", "float32"): 10.0001, ("float16", "float16"): 9.95, ("float32", "float16"): 10.002}
    write(results, "precision_accumulation",
          pd.DataFrame([{"accumulator": a, "addend": b, "sum": v} for (a, b), v in sums.items()]))
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("precision"))
    assert "Closest to 10: float32 accumulator, float32 addends" in text
    assert "Farthest: float16 accumulator, float16 addends" in text
    assert f"{0.05 / 0.0001:,.0f}x the error" in text


def test_gpu_results_are_preferred_and_others_mentioned(tmp_path):
    results = tmp_path / "results"
    rows = pd.DataFrame([{"accumulator": "float32", "addend": "float32", "sum": 10.5}])
    write(results, "precision_accumulation", rows, device="cpu", date="2026-05-01 00:00 UTC")
    write(results, "precision_accumulation", rows.assign(sum=10.25), device=H100)
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("precision"))
    assert f"device **{H100}**" in text
    assert "10.25" in text and "10.5 " not in text
    assert "Results also exist for: cpu" in text


def test_accounting_statements_come_from_the_numbers(tmp_path, accounting_results):
    from benchmarks.common import read_results

    out, plots = build_report(accounting_results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("accounting"))
    fsdp, _ = read_results(accounting_results / "analytic" / "accounting_fsdp.csv")
    n_min = int(fsdp.set_index("symbol").loc["N_min(T=4096)", "value"])
    assert f"4,096 tokens: at least **{n_min}** devices" in text
    assert "16,384 tokens: no N fits under 95 GB" in text
    assert "compute-bound above **318.8 tokens per chip**, an overall batch of **20,400 tokens**" in text
    assert {p.name for p in plots} == {"accounting_fsdp_memory.png", "accounting_ddp_buckets.png"}
    assert all(p.stat().st_size > 10_000 for p in plots)
    assert "![" in text and "(accounting_fsdp_memory.png)" in text


def test_a_section_that_cannot_be_analysed_still_shows_its_tables(tmp_path):
    results = tmp_path / "results"
    write(results, "accounting_tpu", pd.DataFrame({"symbol": ["B/N"], "something": [1.0]}), device="analytic")
    out, _ = build_report(results, tmp_path / "docs" / "report.md")
    text = section(out.read_text(), title_of("accounting"))
    assert "something" in text  # the table
    assert "The summary: not possible, the results lack B/N" in text
