"""The code as it was when issue 32 was filed, run side by side with today's.

Why: issue 32 sets its restart and start-up goals as ratios to "today's", meaning the code that
measured R = 24.3 s and a 43 s start-up (P8, 2026-11-30, commit ``FILED_AT``). A number quoted from
that day is not side by side, because the machine's load moves these times by a third between runs.
So the benches that claim those ratios run that commit too, in the same run, interleaved with
today's code.

How: ``git archive`` of the commit into a temporary directory, run with this virtual environment's
Python (the same pins of Ray, torch and DeepSpeed). DeepSpeed's CPU op is built into a cache of its
own (``OPS_DIR``): run from one cache, the two codes rebuilt it for each other at every switch
(measured: a 42 s JIT build in each variant that followed the other, in both start-ups), so a
bench builds each code's op once, untimed, and ``op_builds`` says whether any build fell inside
what it timed.
That commit's packages are top-level (``orchestrator``, ``workers``, ``policies``), so with the
checkout as the working directory they import without touching ``syncpoint``. Its event logs are
the format today's ``EventLog`` reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS_DIR = ROOT / ".venv" / "torch_extensions_as_filed"  # the checkout's DeepSpeed op cache
FILED_AT = "28bd74a"  # P8's full run of 2026-11-30 (R 24.29 s, start-up 43.36 s), which issue 32 quotes

_RUN = textwrap.dedent(
    """
    import json, sys
    from orchestrator.ray_runner import run_on_ray
    from orchestrator.spec_file import load_spec, resolve_storage
    sys.exit(run_on_ray(resolve_storage(load_spec(sys.argv[1], json.loads(sys.argv[2])))))
    """
)


@contextlib.contextmanager
def checkout(commit: str = FILED_AT) -> Iterator[Path]:
    """The commit's files in a temporary directory (removed afterwards)."""
    with tempfile.TemporaryDirectory(prefix=f"syncpoint-as-filed-{commit}-") as tmp:
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def run_job(where: Path, overrides: list[str], timeout_s: float = 900.0) -> int:
    """Run the checkout's example job with ``--set``-style overrides on an embedded local Ray (its
    ``run_on_ray``, as ``syncpoint run`` does); returns the exit code. Its output goes to stderr."""
    env = environ()
    proc = subprocess.run(
        [sys.executable, "-c", _RUN, str(where / "examples" / "tiny_lm.yaml"), json.dumps(overrides)],
        cwd=where,
        env=env,
        stdout=sys.stderr,
        stderr=sys.stderr,
        timeout=timeout_s,
    )
    return proc.returncode


def cli_command() -> list[str]:
    """The checkout's ``syncpoint`` command: its ``orchestrator.cli``, run with the checkout as the
    working directory."""
    return [sys.executable, "-m", "orchestrator.cli"]


def environ() -> dict[str, str]:
    """The checkout's environment: this one without ``PYTHONPATH`` (which names today's packages),
    with the checkout's own op cache."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_EXTENSIONS_DIR"] = str(OPS_DIR)
    return env


def op_builds() -> int:
    """How many build steps DeepSpeed's JIT has logged so far, in today's op cache and the
    checkout's (ninja's logs): a difference across a timed phase is a build inside it."""
    from torch.utils.cpp_extension import get_default_build_root

    roots = {os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), str(OPS_DIR)}
    return sum(
        sum(1 for line in log.read_text(errors="replace").splitlines() if not line.startswith("#"))
        for root in roots
        for log in Path(root).glob("**/.ninja_log")
    )
