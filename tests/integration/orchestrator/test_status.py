"""``syncpoint status RUN_DIR``: a run's state now (running, stopped and resumable, finished, failed
and why), its newest resumable state, goodput and badput so far and its last interruption, read from
the run directory alone; bounded and refusing on a hostile one (a linked ``events/`` or lease, an
oversized or garbage record), and exit 2 with one paragraph for a directory that is no run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest

from syncpoint.policies.contracts.journal import Failure, FaultFired
from syncpoint.policies.decisions.goodput import BADPUT, goodput
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import cli, linear_spec, run, run_until_crash, with_overrides

STATE_4, STATE_20 = f"{4:012d}", f"{20:012d}"


def _local(url: str) -> str:
    return url[len("file://") :]


def _status(capsys, run_dir: str) -> tuple[dict, str]:
    rc, out, err = cli(capsys, "status", run_dir, "--json")
    assert rc == 0, err
    rc, text, err = cli(capsys, "status", run_dir)
    assert rc == 0, err
    return json.loads(out), text


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One linear run crashed at micro-step 7 (copied: stopped), then run to its end (finished)."""
    root = tmp_path_factory.mktemp("status")
    spec = linear_spec(
        root,
        "task.config.num_samples=10",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 7, mode: raise}]",
    )
    assert run_until_crash(spec)
    stopped = root / "stopped"
    shutil.copytree(_local(spec.run_url), stopped, symlinks=True)
    run(with_overrides(spec, "faults=[]"))
    return {"spec": spec, "stopped": str(stopped), "finished": _local(spec.run_url), "root": root}


def test_a_stopped_run_is_resumable_from_its_newest_state_and_says_what_the_crash_costs(runs, capsys):
    s, text = _status(capsys, runs["stopped"])
    assert s["state"] == "stopped" and s["attempt"] == 1
    assert s["lease"]["held"] is False and s["lease"]["why"] == "released"
    assert s["newest_resumable"]["state"] == STATE_4 and s["newest_resumable"]["optimizer_step"] == 1
    i = s["last_interruption"]
    assert (i["attempt"], i["micro_step"], i["lost_micro_steps"], i["resumed"]) == (1, 7, 3, False)
    assert not s["goodput"]["finished"] and s["goodput"]["uncommitted_s"] >= 0
    assert text.splitlines()[1].startswith("state: stopped: attempt 1 ended without a finish")
    assert f"resumable from {STATE_4} (micro-step 4)" in text
    assert (
        "last interruption: attempt 1 (no failure recorded) at micro-step 7; a resume computes 3 micro-steps again"
        in text
    )


def test_a_finished_run_reports_the_same_goodput_as_the_journal_and_its_last_restart(runs, capsys):
    s, text = _status(capsys, runs["finished"])
    assert s["state"] == "finished" and s["attempt"] == 2
    assert s["detail"] == f"finished at micro-step 20 with state {STATE_20}"
    assert s["newest_resumable"]["state"] == STATE_20
    g = goodput(EventLog(RunStorage(runs["spec"].run_url)).journal())
    assert s["goodput"]["ratio"] == pytest.approx(g.ratio) and s["goodput"]["finished"]
    assert s["goodput"]["badput"] == pytest.approx(g.badput) and list(s["goodput"]["badput"]) == [k for k, _ in BADPUT]
    i = s["last_interruption"]
    assert i["resumed"] and i["resumed_from"] == STATE_4 and i["lost_micro_steps"] == 3
    assert i["cost_s"] == pytest.approx(i["wasted_progress_s"] + i["recovery_s"] + i["startup_s"])
    assert f"goodput {100 * g.ratio:.1f}%: productive" in text and "problems" not in s or s["problems"] == []


def test_a_run_that_failed_for_good_says_why(runs, capsys):
    failed = runs["root"] / "failed"
    shutil.copytree(runs["stopped"], failed, symlinks=True)
    EventLog(RunStorage(f"file://{failed}"), source="driver").emit(  # what the driver's failure policy writes
        Failure(
            classified="application",
            reason="ValueError: bad batch at micro-step 7",
            decision="RAISE",
            ranks=[0],
            messages=["ValueError: bad batch"],
            dead_nodes=[],
            micro_step=7,
        )
    )
    s, text = _status(capsys, str(failed))
    assert s["state"] == "failed" and s["attempt"] == 1
    assert s["detail"] == "attempt 1 failed: application: ValueError: bad batch at micro-step 7"
    assert s["newest_resumable"]["state"] == STATE_4  # a re-submission would still resume it
    assert s["last_interruption"]["cause"] == "application" and s["last_interruption"]["lost_micro_steps"] == 3
    assert "state: failed: attempt 1 failed: application: ValueError: bad batch" in text


def test_a_running_run_is_running_with_its_attempt_then_stopped_once_its_rank_is_killed(tmp_path, capsys, monkeypatch):
    """A real run, its rank a process of its own (``run_spawned``), held at micro-step 6 (``mode:
    hold``): its lease is live, so it is running, attempt 1; its rank SIGKILLed (the lease names its
    pid: a process this test started), it is stopped and resumable from its newest state."""
    from syncpoint.workers.storage.lease import read_lease
    from syncpoint.workers.supervision.launch import run_spawned

    spec = linear_spec(
        tmp_path,
        "task.config.num_samples=10",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 6, mode: hold}]",
    )
    monkeypatch.setenv("SYNCPOINT_FAULT_HOLD_S", "300")
    store = RunStorage(spec.run_url)
    codes: list[int] = []
    launcher = threading.Thread(target=lambda: codes.extend(run_spawned(spec, world_size=1, timeout=600)))
    launcher.start()
    try:
        deadline = time.monotonic() + 240
        while not any(f.mode == "hold" for f in EventLog(store).journal().of_kind(FaultFired)):
            assert launcher.is_alive(), f"the run ended before micro-step 6: {codes}"
            assert time.monotonic() < deadline, "the held run never reached micro-step 6"
            time.sleep(0.2)
        s, text = _status(capsys, _local(spec.run_url))
        assert s["state"] == "running" and s["attempt"] == 1 and s["lease"]["held"]
        assert s["detail"].startswith("attempt 1 is training (lease renewed")
        assert s["newest_resumable"]["state"] == f"{4:012d}" and not s["goodput"]["finished"]
        assert s["last_interruption"] is None and "so far" in text
    finally:
        held = read_lease(store)
        pid = held.record["pid"] if held and held.record else None
        if pid is not None and _started_by_us(pid):
            os.kill(pid, signal.SIGKILL)
        launcher.join(timeout=120)
    assert codes == [-signal.SIGKILL]
    s, _ = _status(capsys, _local(spec.run_url))
    assert s["state"] == "stopped" and not s["lease"]["held"]
    assert s["last_interruption"]["micro_step"] >= 6 and f"resumable from {4:012d}" in s["detail"]


def _started_by_us(pid: int) -> bool:
    """Whether this test process is an ancestor of ``pid`` (the rank: a child of our fork server)."""
    for _ in range(4):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        if pid == os.getpid():
            return True
    return False


def test_a_hostile_run_directory_is_read_within_bounds_and_what_is_refused_is_named(runs, capsys):
    hostile = runs["root"] / "hostile"
    shutil.copytree(runs["finished"], hostile, symlinks=True)
    events = hostile / "events"
    (events / "00000000000000000001-huge-x.json").write_text('{"kind": "x", "pad": "' + "x" * (1 << 21) + '"}')
    (events / "00000000000000000002-garbage-x.json").write_bytes(b"\x00\xffnot json")
    (events / "00000000000000000003-list-x.json").write_text("[1, 2]")
    (events / "00000000000000000004-alien-x.json").write_text('{"kind": "from_the_future", "time": 5.0}')
    os.symlink("/etc/passwd", events / "00000000000000000005-link-x.json")
    (hostile / "lease.json").unlink()
    os.symlink("/dev/zero", hostile / "lease.json")
    s, text = _status(capsys, str(hostile))
    assert s["state"] == "finished" and s["lease"] is None  # what the rest of the log says
    problems = "\n".join(s["problems"])
    assert "lease.json refused, not read" in problems
    assert "3 event record(s) unreadable" in problems and "larger than 1048576 bytes" in problems  # never loaded
    assert "garbage-x.json (not JSON" in problems and "list-x.json (not a JSON object)" in problems
    assert "link-x.json" not in problems  # a linked event file is not even listed: never opened
    assert "1 event record(s) not read, e.g. 'from_the_future'" in problems
    assert "not read: lease.json refused" in text and "root:" not in text + problems

    linked = runs["root"] / "linked"
    shutil.copytree(runs["finished"], linked, symlinks=True, ignore=shutil.ignore_patterns("events"))
    os.symlink(events, linked / "events")  # a journal planted by link: never followed
    s, text = _status(capsys, str(linked))
    assert "events/ is a symbolic link: not followed, so no event was read" in s["problems"]
    assert s["goodput"] is None and s["newest_resumable"]["state"] == STATE_20 and s["state"] == "stopped"


def test_a_lease_not_released_is_running_only_while_its_holder_lives_and_renews_it(runs, capsys):
    """A lease left unreleased (its driver killed): held by a process that is gone, or not renewed
    within its TTL by the storage's clock, it is no running run; a lease too large to be one is refused."""
    import subprocess

    left = runs["root"] / "left"
    shutil.copytree(runs["stopped"], left, symlinks=True)
    lease = left / "lease.json"
    record = json.loads(lease.read_text())
    gone = subprocess.Popen(["true"])
    gone.wait()
    lease.write_text(json.dumps({**record, "released": False, "pid": gone.pid, "heartbeat": time.time()}))
    s, _ = _status(capsys, str(left))
    assert s["state"] == "stopped" and s["lease"]["why"] == "its holder's process is gone"

    from syncpoint.workers.storage.holder_process import this_process

    lease.write_text(json.dumps({**record, "released": False, **this_process()}))  # alive, but silent
    stale = time.time() - 10 * record["ttl_s"]
    os.utime(lease, (stale, stale))
    s, _ = _status(capsys, str(left))
    assert s["state"] == "stopped" and s["lease"]["why"].startswith("not renewed for")

    lease.write_text(json.dumps({**record, "pad": "x" * (1 << 17)}))
    s, text = _status(capsys, str(left))
    assert s["state"] == "stopped" and s["lease"] is None and "lease.json refused, not read" in text


def test_a_retried_failure_whose_next_attempt_has_not_started_is_a_restart_under_way(runs, capsys):
    """Between a retried failure and the next attempt (a new worker group starting), the run is
    running: the failure says so, and its lease (not released) is younger than its TTL."""
    restarting = runs["root"] / "restarting"
    shutil.copytree(runs["stopped"], restarting, symlinks=True)
    import subprocess

    gone = subprocess.Popen(["true"])  # the failed attempt's rank 0, which held the lease: dead
    gone.wait()
    lease = restarting / "lease.json"
    lease.write_text(json.dumps({**json.loads(lease.read_text()), "released": False, "pid": gone.pid}))
    EventLog(RunStorage(f"file://{restarting}"), source="driver").emit(
        Failure(
            classified="preemption",
            reason="node(s) lost: n1",
            decision="RETRY",
            ranks=[0],
            messages=[],
            dead_nodes=["n1"],
        )
    )
    s, text = _status(capsys, str(restarting))
    assert s["state"] == "running" and s["attempt"] == 2
    assert (
        s["detail"] == "attempt 1 failed (preemption: node(s) lost: n1) and is being retried: attempt 2 not logged yet"
    )


def test_a_directory_that_is_no_run_exits_2_with_one_paragraph(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for arg in (str(tmp_path / "empty"), str(tmp_path / "file"), str(tmp_path / "absent")):
        rc, out, err = cli(capsys, "status", arg)
        assert rc == 2 and out == "" and "RUN_DIR" in err and "\n\n" not in err.strip(), err
        assert "run directory" in err and len(err) < 1024
