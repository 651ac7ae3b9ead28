import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import profkit
from profkit.__main__ import main
from profkit.tables import format_table, wants_markdown


def traced_step(tmp_path):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(4, 16)

    def step(phase):
        with phase("forward"):
            loss = model(x).sum()
        with phase("backward"):
            loss.backward()

    return profkit.trace(step, path=tmp_path / "one.json.gz", warmup=1, steps=2)


def rank_trace(path, rank, gloo_start_ms, event):
    gloo = event(
        "gloo:all_reduce",
        gloo_start_ms,
        14,
        tid=2,
        cat="user_annotation",
        **{"Input Dims": [[1000]], "Input type": ["float"]},
    )
    document = {
        "traceEvents": [event("aten::mm", 0, 10), gloo],
        "profkit": {"rank": rank, "world_size": 2, "steps": 1},
    }
    path.write_text(json.dumps(document))
    return path


def test_summarize_one_trace_prints_phase_tables(tmp_path, capsys):
    path = traced_step(tmp_path)
    main(["summarize", str(path), "--markdown", "--limit", "2"])
    out = capsys.readouterr().out
    assert "one.json.gz: cpu ops per phase, per step (2 steps)" in out
    assert "| forward " in out and "| backward " in out and "**forward: top 2**" in out
    assert "aten::addmm" in out


def test_summarize_several_ranks_prints_the_communication_table(tmp_path, capsys, chrome_event):
    a, b = (
        rank_trace(tmp_path / "r0.json", 0, 10.5, chrome_event),
        rank_trace(tmp_path / "r1.json", 1, 12, chrome_event),
    )
    main(["summarize", str(a), str(b), "--plain"])
    out = capsys.readouterr().out
    assert "Communication (cpu, per step)" in out and "Straggler: rank 1" in out
    row = next(line for line in out.splitlines() if line.startswith("0 "))
    assert row.split()[:6] == ["0", "-", "10", "3.5", "3.5", "0"]  # rank step compute comm exposed overlap


def test_memory_prints_the_breakdown_and_draws_the_timeline(tmp_path, capsys):
    forward = {"filename": "/repo/model.py", "line": 3, "name": "forward"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 2**20, "frames": [forward]},
        {"action": "alloc", "addr": 2, "size": 2**19, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 2**20, "frames": []},
    ]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    main(["memory", str(path), "--plain"])
    out = capsys.readouterr().out
    assert "Memory at the peak, by category (snapshot)" in out
    activations = next(line for line in out.splitlines() if line.startswith("activations"))
    assert activations.split()[1] == "1.049"  # MB
    assert (tmp_path / "s.png").stat().st_size > 0 and "pytorch.org/memory_viz" in out


def test_errors_exit_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["memory", str(tmp_path / "missing.pickle")])
    assert exc.value.code == 2 and "missing.pickle" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["summarize", str(tmp_path / "none.json"), "--limit", "0"])


def test_piped_output_is_markdown(tmp_path, chrome_event):
    a, b = (
        rank_trace(tmp_path / "r0.json", 0, 10.5, chrome_event),
        rank_trace(tmp_path / "r1.json", 1, 12, chrome_event),
    )
    src = str(Path(profkit.__file__).parents[1])
    result = subprocess.run(
        [sys.executable, "-m", "profkit", "summarize", str(a), str(b)],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": src, "PATH": ""},
    )
    assert "| rank |" in result.stdout and "|---" in result.stdout


def test_format_table_aligns_numbers_in_both_styles():
    rows = [{"name": "a", "ms": 1.5}, {"name": "bb", "ms": 12.25}]
    assert format_table(rows, markdown=False).splitlines() == [
        "name     ms",
        "----  -----",
        "a       1.5",
        "bb    12.25",
    ]
    assert format_table(rows, markdown=True).splitlines()[1] == "|------|------:|"
    assert wants_markdown(open(__file__))  # a file is not a terminal
