"""The README's join() and bucket-rebuild examples run as their comments say and print their lines."""

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


def test_the_join_example_runs(tmp_path):
    script = tmp_path / "uneven.py"
    script.write_text(python_block("# uneven.py"))
    source = str(Path(minddp.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    # The timeout is a hang guard: the two processes start and train in seconds.
    done = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "after uneven inputs, both replicas hold" in done.stdout


def test_the_bucket_rebuild_example_prints_what_its_comments_say(tmp_path):
    script = tmp_path / "rebuild.py"
    script.write_text(python_block("# rebuild.py"))
    source = str(Path(minddp.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)  # a hang guard: it runs in seconds
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["['embed.bias']", "['head.bias']"]
