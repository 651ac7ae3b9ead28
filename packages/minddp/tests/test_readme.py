"""The README's examples (join(), the bucket rebuild, fully_shard) run as their comments say and print
their lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import minddp

README = Path(__file__).parents[1] / "README.md"


def python_block(first_line: str) -> str:
    """The README's ```python block whose first line starts with ``first_line``."""
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"README.md has no python block starting with {first_line!r}")


def run_example(script: Path, launcher: tuple[str, ...] = ()) -> str:
    """``python [launcher] script`` in the script's folder (minddp importable); its stdout."""
    source = str(Path(minddp.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    # The timeout is a hang guard, as generous as the suite's others: the examples take seconds.
    done = subprocess.run([sys.executable, *launcher, script.name], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def run_under_torchrun(script: Path, nproc: int) -> str:
    """``torchrun --nproc-per-node nproc script`` in the script's folder (minddp importable); its stdout."""
    return run_example(script, ("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"))


def test_the_join_example_runs(tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(python_block("# uneven.py"))
    assert "after uneven inputs, both replicas hold" in run_example(script)


def test_the_fully_shard_example_is_an_fsdp2_script_with_another_import(tmp_path):
    """The example, and the same file with torch's import line instead of minddp's, print the same line."""
    example = python_block("# fsdp_train.py")
    assert "# from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard\n" in example
    with_torch = example.replace("# from torch.distributed.fsdp", "from torch.distributed.fsdp").replace(
        "from minddp import", "# from minddp import")
    outputs = []
    for name, source in (("minddp", example), ("torch", with_torch)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "fsdp_train.py").write_text(source)
        outputs.append(run_under_torchrun(folder / "fsdp_train.py", 2))
        assert (folder / "model.pt").exists()
    assert "step 9: loss" in outputs[0] and "FSDPSequential, weight (Shard(dim=0),)" in outputs[0]
    assert outputs[0] == outputs[1]


def test_the_bucket_rebuild_example_prints_what_its_comments_say(tmp_path):
    script = tmp_path / "rebuild.py"
    script.write_text(python_block("# rebuild.py"))
    assert run_example(script).splitlines() == ["['embed.bias']", "['head.bias']"]
