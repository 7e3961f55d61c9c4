"""Retention's passes (``syncpoint.workers.state.retention``): planned at the commit, their deletes off
the training loop, done before the run ends, and an error in them raised on the loop."""

from __future__ import annotations

import threading

import pytest

from syncpoint.workers.storage import RunStorage
from tests.helpers import lm_spec, run


def _spec(tmp_path, *extra):
    return lm_spec(
        tmp_path / "run",
        "task.config.num_samples=24",
        "train.grad_accum=2",
        "train.epochs=1",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "checkpoint.keep_last=1",
        *extra,
    )


def test_the_loop_trains_on_while_a_pass_deletes_and_the_run_ends_after_it(tmp_path, monkeypatch):
    """The first delete is held until the loop has reached its next boundary (an event, bounded): the
    loop did not wait for it. When the run returns, every pass is done: one state is left."""
    import syncpoint.workers.state.retention as retention
    from syncpoint.workers.state.saving import SaveCoordinator

    boundaries: list[int] = []
    moved_on = threading.Event()
    held: list[bool] = []
    orig_delete, orig_boundary = retention.delete_state, SaveCoordinator.at_boundary

    def held_delete(storage, name):
        if not held:
            held.append(moved_on.wait(120))  # True only if the loop reached a boundary meanwhile
        return orig_delete(storage, name)

    def boundary(coordinator, *a, **kw):
        boundaries.append(kw["micro_step"])
        if held or coordinator.retention.thread is not None:
            moved_on.set()
        return orig_boundary(coordinator, *a, **kw)

    monkeypatch.setattr(retention, "delete_state", held_delete)
    monkeypatch.setattr(SaveCoordinator, "at_boundary", boundary)
    spec = _spec(tmp_path)
    result = run(spec)
    assert held == [True]
    assert RunStorage(spec.run_url).list_dirs("states") == [result.final_state]


def test_an_error_in_a_pass_is_raised_on_the_loop(tmp_path, monkeypatch):
    import syncpoint.workers.state.retention as retention

    def failing(storage, name):
        raise OSError(f"cannot delete {name}: the storage refused")

    monkeypatch.setattr(retention, "delete_state", failing)
    with pytest.raises(OSError, match="the storage refused"):
        run(_spec(tmp_path))


def test_no_save_claims_while_a_pass_deletes(tmp_path, monkeypatch):
    """A pass may delete a torn state whose name the loop saves next: the next save's claim (which every
    rank's writes follow) comes only after the pass. Each delete is slowed so that a claim not waiting
    for it would overlap it; none does."""
    import time

    import syncpoint.workers.state.retention as retention
    import syncpoint.workers.state.writer as sw

    deleting = threading.Event()
    overlaps: list[str] = []
    orig_delete, orig_claim = retention.delete_state, sw.StateWriter._claim

    def slow_delete(storage, name):
        deleting.set()
        try:
            time.sleep(0.3)
            return orig_delete(storage, name)
        finally:
            deleting.clear()

    def claim(writer, name):
        if deleting.is_set():
            overlaps.append(name)
        return orig_claim(writer, name)

    monkeypatch.setattr(retention, "delete_state", slow_delete)
    monkeypatch.setattr(sw.StateWriter, "_claim", claim)
    spec = _spec(tmp_path, "checkpoint.save_every={value: 2, unit: micro_steps}")
    run(spec)
    assert overlaps == []


def test_a_failing_attempt_ends_its_pass_before_it_ends(tmp_path, monkeypatch):
    """The attempt fails (an error at the micro-step right after a commit) while its pass still
    deletes: the failure reaches the caller only once the pass is done, so no delete of this attempt
    runs on beside the next one (which may save a state of a name the pass deletes). Each delete is
    slowed so that a failure not waiting for it would return first (make test once read the states
    while the pass still deleted: tests/integration/policies/decisions/test_resume_policies_e2e.py)."""
    import time

    import syncpoint.workers.state.retention as retention
    from tests.helpers import run_until_crash

    deleted: list[str] = []
    orig_delete = retention.delete_state

    def slow_delete(storage, name):
        time.sleep(0.5)
        orig_delete(storage, name)
        deleted.append(name)

    monkeypatch.setattr(retention, "delete_state", slow_delete)
    spec = _spec(tmp_path, "faults=[{at_micro_step: 5, mode: raise}]")  # the commit of 4 deleted 2
    assert run_until_crash(spec)
    assert deleted == [f"{2:012d}"]
    assert RunStorage(spec.run_url).list_dirs("states") == [f"{4:012d}"]


def test_a_failing_attempt_says_its_pass_failed_too_and_raises_its_own_error(tmp_path, monkeypatch, capsys):
    import syncpoint.workers.state.retention as retention
    from tests.helpers import run_until_crash

    def failing(storage, name):
        raise OSError(f"cannot delete {name}: the storage refused")

    monkeypatch.setattr(retention, "delete_state", failing)
    assert run_until_crash(_spec(tmp_path, "faults=[{at_micro_step: 5, mode: raise}]"))  # the crash, not the OSError
    assert "retention's last pass failed too: OSError: cannot delete 000000000002" in capsys.readouterr().err
