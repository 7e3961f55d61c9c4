"""Failure classification on plain facts, the timeline's lost-work arithmetic, and a guard that
fails loudly when Ray moves the internals ``orchestrator/failure_policy.py`` relies on."""

from __future__ import annotations

import inspect

import pytest

from orchestrator.timeline import format_timeline, merged_steps, restarts
from policies.failures import APPLICATION, PREEMPTION, FailureFacts, classify_failure, user_error_line


def facts(**kw):
    base = dict(ray_says_preempted=False, dead_attempt_nodes=(), notice_logged=False, messages=("ValueError: x",))
    base.update(kw)
    return FailureFacts(**base)


def test_classification():
    assert classify_failure(facts()).kind == APPLICATION
    assert classify_failure(facts()).reason == "ValueError: x"
    assert classify_failure(facts(ray_says_preempted=True)).kind == PREEMPTION
    v = classify_failure(facts(dead_attempt_nodes=("abcdef0123456789",)))
    assert v.kind == PREEMPTION and "abcdef012345" in v.reason
    assert classify_failure(facts(notice_logged=True)).kind == PREEMPTION


def test_user_error_line_picks_the_users_exception():
    tb = 'Traceback (most recent call last):\n  File "x.py", line 3\n    raise ValueError("bad batch")\nValueError: bad batch at call 5\n'
    assert user_error_line(tb) == "ValueError: bad batch at call 5"


def test_ray_internals_used_by_the_failure_policy_still_exist():
    """If this fails after a Ray upgrade, orchestrator/failure_policy.py must be revisited."""
    from ray.train.v2._internal.execution.failure_handling import default
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api import data_parallel_trainer

    import orchestrator.failure_policy as fp

    assert callable(data_parallel_trainer.create_failure_policy)
    assert "create_failure_policy(self.run_config.failure_config)" in inspect.getsource(data_parallel_trainer)
    assert callable(default._is_preemption_failure)
    policy = default.DefaultFailurePolicy.__new__(default.DefaultFailurePolicy)
    default.DefaultFailurePolicy.__init__(policy, __import__("ray.train", fromlist=["FailureConfig"]).FailureConfig())
    assert hasattr(policy, "_preemption_failures") and hasattr(policy, "_log_decision")
    assert {d.name for d in FailureDecision} >= {"RETRY", "RAISE"}
    with fp.installed("memory://x"):
        made = data_parallel_trainer.create_failure_policy(policy.failure_config)
        assert isinstance(made, fp.SyncpointFailurePolicy)
    assert not isinstance(data_parallel_trainer.create_failure_policy(policy.failure_config), fp.SyncpointFailurePolicy)


def _ev(kind, t, **kw):
    return {"kind": kind, "time": t, **kw}


def test_timeline_lost_work():
    events = [
        _ev("attempt_started", 0, attempt=1, global_micro_step=0, resumed_from=None, world_size=2),
        _ev("progress", 1, attempt=1, records=[{"optimizer_step": 1, "global_micro_step": 4, "loss": 2.0, "lr": 1, "time": 1}]),
        _ev("state_committed", 1.1, state="000000000004", global_micro_step=4, optimizer_step=1, bytes=10,
            seconds=0.1, blocked_seconds=0.1, reasons=["interval"]),
        _ev("progress", 3, attempt=1, records=[{"optimizer_step": 2, "global_micro_step": 8, "loss": 1.5, "lr": 1, "time": 3}]),
        _ev("fault_fired", 3.5, attempt=1, global_micro_step=10, rank=1, mode="exit", where="micro-step 10"),
        _ev("failure", 4, classified="preemption", decision="RETRY", reason="node(s) lost: x"),
        _ev("attempt_started", 5, attempt=2, global_micro_step=4, resumed_from="000000000004", world_size=2),
        _ev("progress", 6, attempt=2, records=[{"optimizer_step": 2, "global_micro_step": 8, "loss": 1.5, "lr": 1, "time": 6}]),
    ]
    (r,) = restarts(events)
    assert (r.resumed_micro_step, r.previous_max_micro_step, r.lost_micro_steps) == (4, 10, 6)
    # from the state's snapshot (commit 1.1 minus its 0.1 s save) to the failure (4.0): the crash lost its unflushed tail
    assert r.lost_seconds == pytest.approx(4.0 - 1.0) and r.cause == "preemption"
    assert merged_steps(events)[2]["attempt"] == 2
    text = format_timeline(events)
    assert "lost micro-steps" in text and "000000000004" in text
