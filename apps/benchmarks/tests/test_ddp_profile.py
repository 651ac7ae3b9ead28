import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.common import read_results

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_profile.py"


def test_profile_script_times_the_hooks_of_minddp_and_not_of_torch_ddp_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--batch", "1", "--context", "16",
                          "--warmup", "1", "--steps", "2", "--configs", "single,naive,bucketed,torch",
                          "--nproc", "2", "--results-dir", str(tmp_path)],
                         capture_output=True, text=True, check=True,
                         timeout=900).stdout  # a hang guard; it takes seconds
    lines = out.splitlines()
    header = next(line for line in lines if "step ms" in line).split("  ")
    columns = [c.strip() for c in header if c.strip()]
    rows = {line.split()[0]: dict(zip(columns, map(float, line.split()[1:]), strict=True))
            for line in lines if line.split() and line.split()[0] in ("single", "naive", "bucketed", "torch")}
    assert list(rows) == ["single", "naive", "bucketed", "torch"]
    assert all(row["step ms"] > 0 for row in rows.values())
    for minddp in ("naive", "bucketed"):  # every gradient's hook and the end-of-backward callback ran
        assert rows[minddp]["hooks ms"] > 0 and rows[minddp]["callback ms"] > 0
    for bare in ("single", "torch"):
        assert rows[bare]["hooks ms"] == rows[bare]["callback ms"] == 0
    assert rows["single"]["overhead ms"] == 0
    saved, meta = read_results(tmp_path / "cpu" / "ddp_profile.csv")
    assert meta["ranks"] == "2" and list(saved["config"]) == list(rows)
    assert saved["step ms"].tolist() == pytest.approx([rows[c]["step ms"] for c in rows], abs=0.01)


def kernel(name: str, start_us: float, end_us: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                           time_range=SimpleNamespace(start=start_us, end=end_us,
                                                      elapsed_us=lambda: end_us - start_us))


def test_nccl_time_counts_as_exposed_only_where_no_other_kernel_runs():
    spec = importlib.util.spec_from_file_location("ddp_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    events = [kernel("ampere_sgemm", 0, 10_000), kernel("ncclDevKernel_AllReduce", 5_000, 15_000),
              kernel("vectorized_elementwise_copy", 12_000, 13_000),  # inside the first NCCL kernel
              kernel("ncclDevKernel_AllReduce", 20_000, 22_000)]
    times = module.device_times(SimpleNamespace(events=lambda: events), step_ms=30.0)
    # NCCL runs 12 ms; alone from 10 to 12, 13 to 15 and 20 to 22 ms.
    assert times["nccl ms"] == 12.0 and times["nccl exposed ms"] == 6.0
    assert times["nccl hidden %"] == pytest.approx(50.0)
    assert times["idle ms"] == 30.0 - 17.0
