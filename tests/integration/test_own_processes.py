"""A test ends only the processes it started: the guard on every fixture's kill list.

The failure this guards against: a fixture that took "every process that appeared while `ray start`
ran" (a machine-wide diff of pids) as its own killed the other half of `make test`'s DeepSpeed op
build. Fixtures now find their processes by the marker their environment carries
(``tests.own_processes``), and ``stop_processes`` refuses a kill list with anything unmarked.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import stop_processes
from tests.own_processes import marked_env, marked_processes

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def ours_and_another():
    """One process this test starts as its own (marked), one that merely starts at the same moment
    (another engineer's compiler, the other half of the suite)."""
    before = set(psutil.pids())
    env, mark = marked_env(dict(os.environ))
    ours = subprocess.Popen(["/bin/sh", "-c", f"{shlex.join(SLEEP)} & wait"], env=env)
    other = subprocess.Popen(SLEEP, env=dict(os.environ))
    deadline = time.monotonic() + 30
    while len(marked_processes(mark)) < 2 and time.monotonic() < deadline:  # the shell and its child
        time.sleep(0.05)
    try:
        yield mark, ours, other, before
    finally:
        for p in (ours, other):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_fixture_finds_its_processes_and_their_descendants_by_the_mark_only(ours_and_another):
    mark, ours, other, before = ours_and_another
    found = {p.pid for p in marked_processes(mark)}
    assert ours.pid in found and len(found) == 2  # the shell and the sleep it started
    assert other.pid not in found
    diff = set(psutil.pids()) - before  # what the old fixture took for its own
    assert other.pid in diff


def test_a_kill_list_with_a_process_the_test_did_not_start_is_refused_whole(ours_and_another):
    mark, ours, other, before = ours_and_another
    diff = [psutil.Process(p) for p in set(psutil.pids()) - before if psutil.pid_exists(p)]
    with pytest.raises(AssertionError, match="did not start"):
        stop_processes(diff, mark=mark)
    assert ours.poll() is None and other.poll() is None  # nothing was signalled
    assert not stop_processes(marked_processes(mark), mark=mark)
    ours.wait(timeout=30)
    assert other.poll() is None  # the other engineer's process lives on
