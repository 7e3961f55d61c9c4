"""checkpoint.async: only the snapshot blocks; one save in flight; commits after every upload.

Uploads are slowed down by a real fsspec filesystem (an in-memory object store whose writes take
a while), so training demonstrably continues while a save uploads."""

from __future__ import annotations

import time
from itertools import pairwise

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from syncpoint.policies.decisions.boundaries import boundary_micro_steps
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import digest, lm_spec, run, run_until_crash


class SlowObjectStore(MemoryFileSystem):
    """memory:// with slow PUTs: an object store on a bad day."""

    protocol = "slowmem"
    store: dict = {}
    pseudo_dirs = [""]

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and "/engine/" in path:
            time.sleep(0.15)
        return super()._open(path, mode, **kwargs)


fsspec.register_implementation("slowmem", SlowObjectStore, clobber=True)


def _spec(storage, *extra):
    return lm_spec(
        storage,
        "task.config.num_samples=40",
        "train.grad_accum=4",
        "train.epochs=1",
        "checkpoint.save_every={value: 3, unit: micro_steps}",
        "checkpoint.async=true",
        *extra,
    )


def test_one_save_in_flight_requests_wait_and_training_continues():
    spec = _spec("slowmem://async-a")
    run(spec)
    commits = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "state_committed"]
    boundaries = set(boundary_micro_steps(4, 20, 1))
    steps = [c["global_micro_step"] for c in commits]
    assert steps == sorted(steps) and set(steps) <= boundaries
    assert steps[-1] == 20  # the finished run waited for (and committed) its last save
    background = [c for c in commits if "final" not in c["reasons"]]
    assert background, commits
    # training went on while each background save uploaded: committed at a later boundary
    assert all(c["committed_at_micro_step"] > c["global_micro_step"] for c in background)
    # never two in flight: each save was snapshotted after the previous one committed
    for prev, cur in pairwise(commits):
        assert cur["global_micro_step"] >= prev["committed_at_micro_step"]
    # requests raised while a save was in flight were deferred, not dropped: fewer saves than requests,
    # and every request (every 3 micro-steps) is covered by a later committed state
    assert len(commits) < len(range(3, 21, 3))
    assert all(any(s >= r for s in steps) for r in range(3, 21, 3))
    for c in commits:
        assert c["blocked_seconds"] >= 0 and c["seconds"] >= c["blocked_seconds"]


def test_crash_mid_upload_leaves_a_torn_state_that_selection_rejects(tmp_path):
    spec = _spec(tmp_path / "run", "faults=[{phase: after_some_shards, at_save: 2, mode: raise}]")
    assert run_until_crash(spec)
    store = RunStorage(spec.run_url)
    names = store.list_names("states")
    torn = [n for n in names if not store.exists("states", n, "manifest.json")]
    assert torn, names
    result = run(spec)
    decision = [e for e in EventLog(store).read_all() if e["kind"] == "resume_decision"][-1]
    assert any(c["verdict"] == "torn" for c in decision["candidates"])
    ref = lm_spec(tmp_path / "ref", "task.config.num_samples=40", "train.grad_accum=4", "train.epochs=1")
    run(ref)
    assert digest(spec, result.final_state) == digest(ref, result.final_state)


@pytest.mark.parametrize("value", ["true", "false"])
def test_async_is_spelled_async_in_yaml(value):
    spec = _spec("memory://x", f"checkpoint.async={value}")
    assert spec.checkpoint.async_save is (value == "true")
