"""The driver's own signals are notices, and nothing outlives the driver: `syncpoint run` as a user runs
it (its own embedded Ray), signalled as a spot VM's shutdown or a user's Ctrl-C signals it.

One job, two runs of the same command on the same run directory:

1. SIGTERM while it trains: every rank saves at its next boundary, the job stops (no ``finished``),
   the last line names the state kept and the command that resumes it, exit 143; the notice is in the
   log with the driver's signal.
2. The same command again resumes from that state, and then either
   - is SIGKILLed: every process it started (found by an environment marker this test sets, never by
     name) is gone within seconds (``make test``), or
   - gets a double Ctrl-C (two SIGINTs) while its first micro-batch is held: it stops at once, saving
     nothing more, exit 130 (``long``; the second signal's rule is also a unit test,
     tests/unit/orchestrator/test_driver_signals.py).

And `ray job stop` of a submitted driver (``syncpoint submit``'s: `syncpoint run` as a Ray Job on a
`ray start` head) is the same notice, as is SIGTERM to `syncpoint drill` (and `--storm`) for the run it has
in progress.

The task holds its first micro-batch until a file exists (``tests.tasks.paced_lm``'s ``hold_until``),
so each signal lands while the run is known to be training, without a wall-clock window.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, lm_spec, saved_on_the_drivers_notice, start_as_in_a_terminal, stop_processes, write_job
from tests.own_processes import marked_env, owned
from tests.ray_processes import BIN, local_head, ray_env, wait_for_driver

GONE_WITHIN_S = 15.0  # the bar: nothing the driver started alive 15 s after its death


def _events(spec, kind: str) -> list[dict]:
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    try:
        return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == kind]
    except Exception:  # noqa: BLE001 - the log is being written: asked again at the next poll
        return []


def _start(job: Path, env: dict[str, str], out: Path) -> subprocess.Popen:
    # SIGINT at its default, as a terminal starts it: make test's Ray half runs in the background, where
    # SIGINT is ignored, and a command started ignoring it keeps ignoring it (as under nohup)
    return start_as_in_a_terminal(
        [sys.executable, "-m", "syncpoint", "run", str(job)],
        cwd=ROOT,
        env=env,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )


def held_job(tmp_path: Path, hold: Path):
    """The example's job, paced, its first micro-batch held until ``hold`` exists, saving only when a
    notice asks (so each signal lands while the run trains, and its one state is the notice's)."""
    return lm_spec(
        tmp_path / "runs",
        "task.path=tests.tasks:paced_lm",
        f"task.config.hold_until={hold}",
        "task.config.pace_s=0.02",
        "task.config.num_samples=1600",
        "train.epochs=1",
        "checkpoint.save_every={value: 0, unit: micro_steps}",
    )


def _last_line(out: Path) -> str:
    return out.read_text().strip().splitlines()[-1]


@pytest.mark.parametrize(
    "then", ["sigkill", pytest.param("double_ctrl_c", marks=pytest.mark.long)], ids=["killed", "double-ctrl-c"]
)
def test_the_drivers_sigterm_saves_and_stops_and_the_rerun_resumes(tmp_path, then):
    hold = tmp_path / "go"
    spec = held_job(tmp_path, hold)
    job = write_job(spec, tmp_path / "job.yaml")
    env, mark = marked_env({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    out = tmp_path / "out.txt"
    procs: list[subprocess.Popen] = []

    def attempts(n: int, proc: subprocess.Popen) -> dict:
        wait_for_driver(lambda: len(_events(spec, "attempt_started")) >= n, proc, f"attempt {n}", output=out.read_text)
        return _events(spec, "attempt_started")[n - 1]

    try:
        # 1. SIGTERM while training: a state committed after it, the job stopped, 143
        procs.append(first := _start(job, env, out))
        attempts(1, first)
        signalled_at = time.time()
        first.send_signal(signal.SIGTERM)
        hold.touch()  # the first micro-batch goes on: the next boundaries answer the notice
        assert first.wait(timeout=300) == 143, out.read_text()[-4000:]
        saved = saved_on_the_drivers_notice(lambda kind: _events(spec, kind), "SIGTERM", signalled_at)
        assert not _events(spec, "finished")  # stopped, not finished
        state, step = saved["state"], saved["optimizer_step"]
        assert _last_line(out) == (
            f"syncpoint: stopped on SIGTERM at state {state} (optimizer step {step}); `syncpoint run {job}` resumes it"
        ), out.read_text()[-4000:]
        assert "SIGTERM received" in out.read_text() and "PC: @" not in out.read_text()  # no Ray stack dump

        # 2. the same command resumes from that state
        hold.unlink()
        procs.append(second := _start(job, env, out))
        assert attempts(2, second)["resumed_from"] == state
        if then == "sigkill":  # nothing it started outlives it
            assert owned(mark), "the run's processes carry the test's marker"
            second.kill()
            second.wait()
            _, alive = psutil.wait_procs(list(owned(mark)), timeout=GONE_WITHIN_S)
            left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            assert not left, f"alive {GONE_WITHIN_S:g}s after the driver's SIGKILL: {[(p.pid, p.name()) for p in left]}"
            return
        # a double Ctrl-C while it is held stops at once, 130
        second.send_signal(signal.SIGINT)  # the second once the first arrived: pending, the kernel merges them
        wait_for_driver(lambda: "SIGINT received" in out.read_text(), second, "the notice", output=out.read_text)
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=120) == 130, out.read_text()[-4000:]
        assert _last_line(out) == (
            f"syncpoint: stopped at once on a second signal after SIGINT at state {state} (optimizer step {step}); "
            f"nothing more was saved; `syncpoint run {job}` resumes it"
        ), out.read_text()[-4000:]
        assert len(_events(spec, "state_committed")) == 1 and not _events(spec, "finished")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        stop_processes(list(owned(mark)), mark=mark)


@pytest.mark.long  # make test: the test above signals the same `syncpoint run` a Ray Job runs
def test_ray_job_stop_of_a_submitted_driver_is_the_same_notice(tmp_path):
    """`syncpoint submit`'s driver is `syncpoint run` as a Ray Job: `ray job stop` (SIGTERM to the
    entrypoint, SIGKILL ``RAY_JOB_STOP_WAIT_TIME_S`` later: set on the head, as the docs say) saves the
    state at the next boundary, and the job's log ends with the line that names `syncpoint submit`."""
    hold = tmp_path / "go"
    sets = [
        f"storage={tmp_path / 'runs'}",
        "scaling.num_workers=1",
        "task.path=tests.tasks:paced_lm",
        f"task.config.hold_until={hold}",
        "task.config.pace_s=0.02",
        "task.config.num_samples=1600",
        "task.config.seq_len=8",
        "task.config.d_model=16",
        "task.config.eval_samples=8",
        "train.micro_batch_size=2",
        "train.epochs=1",
        "checkpoint.save_every={value: 0, unit: micro_steps}",
        "checkpoint.export_final=false",
    ]
    spec = lm_spec(tmp_path / "runs", *sets[2:])
    env = {**ray_env(), "RAY_JOB_STOP_WAIT_TIME_S": "120"}
    job_id = f"sp-stop-{os.getpid()}-{time.monotonic_ns()}"
    with local_head(env) as head:
        cmd = [f"{BIN}/ray", "job", "submit", "--address", head.address, "--submission-id", job_id, "--no-wait"]
        cmd += ["--working-dir", str(ROOT), "--", "python", "-m", "syncpoint", "run", "examples/tiny_lm.yaml"]
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
        deadline = time.monotonic() + 600
        while not _events(spec, "attempt_started"):
            assert time.monotonic() < deadline, "the submitted job never started training"
            time.sleep(0.2)
        signalled_at = time.time()
        stop = subprocess.Popen([f"{BIN}/ray", "job", "stop", "--address", head.address, job_id], cwd=ROOT, env=env)
        hold.touch()
        assert stop.wait(timeout=300) == 0
        logs = subprocess.run(
            [f"{BIN}/ray", "job", "logs", "--address", head.address, job_id],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    (saved,) = _events(spec, "state_committed")
    assert saved["reasons"] == ["preemption"] and saved["time"] > signalled_at
    (notice,) = _events(spec, "preemption_notice")
    assert notice["source"] == "driver" and notice["signal"] == "SIGTERM"
    last = logs.strip().splitlines()[-1]
    assert last.startswith(
        f"syncpoint: stopped on SIGTERM at state {saved['state']} (optimizer step {saved['optimizer_step']}); "
        "`syncpoint submit examples/tiny_lm.yaml --set"
    ) and last.endswith("--address DASHBOARD` resumes it"), logs[-3000:]


@pytest.mark.long  # make test: `syncpoint run`'s SIGTERM above (the drill's runs are `syncpoint run`'s, in-process)
@pytest.mark.parametrize(
    "what,args",
    [("drill", ["--preempt-at", "300"]), ("storm", ["--storm", "2", "--seed", "7"])],
    ids=["drill", "storm"],
)
def test_a_drills_sigterm_is_the_notice_of_the_run_in_progress_and_ends_the_drill(tmp_path, what, args):
    """SIGTERM to `syncpoint drill` (and `--storm`) while its reference run trains: that run saves at its
    next boundary and stops, the interrupted run never starts (no storm is planned), the drill ends 143
    with a last line that says it stopped and how to start it over (a storm's with its seed), and nothing
    it started is alive 15 s later."""
    hold = tmp_path / "go"
    spec = held_job(tmp_path, hold)
    job = write_job(spec, tmp_path / "job.yaml")
    ref = spec.model_copy(update={"name": f"{spec.name}-drill-ref"})
    run = spec.model_copy(update={"name": f"{spec.name}-drill"})
    env, mark = marked_env({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "syncpoint", "drill", str(job), *args]
    drill = start_as_in_a_terminal(cmd, cwd=ROOT, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_driver(lambda: bool(_events(ref, "attempt_started")), drill, "the reference run", output=out.read_text)
        assert owned(mark), "the drill's processes carry the test's marker"
        signalled_at = time.time()
        drill.send_signal(signal.SIGTERM)
        hold.touch()  # the first micro-batch goes on: the next boundary answers the notice
        assert drill.wait(timeout=300) == 143, out.read_text()[-4000:]
        saved = saved_on_the_drivers_notice(lambda kind: _events(ref, kind), "SIGTERM", signalled_at)
        assert not _events(ref, "finished") and not _events(run, "submitted")  # the interrupted run never began
        text = out.read_text()
        again = f"syncpoint drill {job} {' '.join(args)}"
        assert (
            f"syncpoint: stopped on SIGTERM at state {saved['state']} (optimizer step {saved['optimizer_step']}); "
            f"`{again}` starts over"
        ) in text, text[-4000:]
        assert "storm plan" not in text, text[-4000:]
        assert f"the {what} stopped on SIGTERM during its reference run: nothing compared" in text, text[-4000:]
        assert _last_line(out) == f"RESULT: STOPPED (`{again}` starts the {what} over)", text[-4000:]
        _, alive = psutil.wait_procs(list(owned(mark)), timeout=GONE_WITHIN_S)
        left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"alive {GONE_WITHIN_S:g}s after the drill ended: {[(p.pid, p.name()) for p in left]}"
    finally:
        if drill.poll() is None:
            drill.kill()
        stop_processes(list(owned(mark)), mark=mark)
