"""Quiet by default (issue 50), on real spawned ranks recovering in place (as on Ray, without Ray):
a task's print shows once (rank 0's) unless ``train.prints: all`` (then every rank's, prefixed), and a
bug that fails every rank prints one traceback, the other ranks' failures one line each."""

from __future__ import annotations

import re
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


def test_a_bug_on_every_rank_prints_one_traceback_and_the_task_prints_once(tmp_path):
    out = _run(tmp_path, "rank0", 3)
    codes = re.search(r"^EXIT \[(-?\d+), (-?\d+)\]$", out, re.MULTILINE)
    assert codes is not None and 0 not in map(int, codes.groups()), out[-4000:]  # 1, or killed by the launcher
    # generation 0 fails (on each rank that reached call 3 before its supervisor stopped it), is
    # retried in place, and fails again the same way: not retried
    assert out.count("Traceback (most recent call last)") == 1, out
    assert re.search(r"^\[syncpoint\] rank [01] failed:\nTraceback", out, re.MULTILINE), out
    assert out.count("ValueError: bad batch at call 3\n") == 1, out  # the traceback's last line
    assert len(re.findall(r"\] rank [01] failed again the same way: ValueError: bad batch at call 3", out)) == 1, out
    also = [ln for ln in out.splitlines() if " also failed: " in ln]
    assert all(re.match(r"\[syncpoint\] rank [01] also failed: ValueError: bad batch at call 3 at ", ln) for ln in also)
    built = [ln for ln in out.splitlines() if "task built: " in ln]
    assert built == ["task built: 49 parameters"] * 2, out  # rank 0's, once per generation; rank 1's dropped


# make test: own_output prefixes every rank's line (tests/unit/workers/observation/test_rank_output.py), and the
# test above walks train.prints into spawned ranks recovering in place
@pytest.mark.long
def test_every_ranks_prints_with_its_rank_when_asked(tmp_path):
    out = _run(tmp_path, "all", 10**9)
    assert "EXIT [0, 0]" in out, out[-4000:]  # a run that finishes: every rank ends by itself
    built = sorted(ln for ln in out.splitlines() if "task built: " in ln)
    assert built == ["[rank 0] task built: 49 parameters", "[rank 1] task built: 49 parameters"], out
    assert "Traceback" not in out, out
