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


@pytest.mark.parametrize("zero", ["0", "2", "3", "2-elastic"])
def test_a_snapshot_that_is_not_finite_is_not_committed_and_its_request_waits(tmp_path, monkeypatch, capfd, zero):
    """The finiteness of an async save's tensors is checked on its copies, in the upload thread (the
    loop waits for no scan of the state). A snapshot whose copy of an Adam moment is NaN while
    training's own stays finite (the moment is NaN only until its copy is made): that state is not
    committed, its files are gone, the run says so once, and its save request is carried to the next
    boundary, which commits it; every committed state is finite."""
    import math

    import torch

    import syncpoint.workers.state.writer as sw
    from syncpoint.workers.integrity.safe_load import load_state_file
    from syncpoint.workers.state.saving import SaveCoordinator

    target = "000000000004"
    spoiled: list[tuple[torch.Tensor, float]] = []
    orig_take, orig_wait = sw.take_snapshot, sw.StateWriter.wait_staged

    def take_then_spoil(engine, *a, **kw):
        snap = orig_take(engine, *a, **kw)
        if snap.name == target and kw.get("direct") is None:
            optimizer = engine.optimizer
            while not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed's ZeRO wrapper holds torch's
                optimizer = optimizer.optimizer
            state = next(s for s in optimizer.state.values() if "exp_avg_sq" in s)
            moment = state["exp_avg_sq"].view(-1)
            spoiled.append((moment, float(moment[0])))
            moment[0] = math.nan  # the staged copy, made later by the upload thread, sees it
        return snap

    def wait_then_heal(writer):
        orig_wait(writer)  # the copies are made: training's own tensor is healed before it is read
        if spoiled:
            moment, value = spoiled.pop()
            moment[0] = value
            writer.upload.thread.join()  # its upload ends before the next boundary's vote: the commit is there

    boundaries: list[int] = []
    orig_boundary = SaveCoordinator.at_boundary

    def seen(coordinator, *a, **kw):
        boundaries.append(kw["micro_step"])
        return orig_boundary(coordinator, *a, **kw)

    monkeypatch.setattr(sw, "take_snapshot", take_then_spoil)
    monkeypatch.setattr(sw.StateWriter, "wait_staged", wait_then_heal)
    monkeypatch.setattr(SaveCoordinator, "at_boundary", seen)
    spec = lm_spec(
        tmp_path / "run",
        "task.config.num_samples=24",
        "train.grad_accum=2",
        "train.epochs=1",
        "checkpoint.save_every={value: 4, unit: micro_steps}",
        "checkpoint.async=true",
        f"deepspeed.zero_stage={zero[0]}",
        *(["scaling.num_workers={min: 1, max: 2}"] if zero.endswith("elastic") else []),
    )
    run(spec)
    err = capfd.readouterr().err
    store = RunStorage(spec.run_url)
    names = store.list_dirs("states")
    assert target not in names  # not committed, and nothing of it left
    assert err.count("the state at micro-step 4 is not finite on rank(s) [0]: not saved") == 1
    committed = [e for e in EventLog(store).read_all() if e["kind"] == "state_committed"]
    after = min(b for b in boundaries if b > 4)  # the request, carried to the next boundary
    assert [int(e["state"]) for e in committed][:1] == [after]
    assert all(e["blocked_seconds"] > 0 for e in committed)
    for name in names:
        assert store.exists("states", name, "manifest.json")
        for rel in store.list_files("states", name, "engine"):
            saved = load_state_file(store.read_bytes("states", name, "engine", rel, limit=1 << 30), rel)
            assert _all_finite(saved), (name, rel)


def _all_finite(obj) -> bool:
    import torch

    if torch.is_tensor(obj):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    return True


def test_a_failing_attempt_ends_its_upload_before_its_failure_leaves_the_loop():
    """An error while a save uploads: the failure reaches the caller only once the upload's writes have
    ended (a later attempt in this process may write the same state's files: nothing of the failed one
    may still be writing then), and the state it wrote is left uncommitted (torn), as a crash leaves it."""
    import threading

    spec = _spec("slowmem://async-failing", "faults=[{at_micro_step: 5, mode: raise}]")  # the save of 4 uploads
    assert run_until_crash(spec)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("syncpoint-upload-")]
    store = RunStorage(spec.run_url)
    assert store.list_names("states") == [f"{4:012d}"] and not store.exists("states", f"{4:012d}", "manifest.json")
