"""``syncpoint run --local``: the job's ranks on this machine without Ray, as a user runs it.

One job, two runs of the same command on one run directory: SIGTERM while it trains saves at the
next boundary and stops (exit 143, the line that names ``--local``); the rerun resumes from that
state, a rank crashes and is recovered in place, and the run finishes bitwise the uninterrupted
run. A bug in the task ends the run with its reason and place on the last line, exit 1, and
``--local`` beside ``--address`` is a usage error. The task holds its first micro-batch until a file
exists (``tests.tasks.paced_lm``), so the signal lands while the run trains, without a wall-clock window.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from syncpoint.policies.contracts.spec import CrashFault
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import (
    ROOT,
    digest,
    linear_spec,
    lm_spec,
    saved_on_the_drivers_notice,
    start_as_in_a_terminal,
    state_names,
    stop_processes,
    write_job,
)
from tests.own_processes import marked_env, owned
from tests.ray_processes import wait_for_driver

pytestmark = pytest.mark.slow

LENGTH = ["task.config.num_samples=96", "train.epochs=1"]


def _events(spec, kind: str) -> list[dict]:
    try:
        return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == kind]
    except Exception:  # noqa: BLE001 - the log is being written: asked again at the next poll
        return []


def _local(job, env, out):
    cmd = [sys.executable, "-m", "syncpoint", "run", str(job), "--local"]
    return start_as_in_a_terminal(cmd, cwd=ROOT, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT, text=True)


# make test: the bug below (a local run end to end), the stop notice's file (tests/unit/orchestrator/
# test_local_runner.py), the driver's signals on Ray (tests/ray/test_driver_signals.py)
@pytest.mark.long
def test_a_local_run_stops_on_sigterm_and_its_rerun_recovers_a_crash_in_place_and_ends_bitwise(tmp_path):
    hold = tmp_path / "go"
    paced = ["task.path=tests.tasks:paced_lm", f"task.config.hold_until={hold}", "task.config.pace_s=0.01"]
    saves = "checkpoint.save_every={value: 2, unit: optimizer_steps}"
    spec = lm_spec(tmp_path / "runs", *LENGTH, *paced, saves, workers=2)
    job = write_job(spec, tmp_path / "job.yaml")
    env, mark = marked_env({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    out = tmp_path / "out.txt"
    try:
        first = _local(job, env, out)
        wait_for_driver(lambda: bool(_events(spec, "attempt_started")), first, "attempt 1", output=out.read_text)
        signalled_at = time.time()
        first.send_signal(signal.SIGTERM)
        hold.touch()  # the first micro-batch goes on: the next boundary answers the notice
        assert first.wait(timeout=300) == 143, out.read_text()[-4000:]
        saved = saved_on_the_drivers_notice(lambda kind: _events(spec, kind), "SIGTERM", signalled_at)
        assert out.read_text().strip().splitlines()[-1] == (
            f"syncpoint: stopped on SIGTERM at state {saved['state']} (optimizer step {saved['optimizer_step']}); "
            f"`syncpoint run {job} --local` resumes it"
        ), out.read_text()[-4000:]

        # the same command resumes; rank 1 dies past it, recovered in place (failure.max_failures: 1)
        crash = saved["global_micro_step"] + 5
        rerun = spec.model_copy(
            update={
                "faults": [CrashFault(rank=1, at_micro_step=crash, mode="exit")],
                "failure": spec.failure.model_copy(update={"max_failures": 1}),
            }
        )
        write_job(rerun, job)
        second = _local(job, env, out)
        assert second.wait(timeout=300) == 0, out.read_text()[-4000:]
        starts = _events(spec, "attempt_started")
        assert starts[1]["resumed_from"] == saved["state"] and len(starts) == 3
        (failure,) = _events(spec, "failure")
        assert failure["in_place"] and failure["decision"] == "RETRY"
        assert "finished" in out.read_text().strip().splitlines()[-1]
    finally:
        stop_processes(list(owned(mark)), mark=mark)
    ref = lm_spec(tmp_path / "ref", *LENGTH, saves, workers=2)  # the example's task, unpaced: the same numerics
    assert run_spawned(ref) == [0, 0]
    final = state_names(ref)[-1]
    assert state_names(spec)[-1] == final and digest(spec, final) == digest(ref, final)


def test_a_bug_on_every_rank_ends_a_local_run_with_one_traceback_and_its_reason_and_place_last(tmp_path):
    """A bug on both ranks (the task's loss raises at its third call), the task printing as a user's does:
    generation 0 fails (on each rank that reached call 3 before its supervisor stopped it), is retried in
    place, and fails again the same way: not retried although max_failures is 3. One traceback (the
    first failing rank's), the other rank summarised, the task's prints once (rank 0's, once per
    generation), and the reason and place on the last line, exit 1."""
    spec = linear_spec(
        tmp_path / "runs",
        "task.path=tests.tasks:loud_failing",
        "task.config.fail_at=3",
        "failure.max_failures=3",
        "train.prints=rank0",
        workers=2,
    )
    job = write_job(spec, tmp_path / "job.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "syncpoint", "run", str(job), "--local"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-6000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("syncpoint: job 'linear' failed: ValueError: bad batch at call 3") and "micro-step 3" in last
    ), out[-3000:]
    assert _events(spec, "failure")[-1]["decision"] == "RAISE"
    assert out.count("Traceback (most recent call last)") == 1, out
    assert re.search(r"^\[syncpoint\] rank [01] failed:\nTraceback", out, re.MULTILINE), out
    assert out.count("ValueError: bad batch at call 3\n") == 1, out  # the traceback's last line
    assert len(re.findall(r"\] rank [01] failed again the same way: ValueError: bad batch at call 3", out)) == 1, out
    also = [ln for ln in out.splitlines() if " also failed: " in ln]
    assert all(re.match(r"\[syncpoint\] rank [01] also failed: ValueError: bad batch at call 3 at ", ln) for ln in also)
    built = [ln for ln in out.splitlines() if "task built: " in ln]
    assert built == ["task built: 49 parameters"] * 2, out  # rank 0's, once per generation; rank 1's dropped


def test_local_beside_address_is_a_usage_error(tmp_path):
    job = write_job(lm_spec(tmp_path / "runs"), tmp_path / "job.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "syncpoint", "run", str(job), "--local", "--address", "ray://head:10001"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--local runs the ranks here without Ray" in proc.stderr, proc.stderr


WAITS_FOR_THE_WARM_SERVER = """
import glob, os, tempfile, time
sockets = os.path.join(tempfile.gettempdir(), f"syncpoint-warm-{os.getuid()}", "*.sock")
deadline = time.monotonic() + 45  # the import check's own bound is 60 s
while not glob.glob(sockets) and time.monotonic() < deadline:
    time.sleep(0.05)
raise RuntimeError("the warm server was up" if glob.glob(sockets) else "no warm server")
"""


def test_the_warm_server_starts_before_the_checks_and_a_refused_spec_stops_it(tmp_path):
    """``--local`` starts its warm server (torch and DeepSpeed imported there) before it checks the
    task's imports, so the two overlap: the task here imports only once a keeper's socket exists, and
    says so. The check refuses it (exit 2), and the server it started is stopped: its socket goes and
    no process of the command is left. The environment is a user's shell's, without the
    ``DS_ACCELERATOR`` this suite sets (tests/conftest.py): without it ``--local`` used to spawn every
    rank cold, torch and DeepSpeed imported in each (10.1 s to the first step in bench P12, 5.1 s forked)."""
    import shutil
    import tempfile

    short = tempfile.mkdtemp(prefix="sp-")  # a Unix socket's path must stay short
    try:
        (tmp_path / "waits_for_warm.py").write_text(WAITS_FOR_THE_WARM_SERVER)
        spec = linear_spec(tmp_path / "runs", "task.path=waits_for_warm:build")
        job = write_job(spec, tmp_path / "job.yaml")
        env, mark = marked_env({k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DS_ACCELERATOR")})
        env.update(TMPDIR=short, PYTHONPATH=str(ROOT))
        proc = subprocess.run(
            [sys.executable, "-m", "syncpoint", "run", str(job), "--local"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2 and "the warm server was up" in proc.stderr, proc.stderr[-3000:]
        sockets = os.path.join(short, f"syncpoint-warm-{os.getuid()}")
        deadline = time.monotonic() + 60
        while (os.listdir(sockets) or owned(mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.listdir(sockets) == [] and not owned(mark), (os.listdir(sockets), owned(mark))
    finally:
        stop_processes(owned(mark) if "mark" in locals() else [], mark=locals().get("mark"))
        shutil.rmtree(short, ignore_errors=True)
