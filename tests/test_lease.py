"""Concurrent runs on one run directory: a lease with an owner and a heartbeat."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import committed_steps, lm_spec, run, with_overrides
from workers.launch import run_in_process, run_spawned
from workers.loop import ResumeRefused
from workers.storage import RunStorage


def _spec(tmp, *extra):
    return lm_spec(tmp, "task.config.num_samples=20", "train.grad_accum=4", "train.epochs=1", *extra)


def _plant_lease(spec, **kw):
    from workers.loop import job_identity

    lease = {"job_identity": job_identity(spec), "job_name": spec.name, "submission": "other", "host": "h",
             "pid": 1, "ttl_s": 60.0, "heartbeat": time.time()}
    lease.update(kw)
    RunStorage(spec.run_url).write_bytes(json.dumps(lease).encode(), "lease.json")


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


def test_dead_owner_is_taken_over_and_a_restart_keeps_the_lease(tmp_path):
    spec = _spec(tmp_path)
    _plant_lease(spec, heartbeat=time.time() - 600)  # the owner died ten minutes ago
    assert run(spec).final_state  # successor takes over
    assert not RunStorage(spec.run_url).exists("lease.json")  # released at the end
    _plant_lease(spec, submission="sub-7")
    assert run_in_process(with_overrides(spec, "train.epochs=2"), print_progress=False, submission_id="sub-7")


@pytest.mark.slow
def test_two_real_runs_on_one_directory(tmp_path):
    import multiprocessing as mp

    spec = lm_spec(tmp_path, "task.config.num_samples=4000", "train.epochs=1", "resume.lease_ttl_s=5", workers=2)
    ctx = mp.get_context("spawn")
    first = ctx.Process(target=run_spawned, args=(spec,))
    first.start()
    store = RunStorage(spec.run_url)
    deadline = time.monotonic() + 120
    while not store.exists("lease.json"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    codes = run_spawned(spec)  # a second submission while the first trains
    assert codes != [0, 0]
    first.join(300)
    assert first.exitcode == 0 and committed_steps(spec)[-1] == 1000
