import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_profile.py"


def test_profile_script_times_the_hooks_of_minddp_and_not_of_torch_ddp_on_cpu():
    out = subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--batch", "1", "--context", "16",
                          "--warmup", "1", "--steps", "2", "--configs", "single,naive,bucketed,torch"],
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
