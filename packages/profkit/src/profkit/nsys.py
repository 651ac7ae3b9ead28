"""Build, and where Nsight Systems is installed run, the ``nsys profile`` command for any program.

    python -m profkit.nsys --output e2e -- python -m benchmarks.e2e --size small --nvtx
    python -m profkit.nsys --dry-run -- python train.py      # print the command only

The defaults capture what a PyTorch timeline needs: CUDA API and kernels, NVTX ranges (profkit's
and, through ``--pytorch=autograd-nvtx``, one per autograd operator), OS runtime calls, and the
summary tables (``--stats=true``, which prints the "CUDA GPU Kernel Summary").
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

DEFAULT_TRACE = "cuda,nvtx,osrt"
DEFAULT_PYTORCH = "autograd-nvtx"


class NsysNotFoundError(RuntimeError):
    """``nsys`` is not on the PATH."""


def nsys_command(program: Sequence[str], output: str | Path, trace: str = DEFAULT_TRACE,
                 pytorch: str | None = DEFAULT_PYTORCH, stats: bool = True,
                 capture_range: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The ``nsys profile`` argv that profiles ``program`` (an argv) into ``<output>.nsys-rep``.

    ``pytorch``: nsys' PyTorch annotation mode ("autograd-nvtx", "autograd-shapes-nvtx", or None).
    ``capture_range``: e.g. "cudaProfilerApi" to record only between
    ``torch.cuda.profiler.start()`` and ``stop()``. ``extra``: more nsys options, verbatim.
    """
    if not program:
        raise ValueError("program is empty: pass the command to profile, e.g. ['python', 'train.py']")
    if not trace:
        raise ValueError("trace is empty: name at least one API to trace, e.g. 'cuda,nvtx'")
    command = ["nsys", "profile", f"--trace={trace}"]
    if pytorch:
        command.append(f"--pytorch={pytorch}")
    if capture_range:
        command += [f"--capture-range={capture_range}", "--capture-range-end=stop"]
    command += [f"--stats={'true' if stats else 'false'}", "--force-overwrite=true", f"--output={output}"]
    return [*command, *extra, *program]


def find_nsys() -> str:
    """The path of ``nsys``, or :class:`NsysNotFoundError` saying what to do instead."""
    path = shutil.which("nsys")
    if path is None:
        raise NsysNotFoundError(
            "nsys (Nsight Systems) is not on the PATH. Install it "
            "(https://developer.nvidia.com/nsight-systems, or the CUDA toolkit's 'nsight-systems' package) "
            "or put its bin/ folder on the PATH. "
            "Without it, profkit.kernels.profile_phases gives per-phase kernel tables from torch.profiler."
        )
    return path


def run_nsys(program: Sequence[str], output: str | Path,
             **options: object) -> subprocess.CompletedProcess[bytes]:
    """Run ``program`` under ``nsys profile`` (see :func:`nsys_command` for ``options``)."""
    command = nsys_command(program, output, **options)  # type: ignore[arg-type]
    command[0] = find_nsys()
    return subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profkit.nsys", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--output", default="profile", help="report path, without .nsys-rep")
    parser.add_argument("--trace", default=DEFAULT_TRACE, help="APIs to trace (nsys --trace)")
    parser.add_argument("--pytorch", default=DEFAULT_PYTORCH,
                        help="nsys --pytorch mode; 'none' to leave it out")
    parser.add_argument("--capture-range", default=None, help="e.g. cudaProfilerApi")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="-- then the command to profile")
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("program: give the command to profile after --, e.g. -- python train.py")
    command = nsys_command(program, args.output, trace=args.trace,
                           pytorch=None if args.pytorch == "none" else args.pytorch,
                           capture_range=args.capture_range)
    print(shlex.join(command))
    if args.dry_run:
        return 0
    try:
        command[0] = find_nsys()
    except NsysNotFoundError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    return subprocess.run(command).returncode


if __name__ == "__main__":
    raise SystemExit(main())
