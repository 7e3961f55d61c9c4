"""One writer per run directory: a fenced lease with a heartbeat, judged by the storage's clock.

Real parts throughout: real files (and memory://), real threads, real spawned processes, the real
training loop; the S3 flavour (conditional writes against moto's server) is in
``tests/integration/workers/storage/test_lease_s3.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from syncpoint.policies.contracts.errors import LeaseLostError, LeaseRefused, ResumeRefused
from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import RunLease, await_expiry, read_lease, release_lease
from syncpoint.workers.supervision.launch import run_in_process, run_spawned
from tests import lease_drivers
from tests.helpers import committed_steps, lm_spec, run, sigint_set, start_as_in_a_terminal, with_overrides

JOB = lease_drivers.JOB


def _spec(tmp, *extra):
    return lm_spec(tmp, "task.config.num_samples=20", "train.grad_accum=4", "train.epochs=1", *extra)


def _plant_lease(spec_or_url, age_s: float = 0.0, **kw) -> None:
    """Another submission's lease, written ``age_s`` ago by the storage's clock (the file's mtime)."""
    if isinstance(spec_or_url, str):
        url, identity, name = spec_or_url, JOB, "job"
    else:
        from syncpoint.policies.decisions.candidates import job_identity

        url, identity, name = spec_or_url.run_url, job_identity(spec_or_url), spec_or_url.name
    lease = {
        "job_identity": identity,
        "job_name": name,
        "submission": "other",
        "host": "h",
        "pid": 1,
        "ttl_s": 60.0,
        "heartbeat": time.time(),
    }
    lease.update(kw)
    store = RunStorage(url)
    lease_drivers.write_lease(store, lease)  # through the compare-and-swap, as a real successor would
    if age_s:
        then = time.time() - age_s
        os.utime(store.path("lease.json"), (then, then))


def _lease(url: str, submission: str, ttl: float = 30.0) -> RunLease:
    return RunLease(RunStorage(url), job_identity=JOB, job_name="job", submission=submission, ttl_s=ttl)


def _manifests(spec) -> dict[int, dict]:
    s = RunStorage(spec.run_url)
    return {
        step: s.read_json("states", f"{step:012d}", "manifest.json", limit=MANIFEST_MAX_BYTES)
        for step in committed_steps(spec)
    }


# ---------------------------------------------------------------- runs on one directory


def test_live_owner_refuses_a_second_submission_and_keeps_its_states(tmp_path):
    spec = _spec(tmp_path)
    run(spec)
    before = committed_steps(spec)
    _plant_lease(spec)  # another submission of this job is alive
    with pytest.raises(ResumeRefused, match="in use by another running submission"):
        run(spec)
    _plant_lease(spec, job_identity="someone-else", job_name="other-job")
    with pytest.raises(ResumeRefused, match="belongs to another job.*other-job"):
        run(spec)
    assert committed_steps(spec) == before


def test_dead_owner_is_taken_over_generations_fence_every_manifest(tmp_path):
    spec = _spec(tmp_path, "checkpoint.save_every={value: 1, unit: optimizer_steps}")
    _plant_lease(spec, age_s=600, generation=6)  # the owner died ten minutes ago (by the file's mtime)
    assert run(spec).final_state  # successor takes over with the next generation
    store = RunStorage(spec.run_url)
    held = read_lease(store)
    assert held.released and held.generation == 7  # released at the end; a tombstone keeps the count
    assert {m["lease_generation"] for m in _manifests(spec).values()} == {7}
    _plant_lease(spec, submission="sub-7", generation=7)  # a restart inside the same submission
    assert run_in_process(with_overrides(spec, "train.epochs=2"), print_progress=False, submission_id="sub-7")
    gens = {step: m["lease_generation"] for step, m in _manifests(spec).items()}
    assert {g for s, g in gens.items() if s > 10} == {8} and {g for s, g in gens.items() if s <= 10} == {7}


def test_malformed_lease_refuses_a_run_cleanly(tmp_path):
    spec = _spec(tmp_path)
    _plant_lease(spec, heartbeat="soon")
    with pytest.raises(ResumeRefused, match="malformed.*heartbeat is 'soon'"):
        run(spec)
    assert committed_steps(spec) == []


# ---------------------------------------------------------------- racing drivers


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_racing_threads_exactly_one_wins(tmp_path, scheme):
    for round_ in range(3):
        url = f"{tmp_path}/r{round_}" if scheme == "file" else f"memory://lease-race-{round_}-{time.time_ns()}"
        if round_ == 2 and scheme == "file":
            _plant_lease(url, age_s=600)  # everyone races for a dead owner's lease
        leases = [_lease(url, f"sub-{i}") for i in range(12)]
        won, refused = lease_drivers.race_threads(leases)
        try:
            assert len(won) == 1, f"{len(won)} drivers believe they own {url}"
            assert len(refused) == len(leases) - 1
            assert read_lease(RunStorage(url)).record["submission"] == won[0].identity["submission"]
            assert won[0].confirm() is None  # the winner really holds it
        finally:
            for lease in leases:
                lease.stop()


def test_racing_processes_exactly_one_wins(tmp_path):
    url = str(tmp_path / "run")
    results = lease_drivers.race_processes(url, 4, timeout=60)
    winners = [r for r in results if r[1] == "won"]
    assert len(winners) == 1, results
    assert winners[0][2] is None
    assert read_lease(RunStorage(url)).record["submission"] == winners[0][0]


# ---------------------------------------------------------------- clocks


def test_successor_with_a_clock_ten_seconds_ahead_never_takes_over_a_live_owner(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    owner = _lease(url, "owner", ttl=3.0)
    owner.acquire()
    try:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 10.0)  # the successor's clock runs ahead
        with pytest.raises(LeaseRefused, match="in use by another running submission"):
            _lease(url, "successor", ttl=3.0).acquire()
        monkeypatch.undo()
        assert owner.confirm() is None
    finally:
        owner.stop()


def test_an_owner_whose_clock_runs_ahead_cannot_make_its_lease_immortal(tmp_path):
    url = str(tmp_path / "run")
    _plant_lease(url, ttl_s=0.5, heartbeat=time.time() + 3600)  # written by a clock an hour ahead, then died
    time.sleep(0.7)  # by the storage's clock the lease is now older than its TTL
    successor = _lease(url, "successor", ttl=5.0)
    try:
        assert successor.acquire() == "takeover"
    finally:
        successor.stop()


# ---------------------------------------------------------------- holding, losing


def test_a_stalled_owner_loses_the_lease_and_never_writes_it_back(tmp_path):
    url = str(tmp_path / "run")
    owner = _lease(url, "owner", ttl=0.6)
    owner.acquire()
    owner.stop()  # the owner stalls (a long pause, a partition): no heartbeat
    time.sleep(0.8)
    successor = _lease(url, "successor", ttl=0.6)
    assert successor.acquire() == "takeover"
    try:
        assert successor.generation == owner.generation + 1
        verdict = owner.confirm()  # the owner wakes up and is about to commit
        assert verdict is not None and "lost the run directory's lease to submission successor" in verdict
        with pytest.raises(LeaseLostError, match="successor"):
            owner.renew()
        time.sleep(0.5)  # the successor's heartbeat keeps going; nothing of the owner's lands
        held = read_lease(RunStorage(url))
        assert held.record["submission"] == "successor" and held.generation == successor.generation
        assert successor.confirm() is None
        with pytest.raises(LeaseLostError):
            owner.release()
        assert read_lease(RunStorage(url)).record["submission"] == "successor"
    finally:
        successor.stop()


def test_the_heartbeat_rereads_the_lease_so_two_owners_never_alternate(tmp_path):
    url = str(tmp_path / "run")
    owner = _lease(url, "owner", ttl=0.6)  # heartbeat every 0.2 s
    owner.acquire()
    try:
        _plant_lease(url, submission="intruder", job_identity=JOB, generation=2)
        time.sleep(1.0)  # five heartbeats, on a quiet machine
        deadline = time.monotonic() + 60  # a starved heartbeat thread runs late, not never
        while owner.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        held = read_lease(RunStorage(url))
        assert held.record["submission"] == "intruder"  # never overwritten by the old owner's heartbeat
        assert isinstance(owner.lost, LeaseLostError) and "submission intruder" in str(owner.lost)
    finally:
        owner.stop()


def test_release_leaves_a_tombstone_that_anyone_may_take(tmp_path):
    url = str(tmp_path / "run")
    first = _lease(url, "first")
    first.acquire()
    release_lease(RunStorage(url), "someone-else")  # not theirs: nothing happens
    assert not read_lease(RunStorage(url)).released
    first.release()
    held = read_lease(RunStorage(url))
    assert held.released and held.generation == 1
    second = _lease(url, "second")
    try:
        assert second.acquire() == "released" and second.generation == 2
    finally:
        second.stop()


MALFORMED = {
    "heartbeat-soon": b'{"job_identity": "job-identity", "submission": "x", "ttl_s": 60, "heartbeat": "soon"}',
    "null": b"null",
    "heartbeat-null": b'{"job_identity": "job-identity", "submission": "x", "ttl_s": 60, "heartbeat": null}',
    "ttl-string": b'{"job_identity": "job-identity", "submission": "x", "ttl_s": "60", "heartbeat": 1}',
    "heartbeat-nan": b'{"job_identity": "job-identity", "submission": "x", "ttl_s": 60, "heartbeat": NaN}',
    "ttl-nan": b'{"job_identity": "job-identity", "submission": "x", "ttl_s": NaN, "heartbeat": 1}',
    "not-json": b'{"submission": ',
    "array": b"[1, 2]",
    "generation-negative": b'{"job_identity": "job-identity", "submission": "x", "ttl_s": 1, "generation": -4}',
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_lease_is_reported_and_taken_over_after_the_ttl(tmp_path, capsys, name):
    url = str(tmp_path / "run")
    RunStorage(url).write_bytes(MALFORMED[name], "lease.json")
    successor = _lease(url, "successor", ttl=30)
    with pytest.raises(LeaseRefused, match="malformed"):
        successor.acquire()  # young: it may be a live owner's
    assert "lease.json is malformed" in capsys.readouterr().err
    # a TTL later by the storage's clock (the file's mtime), without sleeping through it: a loaded
    # machine can take longer than a short TTL between the write above and the first acquire
    old = time.time() - 31
    os.utime(tmp_path / "run" / "lease.json", (old, old))
    try:
        assert successor.acquire() == "takeover"
        assert successor.generation >= 1 and successor.confirm() is None
    finally:
        successor.stop()


# ---------------------------------------------------------------- a re-submission waits for a dead holder


def test_a_resubmission_waits_for_a_dead_holders_lease_then_takes_it_over(tmp_path):
    # a lost head: the holder died 1 s after its last heartbeat; its lease has about 3 s left
    url = str(tmp_path / "run")
    _plant_lease(url, age_s=1.0, ttl_s=4.0, generation=3)
    said: list[str] = []
    started = time.monotonic()
    assert await_expiry(RunStorage(url), JOB, own_ttl_s=4.0, say=said.append) == "expired"
    # it waited (what is left of the TTL by the file's mtime, less however long this loaded machine took to
    # get here), and not past the bound; generous above, since a starved test process runs late
    assert 1.0 <= time.monotonic() - started <= 60
    assert "held by submission other of this job" in said[0] and re.search(r"expires in [0-9]+s", said[0])
    assert "waiting for that" in said[0] and "expired after" in said[-1] and "taking over" in said[-1]
    successor = _lease(url, "successor", ttl=4.0)
    try:
        assert successor.acquire() == "takeover" and successor.generation == 4
        line = successor.takeover_line()
        assert line and "from submission other (host h, pid 1), generation 3" in line
        assert float(line.split("unrenewed for ")[1].split("s ")[0]) >= 4.0  # by the storage's clock
    finally:
        successor.stop()


def test_the_wait_ends_at_the_live_holders_next_heartbeat_and_the_submission_is_refused(tmp_path):
    url = str(tmp_path / "run")
    owner = _lease(url, "owner", ttl=9.0)  # alive: renews every 3 s
    owner.acquire()
    try:
        # "alive", not "expired": the wait ended at the owner's renewal, before the TTL ran out
        assert await_expiry(RunStorage(url), JOB, own_ttl_s=9.0, say=lambda _: None) == "alive"
        with pytest.raises(LeaseRefused, match="in use by another running submission"):
            _lease(url, "successor", ttl=9.0).acquire()
    finally:
        owner.stop()


def test_nothing_to_wait_for_returns_at_once(tmp_path):
    said: list[str] = []
    assert await_expiry(RunStorage(str(tmp_path / "none")), JOB, own_ttl_s=60.0, say=said.append) == "free"
    _plant_lease(str(tmp_path / "other"), job_identity="someone-else")
    assert await_expiry(RunStorage(str(tmp_path / "other")), JOB, own_ttl_s=60.0, say=said.append) == "free"
    _plant_lease(str(tmp_path / "released"), released=True)
    assert await_expiry(RunStorage(str(tmp_path / "released")), JOB, own_ttl_s=60.0, say=said.append) == "free"
    _plant_lease(str(tmp_path / "old"), age_s=600)
    assert await_expiry(RunStorage(str(tmp_path / "old")), JOB, own_ttl_s=60.0, say=said.append) == "expired"
    RunStorage(str(tmp_path / "bad")).write_bytes(b"null", "lease.json")
    # rank 0 warns and judges
    assert await_expiry(RunStorage(str(tmp_path / "bad")), JOB, own_ttl_s=60.0, say=said.append) == "free"
    assert said == []


def test_a_planted_lease_with_a_ttl_no_spec_can_set_is_malformed_and_taken_over_after_our_ttl(tmp_path, capsys):
    """``ttl_s: 1e12`` made a re-submission wait ~35,000 years: a lease whose TTL is over what any job's
    ``resume.lease_ttl_s`` may be was not written by syncpoint; it is held only until it is older than
    the live job's own TTL, like any malformed lease."""
    url = str(tmp_path / "run")
    _plant_lease(url, age_s=3.0, ttl_s=1e12)
    held = read_lease(RunStorage(url))
    assert held is not None and held.problem and "over the 604800s" in held.problem
    started = time.monotonic()
    assert await_expiry(RunStorage(url), JOB, own_ttl_s=2.0, say=lambda _: None) == "free"  # rank 0 judges
    assert time.monotonic() - started < 5
    successor = _lease(url, "successor", ttl=2.0)
    try:
        assert successor.acquire() == "takeover"
    finally:
        successor.stop()
    assert "malformed" in capsys.readouterr().err


def test_the_wait_for_a_longer_lived_lease_is_bounded_by_the_live_jobs_own_ttl(tmp_path):
    """A holder whose TTL (6 days, within the spec's limit) is far longer than this job's: the driver
    waits at most this job's own TTL and a margin, then the workers judge (and refuse, naming it)."""
    url = str(tmp_path / "run")
    _plant_lease(url, ttl_s=6 * 24 * 3600.0)
    said: list[str] = []
    started = time.monotonic()
    assert await_expiry(RunStorage(url), JOB, own_ttl_s=1.0, say=said.append, poll_s=0.1) == "undecided"
    assert time.monotonic() - started < 30
    assert "at most 3s" in said[0] and "longer than this job's resume.lease_ttl_s" in said[0]
    with pytest.raises(LeaseRefused, match="in use by another running submission"):
        _lease(url, "successor", ttl=1.0).acquire()


def test_a_command_started_as_in_a_terminal_gets_sigint_at_its_default_under_a_runner_that_ignores_it():
    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"]
    with sigint_set(signal.SIG_IGN):  # pytest started in the background by a script
        inherited = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
        proc = start_as_in_a_terminal(probe, stdout=subprocess.PIPE, text=True)
    assert inherited == "True"  # the premise: what a plain Popen gives
    assert proc.communicate(timeout=60)[0].strip() == "False"


def test_the_wait_names_a_way_out_that_works_in_a_process_that_ignoressigint_set(tmp_path):
    """Started with SIGINT ignored, Ctrl-C cannot end the wait: the message names ``kill <pid>`` instead."""
    url = str(tmp_path / "run")
    _plant_lease(url, ttl_s=1.0)
    said: list[str] = []
    with sigint_set(signal.SIG_IGN):
        assert await_expiry(RunStorage(url), JOB, own_ttl_s=1.0, say=said.append, poll_s=0.05) == "expired"
    assert f"This process ignores SIGINT (started in the background?): `kill {os.getpid()}` stops" in said[0]
    assert "Ctrl-C" not in said[0]


def test_ctrl_c_ends_the_wait_for_a_predecessors_lease(tmp_path):
    """``syncpoint run`` waiting for a live-looking lease: SIGINT ends it at once with exit 130 and a
    last line that says so (nothing was started, nothing committed is lost). Started as a terminal
    starts it, here under a runner that ignores SIGINT (the worst case ``start_as_in_a_terminal``
    covers)."""
    from tests.helpers import ROOT

    spec = _spec(tmp_path)
    _plant_lease(spec, ttl_s=600.0)
    args = [
        sys.executable,
        "-m",
        "syncpoint",
        "run",
        "examples/tiny_lm.yaml",
        "--set",
        f"storage={tmp_path}",
        "--set",
        "task.config.seq_len=8",
        "--set",
        "task.config.d_model=16",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "task.config.num_samples=20",
        "--set",
        "train.grad_accum=4",
        "--set",
        "train.epochs=1",
        "--set",
        "task.config.eval_samples=8",
        "--set",
        "scaling.num_workers=1",
    ]
    with sigint_set(signal.SIG_IGN):
        proc = start_as_in_a_terminal(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = ""
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while "waiting for that" not in out and time.monotonic() < deadline:
            out += proc.stdout.readline()
        assert "Ctrl-C stops waiting" in out, out
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert "interrupted" in rest.strip().splitlines()[-1] and "Traceback" not in rest


# ---------------------------------------------------------------- a lost lease in a real run


def _steal_env(monkeypatch, spec, at: int, pause: float = 0.0, save_at: str = "") -> None:
    monkeypatch.setenv("SYNCPOINT_TEST_STEAL_AT", str(at))
    monkeypatch.setenv("SYNCPOINT_TEST_RUN_URL", spec.run_url)
    monkeypatch.setenv("SYNCPOINT_TEST_PAUSE_S", str(pause))
    monkeypatch.setenv("SYNCPOINT_TEST_SAVE_AT", save_at)
    lease_drivers.StealLeaseAt.seen = []


def test_lease_lost_mid_run_stops_before_the_next_commit(tmp_path, monkeypatch):
    # 10 micro-batches, accumulation 4: boundaries 4, 8, 10; a state at each. The lease is taken
    # over at micro-step 8, just before that boundary's save.
    spec = _spec(tmp_path, "checkpoint.save_trigger=tests.lease_drivers:StealLeaseAt")
    _steal_env(monkeypatch, spec, at=8)
    with pytest.raises(LeaseLostError, match="lost the run directory's lease to submission thief.*re-submit"):
        run(spec)
    assert committed_steps(spec) == [4]
    assert read_lease(RunStorage(spec.run_url)).record["submission"] == "thief"  # never written back


def test_lease_lost_during_an_async_upload_stops_at_its_commit(tmp_path, monkeypatch):
    # The save of micro-step 8 uploads in the background; the lease is taken over at 9, so the
    # commit of that upload (at the last boundary, 10) finds it lost right before the manifest.
    spec = _spec(tmp_path, "checkpoint.save_trigger=tests.lease_drivers:StealLeaseAt", "checkpoint.async=true")
    _steal_env(monkeypatch, spec, at=9)
    with pytest.raises(LeaseLostError, match="submission thief"):
        run(spec)
    assert 8 not in committed_steps(spec) and 10 not in committed_steps(spec)
    assert read_lease(RunStorage(spec.run_url)).record["submission"] == "thief"


def test_lease_lost_between_saves_stops_every_rank_at_the_next_boundary(tmp_path, monkeypatch):
    # The heartbeat (every 0.5 s) notices the take-over at micro-step 5; training stops at the
    # boundary of micro-step 8 through the boundary vote, before the final save at 10.
    spec = _spec(tmp_path, "checkpoint.save_trigger=tests.lease_drivers:StealLeaseAt", "resume.lease_ttl_s=1.5")
    _steal_env(monkeypatch, spec, at=5, pause=3.0, save_at="4")
    with pytest.raises(LeaseLostError, match="submission thief"):
        run(spec)
    assert committed_steps(spec) == [4]
    assert max(lease_drivers.StealLeaseAt.seen) == 8  # stopped at the first boundary after the loss


@pytest.mark.slow
def test_lease_lost_mid_run_stops_both_ranks_without_a_hang(tmp_path, monkeypatch):
    spec = lm_spec(
        tmp_path,
        "task.config.num_samples=20",
        "train.grad_accum=4",
        "train.epochs=1",
        "checkpoint.save_trigger=tests.lease_drivers:StealLeaseAt",
        workers=2,
    )
    # two ranks: 5 micro-batches per epoch, accumulation 4: boundaries 4 and 5
    _steal_env(monkeypatch, spec, at=5)
    codes = run_spawned(spec, timeout=300)
    assert codes == [1, 1]  # both raised LeaseLostError; a rank stuck in a barrier would be killed (-9)
    assert committed_steps(spec) == [4]


@pytest.mark.slow
def test_two_real_runs_on_one_directory(tmp_path):
    # the first run holds at its first micro-batch (no CPU) until the second submission has tried
    go = tmp_path / "second-submission-tried"
    spec = lm_spec(
        tmp_path,
        "task.path=tests.tasks:paced_lm",
        f"task.config.hold_until={go}",
        "task.config.num_samples=200",
        "train.epochs=1",
        "resume.lease_ttl_s=5",
        workers=2,
    )
    ctx = mp.get_context("spawn")
    first = ctx.Process(target=run_spawned, args=(spec,))
    first.start()
    store = RunStorage(spec.run_url)
    deadline = time.monotonic() + 600  # a loaded machine starts two spawned ranks slowly
    while not store.exists("lease.json"):
        assert time.monotonic() < deadline, "the first run took no lease within 10 min"
        time.sleep(0.1)
    codes = run_spawned(spec)  # a second submission while the first trains
    go.touch()
    assert codes != [0, 0]
    first.join(300)
    assert first.exitcode == 0 and committed_steps(spec)[-1] == 50


# ---------------------------------------------------------------- concurrent commits


@pytest.mark.slow
def test_concurrent_commits_never_two_committed_writers(tmp_path):
    url = str(tmp_path / "run")
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    stalling = ctx.Process(target=lease_drivers.committer, args=(url, "stalling", 1, 2.5, 6, out, ready))
    stalling.start()
    assert out.get(timeout=120)[:2] == ("stalling", "acquired")
    successor = ctx.Process(target=lease_drivers.committer, args=(url, "successor", 100, 0.0, 40, out, ready))
    successor.start()  # keeps trying; takes over once the stalled owner's lease expires, then commits
    results = {}
    for _ in range(3):
        r = out.get(timeout=180)
        results.setdefault(r[0], []).append(r)
    stalling.join(60)
    successor.join(60)
    end = {k: v[-1] for k, v in results.items()}
    assert end["stalling"][1] == "lost" and end["stalling"][2] == [1, 2]
    assert "to submission successor" in end["stalling"][3]
    assert end["successor"][1] == "done" and len(end["successor"][2]) == 40

    store = RunStorage(url)
    by_gen: dict[int, list[float]] = {}
    for name in store.list_dirs("states"):
        if store.exists("states", name, "manifest.json"):
            gen = store.read_json("states", name, "manifest.json", limit=MANIFEST_MAX_BYTES)["lease_generation"]
            by_gen.setdefault(gen, []).append(os.stat(store.path("states", name, "manifest.json")).st_mtime)
    assert sorted(by_gen) == [1, 2]
    assert len(by_gen[1]) == 2 and len(by_gen[2]) == 40
    assert max(by_gen[1]) <= min(by_gen[2])  # every commit of the old writer precedes the new writer's


# ---------------------------------------------------------------- a holder that is provably dead

_HOLDER = r"""
import sys, time
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import RunLease
from tests.lease_drivers import JOB
lease = RunLease(RunStorage(sys.argv[1]), job_identity=JOB, job_name="job", submission="killed", ttl_s=300.0)
lease.acquire()
print("held", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def _killed_holder(url: str) -> Iterator[int]:
    """A real process that takes the lease (a 300 s TTL) and is then SIGKILLed, as a killed driver's rank 0."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        proc.kill()
        proc.wait(30)
        yield proc.pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_holder_whose_process_is_gone_from_this_host_is_taken_over_at_once(tmp_path):
    """Its lease is 300 s from expiring: the driver's wait proves the holder dead (this host's boot and
    pid namespace, its pid gone), marks the lease released by compare-and-swap, and says so; rank 0
    then takes it at once with the next generation."""
    url = str(tmp_path / "run")
    with _killed_holder(url) as pid:
        held = read_lease(RunStorage(url))
        assert held is not None and held.record is not None and held.record["pid"] == pid
        said: list[str] = []
        assert await_expiry(RunStorage(url), JOB, own_ttl_s=300.0, say=said.append) == "free"
        assert len(said) == 1 and f"pid {pid}" in said[0] and "whose process is gone from this host" in said[0]
        successor = _lease(url, "successor", ttl=300.0)
        try:
            assert successor.acquire() == "released" and successor.generation == held.generation + 1
        finally:
            successor.stop()


def test_rank_zero_alone_takes_over_a_holder_whose_process_is_gone(tmp_path):
    """Without a driver's wait (the spawned launcher, an in-process run): rank 0's own judgement."""
    url = str(tmp_path / "run")
    with _killed_holder(url) as pid:
        successor = _lease(url, "successor", ttl=300.0)
        try:
            assert successor.acquire() == "takeover"
            line = successor.takeover_line()
            assert line and f"pid {pid}" in line and "its process is gone from this host" in line, line
        finally:
            successor.stop()


@pytest.mark.parametrize("elsewhere", ["another host", "another pid namespace", "another user", "an older lease"])
def test_a_holder_that_is_not_provably_dead_is_still_waited_for(tmp_path, elsewhere):
    """A young lease whose pid does not exist here, recorded on another host (another boot id), in
    another container (pid namespace), by another user (whose processes /proc may hide), or without
    the fields: nothing proves its holder dead, so it is waited for and rank 0 refuses."""
    from syncpoint.workers.storage import holder_process

    url = str(tmp_path / "run")
    fields = {**holder_process.this_process(), "pid": 2**22 + 12345}  # no such process here
    fields.update(
        {
            "another host": {"boot_id": "00000000-0000-0000-0000-000000000000"},
            "another pid namespace": {"pid_ns": "pid:[1]"},
            "another user": {"uid": os.getuid() + 4242},
            "an older lease": dict.fromkeys(("boot_id", "pid_ns", "pid_start", "uid")),
        }[elsewhere]
    )
    _plant_lease(url, ttl_s=60.0, **fields)
    assert await_expiry(RunStorage(url), JOB, own_ttl_s=1.0, say=lambda _: None, poll_s=0.1) == "undecided"
    with pytest.raises(LeaseRefused, match="in use by another running submission"):
        _lease(url, "successor", ttl=60.0).acquire()


def test_a_live_holder_on_this_host_is_not_dead():
    from syncpoint.workers.storage import holder_process

    me = holder_process.this_process()
    assert me["pid"] == os.getpid() and not holder_process.provably_dead(me)
    assert holder_process.provably_dead({**me, "pid_start": me["pid_start"] + 1})  # the pid now another process's
