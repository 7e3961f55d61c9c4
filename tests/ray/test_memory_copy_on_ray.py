"""The memory copy through the real path: ``syncpoint run`` on an embedded Ray, the run stored in S3
(moto's server on loopback), a rank raising mid-run. Ray Train starts a new worker group on the
same node; it restores from the node's memory copy (no state file read from S3) and the run ends
bitwise where the uninterrupted one ends; the job's end removes the copy.
"""

from __future__ import annotations

import functools
import os

import pytest

from syncpoint.workers.state.memory_copy import MEMORY_DIR_ENV
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import committed_steps, digest, lm_spec, syncpoint_run
from tests.s3_server import BUCKET

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

COMMON = ["task.config.num_samples=96", "train.epochs=1", "checkpoint.save_every={value: 4, unit: micro_steps}"]


# make test: the in-place crash on Ray restores from the node's memory copy, its run in S3
# (tests/ray/test_in_place_on_ray.py); a raised error recovers in place from it in the spawned
# supervisor's tests (tests/integration/workers/supervision/test_supervisor_in_place_recovery.py)
@pytest.mark.long
def test_a_raised_error_restarts_on_the_same_node_from_its_memory_copy(s3, tmp_path):
    ref = lm_spec(tmp_path / "ref", *COMMON, workers=2)
    assert run_spawned(ref) == [0, 0]
    ref_final = f"{max(committed_steps(ref)):012d}"

    spec = lm_spec(f"s3://{BUCKET}/memory-on-ray", *COMMON, "faults=[{at_micro_step: 10, mode: raise}]", workers=2)
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = syncpoint_run(spec, tmp_path / "job.yaml", **{MEMORY_DIR_ENV: str(shm)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "injected crash on rank 0 at micro-step 10" in out
    assert "from this node's memory copy (verified against its manifest)" in out, out[-4000:]
    assert "restoring from storage" not in out
    assert "recovering in place" in out  # the same worker group: a new training process per rank
    final = f"{max(committed_steps(spec)):012d}"
    assert final == ref_final and digest(spec, final) == digest(ref, ref_final)
    assert os.listdir(shm) == [] or all(os.listdir(shm / d) == [] for d in os.listdir(shm))  # the copy is gone


def _files(directory) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]


# make test: the copy written, restored from by two ranks and removed (tests/integration/workers/state/
# test_memory_copy.py), the reaper that removes it when its run ends (test_supervisor_in_place_recovery.py),
# and a restore from the copy on Ray (tests/ray/test_in_place_on_ray.py)
@pytest.mark.long
def test_a_job_that_fails_for_good_leaves_no_copy_on_its_node(s3, tmp_path):
    """The next test's path on the embedded Ray's one node (in make test-all, as the next): a rank raises
    with no failure budget left, its supervisor keeps the node's copy for a restart there, Ray Train
    ends the job, and the driver removes the copy (here the driver's own node: the removal on other
    nodes, through Ray, is the next test's)."""
    spec = lm_spec(
        f"s3://{BUCKET}/memory-ends-here",
        *COMMON,
        "failure.max_failures=0",
        "faults=[{rank: 1, at_micro_step: 10, mode: raise}]",
        workers=2,
    )
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = syncpoint_run(spec, tmp_path / "job.yaml", **{MEMORY_DIR_ENV: str(shm)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "injected crash on rank 1 at micro-step 10" in out
    assert committed_steps(spec), "no state was committed before the crash: no copy was made to remove"
    assert _files(shm) == [], _files(shm)


@pytest.mark.long  # make test: the removal on the embedded Ray's node (tests/ray/test_in_place_on_ray.py, crash)
def test_a_job_that_fails_for_good_leaves_no_copy_on_any_node(s3, tmp_path):
    """Two `ray start` worker nodes, each with its own shared-memory directory; a rank raises with
    no failure budget left, so its supervisor hands the failure to Ray Train (keeping the node's
    copy for a restart there) and Ray Train ends the job. The driver then removes the copy on every
    node its ranks ran on: both directories held one during the run, and neither does after."""
    from tests.ray_processes import (
        add_worker_node,
        local_head,
        ray_env,
        run_driver,
        seen_while_running,
        worker_nodes,
    )

    spec = lm_spec(
        f"s3://{BUCKET}/memory-ends",
        *COMMON,
        "failure.max_failures=0",
        "faults=[{rank: 1, at_micro_step: 10, mode: raise}]",
        workers=2,
    )
    dirs = [tmp_path / "shm-a", tmp_path / "shm-b"]
    for d in dirs:
        d.mkdir()
    with local_head(ray_env(), num_cpus=0) as head, worker_nodes(head, 0, ray_env()) as nodes:
        for d in dirs:
            nodes.append(add_worker_node(head, {**ray_env(), MEMORY_DIR_ENV: str(d)}))
        proc = run_driver(head, spec, tmp_path / "job.yaml", ray_env())
        held = seen_while_running(proc, [functools.partial(_files, d) for d in dirs])
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out[-4000:]
    assert "injected crash on rank 1 at micro-step 10" in out
    assert held == [True, True]  # each node held the run's copy while it trained
    assert _files(dirs[0]) == [] and _files(dirs[1]) == [], (_files(dirs[0]), _files(dirs[1]))
