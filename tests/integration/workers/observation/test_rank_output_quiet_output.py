"""Quiet by default (issue 50), on real spawned ranks recovering in place (as on Ray, without Ray):
every rank's prints, prefixed, with ``train.prints: all``. (A task's print once, rank 0's, and one traceback
for a bug on every rank: tests/integration/orchestrator/test_local_runner.py, through ``syncpoint run --local``.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # two ranks start, each with its training processes

RUN = """
import sys
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import linear_spec

storage, prints, fail_at = sys.argv[1:]
spec = linear_spec(storage, "task.path=tests.tasks:loud_failing", f"task.config.fail_at={fail_at}",
                   "failure.max_failures=3", f"train.prints={prints}", workers=2)
print("EXIT", run_spawned(spec, in_place=True), flush=True)
"""


def _run(tmp_path, prints: str, fail_at: int) -> str:
    r = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path / prints), prints, str(fail_at)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r.stdout + r.stderr


# make test: own_output prefixes every rank's line (tests/unit/workers/observation/test_rank_output.py), and a bug
# on every rank through `syncpoint run --local` (tests/integration/orchestrator/test_local_runner.py) walks
# train.prints into spawned ranks recovering in place
@pytest.mark.long
def test_every_ranks_prints_with_its_rank_when_asked(tmp_path):
    out = _run(tmp_path, "all", 10**9)
    assert "EXIT [0, 0]" in out, out[-4000:]  # a run that finishes: every rank ends by itself
    built = sorted(ln for ln in out.splitlines() if "task built: " in ln)
    assert built == ["[rank 0] task built: 49 parameters", "[rank 1] task built: 49 parameters"], out
    assert "Traceback" not in out, out
