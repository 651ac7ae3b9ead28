import os
import stat

import pytest

import profkit
from profkit import nsys


def test_command_traces_cuda_nvtx_and_pytorch_ranges():
    command = profkit.nsys_command(["python", "-m", "benchmarks.e2e", "--size", "small"], "out/e2e")
    assert command[:2] == ["nsys", "profile"]
    assert "--trace=cuda,nvtx,osrt" in command
    assert "--pytorch=autograd-nvtx" in command
    assert "--output=out/e2e" in command and "--stats=true" in command
    assert command[-5:] == ["python", "-m", "benchmarks.e2e", "--size", "small"]


def test_command_options():
    command = nsys.nsys_command(["x"], "o", pytorch=None, capture_range="cudaProfilerApi", stats=False,
                                extra=["--sample=none"])
    assert not any(c.startswith("--pytorch") for c in command)
    assert "--capture-range=cudaProfilerApi" in command and "--stats=false" in command
    assert command[-2:] == ["--sample=none", "x"]
    with pytest.raises(ValueError, match="program"):
        nsys.nsys_command([], "o")


def test_missing_nsys_gives_a_clear_message(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(profkit.NsysNotFoundError, match="not on the PATH"):
        profkit.run_nsys(["python", "-c", "pass"], "o")
    with pytest.raises(SystemExit) as exit_info:
        nsys.main(["--", "python", "-c", "pass"])
    assert exit_info.value.code == 2
    assert "nsys (Nsight Systems) is not on the PATH" in capsys.readouterr().err


def test_dry_run_prints_the_command_without_nsys(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "")
    assert nsys.main(["--dry-run", "--output", "r", "--pytorch", "none", "--", "python", "t.py"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.split() == ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--stats=true",
                           "--force-overwrite=true",
                           "--output=r", "python", "t.py"]


def test_runs_the_nsys_found_on_path(tmp_path, monkeypatch):
    log = tmp_path / "args.txt"
    fake = tmp_path / "nsys"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    profkit.run_nsys(["python", "train.py"], tmp_path / "rep")
    args = log.read_text().split()
    assert args[0] == "profile" and args[-2:] == ["python", "train.py"]


def test_main_requires_a_program(capsys):
    with pytest.raises(SystemExit):
        nsys.main(["--dry-run"])
    assert "program" in capsys.readouterr().err
