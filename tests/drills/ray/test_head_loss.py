"""The head goes away: KubeRay users' most frequent complaint. Losing the head pod loses the driver
(`syncpoint run`, which the Job API runs on the head), Ray Train's controller (pinned to the
driver's node) and the lease holder's heartbeat at once; nothing gets to say goodbye.

On this machine: a real `ray start --head` cluster of the test's own (two CPUs: both training
workers run on it, so the whole cluster is one process tree) and a driver `syncpoint run --address`
of the example job, shrunk and paced. Once states are committed and training has moved on, every
process of that cluster and the driver are frozen (SIGSTOP) and then killed (SIGKILL) together. The
same job is submitted again, with the same storage, to a fresh cluster (started beforehand, so the
re-submission usually arrives while the dead holder's lease is still young). Asserted:

* the dead holder's lease was not released (no goodbye), and the new submission takes it over,
  fenced by a new generation, instead of being refused: here both clusters run on one host, where
  the holder's process is provably gone, so the take-over is at once and says so (a holder on another
  host is waited for until its lease expires: tests/integration/workers/storage/test_lease.py);
* it resumes from the newest committed state; every state committed before the loss is still there,
  byte for byte; together the two submissions committed exactly the run's save schedule, each step
  once, the old generation's up to the loss and the new generation's after it;
* the final state is bitwise the uninterrupted run's (an unpaced reference on the local launcher).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import ROOT, committed_steps, digest, lm_spec, stop_processes, write_job
from tests.own_processes import marked_env
from tests.ray_processes import Head, local_head, ray_env, wait_for_driver
from tests.ray_processes import events as _events

TTL = 30.0  # resume.lease_ttl_s: long enough that the re-submission usually arrives before it expires
# 1600 samples, 2 workers, micro-batch 2: 400 micro-steps; accumulation 4; a state every 5 optimizer steps
LENGTH = ["task.config.num_samples=1600", "train.epochs=1", "checkpoint.save_every={value: 5, unit: optimizer_steps}"]
SCHEDULE = list(range(20, 401, 20))  # the micro-steps of the states one uninterrupted run commits
RUN = [
    *LENGTH,
    f"resume.lease_ttl_s={TTL:g}",
    "failure.max_failures=0",
    "task.path=tests.tasks:paced_lm",
    "task.config.pace_s=0.12",
]  # ~50 s of wall time, little CPU; 2.4 s between commits, so a progress flush (every 2 s) lands between two


def _lease_file(spec) -> Path:
    return Path(RunStorage(spec.run_url).path("lease.json"))


def _read_lease(spec) -> tuple[dict, float] | None:
    """lease.json and its mtime (the storage's clock), from one open file: the same version."""
    try:
        with open(_lease_file(spec), "rb") as f:
            return json.loads(f.read()), os.fstat(f.fileno()).st_mtime
    except (FileNotFoundError, ValueError):
        return None


def _driver(job: Path, head: Head, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # a file, not a pipe: nobody reads while the test watches the lease
        return subprocess.Popen(
            [sys.executable, "-m", "syncpoint", "run", str(job), "--address", head.gcs_address],
            cwd=ROOT,
            env=marked_env(ray_env(), head.mark)[0],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


def _trained_past_a_commit(spec) -> bool:
    """At least two states committed, and training flushed progress past the newest one."""
    commits = _events(spec, "state_committed")
    steps = [r["global_micro_step"] for e in _events(spec, "progress") for r in e["records"]]
    return len(commits) >= 2 and max(steps, default=0) > max(c["global_micro_step"] for c in commits)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _lose_the_head(head: Head, driver: subprocess.Popen) -> None:
    """Every process of the cluster (GCS, raylet, agents, the controller, the training workers) and the
    driver: frozen first, so none acts while the others die, then killed. Nothing says goodbye."""
    alive = stop_processes({*head.processes, psutil.Process(driver.pid)}, freeze_first=True, timeout=60, mark=head.mark)
    driver.wait(timeout=60)
    alive = [p for p in alive if _running(p)]  # a killed orphan nobody has reaped yet is a zombie: dead
    assert not alive, f"still running after SIGKILL: {alive}"
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and head.temp_dir in " ".join(p.info["cmdline"] or []):
            left.append(p)
    assert not left, f"processes of the lost cluster still run: {left}"


@pytest.mark.timeout(1800)  # two clusters, two submissions and a reference run on a loaded 2-core machine
def test_a_lost_head_resubmitted_on_a_new_cluster_resumes_exactly(tmp_path):
    spec = lm_spec(tmp_path / "run", *RUN, workers=2)
    job = write_job(spec, tmp_path / "job.yaml")

    # The replacement cluster is started first (what a RayJob retry creates after the loss; started
    # before it here so the re-submission arrives while the dead holder's lease is still young).
    with local_head(ray_env(), num_cpus=2) as replacement:
        _first_cluster_then_resubmit(tmp_path, spec, job, replacement)

    # bitwise the uninterrupted run
    ref = lm_spec(tmp_path / "ref", *LENGTH, workers=2)  # the example's task, unpaced: the same numerics
    assert run_spawned(ref) == [0, 0]
    final = f"{SCHEDULE[-1]:012d}"
    assert digest(spec, final) == digest(ref, final)


def _first_cluster_then_resubmit(tmp_path: Path, spec, job: Path, replacement: Head) -> None:
    # ---- the first cluster: train past two commits, then the head goes away
    with local_head(ray_env(), num_cpus=2) as head:
        log1 = tmp_path / "driver1.log"
        first = _driver(job, head, log1)
        wait_for_driver(
            lambda: _trained_past_a_commit(spec), first, "two commits and progress past them", output=log1.read_text
        )
        _lose_the_head(head, first)
    held = _read_lease(spec)
    assert held is not None, "the first submission never took the lease"
    old, last_beat = held
    assert not old["released"], "the killed driver released its lease: it said goodbye"
    gen = old["generation"]
    store = RunStorage(spec.run_url)
    before = committed_steps(spec)
    assert len(before) >= 2 and before == SCHEDULE[: len(before)], before
    manifests = {s: store.read_bytes("states", f"{s:012d}", "manifest.json", limit=MANIFEST_MAX_BYTES) for s in before}
    assert {json.loads(m)["lease_generation"] for m in manifests.values()} == {gen}

    # ---- the fresh cluster, the same job again; watch lease.json for the take-over write
    log2 = tmp_path / "driver2.log"
    second = _driver(job, replacement, log2)
    takeover = None
    deadline = time.monotonic() + 900
    while second.poll() is None:
        if time.monotonic() > deadline:
            second.kill()
            raise AssertionError(f"the re-submission did not finish in 15 min:\n{log2.read_text()[-4000:]}")
        now = _read_lease(spec)
        if takeover is None and now is not None and now[0]["generation"] != gen:
            takeover = now
        time.sleep(0.02)
    out = log2.read_text()
    assert second.returncode == 0, out[-4000:]
    assert "in use by another running submission" not in out  # never refused

    # the take-over: the new holder's first write, of the next generation, after the old holder's last
    # heartbeat; the holder ran on this host and its process is gone, so no wait for its TTL
    assert takeover is not None, "the test never saw the lease change hands"
    record, taken_at = takeover
    assert record["generation"] == gen + 1 and record["submission"] != old["submission"]
    assert record["beat"] == 0, f"the test saw a later heartbeat ({record['beat']}), not the take-over write itself"
    assert taken_at > last_beat
    assert (
        f"held by submission {old['submission']} of this job (host {old['host']}, pid {old['pid']}, generation "
        f"{gen}), whose process is gone from this host: taking over at once"
    ) in out, out[-4000:]
    assert "waiting for that" not in out, out[-4000:]
    final_lease = json.loads(_lease_file(spec).read_bytes())
    assert final_lease["released"] and final_lease["generation"] == gen + 1

    # resumed from the newest committed state; nothing lost, nothing committed twice
    (resumed,) = [e for e in _events(spec, "attempt_started") if e["submission"] == record["submission"]]
    assert resumed["resumed_from"] == f"{before[-1]:012d}"
    assert committed_steps(spec) == SCHEDULE
    for s in before:
        now = store.read_bytes("states", f"{s:012d}", "manifest.json", limit=MANIFEST_MAX_BYTES)
        assert now == manifests[s], f"state {s} changed"
    for s in SCHEDULE[len(before) :]:
        manifest = store.read_json("states", f"{s:012d}", "manifest.json", limit=MANIFEST_MAX_BYTES)
        assert manifest["lease_generation"] == gen + 1
    commits = [e["state"] for e in _events(spec, "state_committed")]
    assert len(commits) == len(set(commits)), f"a state committed twice: {commits}"
