"""The one module that touches Ray Train internals: our failure policy inside Ray's controller.

Ray 2.60's failure policy is not public. ``DataParallelTrainer`` builds it on the driver with
``create_failure_policy(failure_config)`` and ships it to the controller actor, so syncpoint swaps
that factory around ``fit()``. ``tests/test_failures.py`` checks every internal
name used here, so a Ray upgrade that moves them fails loudly instead of silently charging node
losses to ``max_failures``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

from ray.train.v2._internal.execution.failure_handling import default as _default
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2.api import data_parallel_trainer as _dpt
from ray.train.v2.api.exceptions import WorkerGroupError

from policies.failures import PREEMPTION, FailureFacts, classify_failure, user_error_line


class SyncpointFailurePolicy(_default.DefaultFailurePolicy):
    """Ray's default policy, except that node loss and noticed preemptions use the preemption budget."""

    def __init__(self, failure_config, run_url: str) -> None:
        super().__init__(failure_config)
        self.run_url = run_url

    def make_decision(self, training_failed_error) -> FailureDecision:
        facts = gather_facts(training_failed_error, self.run_url)
        verdict = classify_failure(facts)
        ray_counts_as_preemption = facts.ray_says_preempted
        if verdict.kind == PREEMPTION and not ray_counts_as_preemption and isinstance(training_failed_error, WorkerGroupError):
            self._preemption_failures += 1
            limit = self.failure_config.max_preemption_failures
            decision = FailureDecision.RETRY if limit == -1 or self._preemption_failures <= limit else FailureDecision.RAISE
            self._log_decision(decision, training_failed_error, self._preemption_failures,
                               float("inf") if limit == -1 else limit)
        else:
            decision = super().make_decision(training_failed_error)
        _record(self.run_url, verdict, facts, decision, training_failed_error)
        return decision


def gather_facts(error, run_url: str) -> FailureFacts:
    import ray

    from workers.events import EventLog
    from workers.storage import RunStorage

    failures = getattr(error, "worker_failures", {}) or {}
    messages = tuple(user_error_line(str(e)) for _, e in sorted(failures.items()))
    attempt_nodes: list[str] = []
    notice = False
    try:
        events = EventLog(RunStorage(run_url)).read_all()
        starts = [e for e in events if e["kind"] == "attempt_started"]
        if starts:
            last = starts[-1]
            attempt_nodes = list(last.get("nodes") or [])
            notice = any(e["kind"] == "preemption_notice" and e.get("attempt") == last.get("attempt") for e in events)
    except Exception:
        pass
    dead = _dead_nodes()
    system_death = any(_is_system_death(e) for e in failures.values())
    own_node = ray.get_runtime_context().get_node_id()
    if system_death and set(attempt_nodes) - {own_node} and not (set(attempt_nodes) & dead):
        # A worker vanished without a Python exception: Ray marks its node dead only after the GCS
        # health check gives up, so wait (bounded) before calling it an application failure.
        deadline = time.monotonic() + float(os.environ.get("SYNCPOINT_NODE_DEATH_WAIT_S", "30"))
        while time.monotonic() < deadline and not (set(attempt_nodes) & dead):
            time.sleep(0.5)
            dead = _dead_nodes()
    return FailureFacts(
        ray_says_preempted=_default._is_preemption_failure(error),
        dead_attempt_nodes=tuple(sorted(set(attempt_nodes) & dead)),
        notice_logged=notice, messages=messages)


def _dead_nodes() -> set[str]:
    import ray

    try:
        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
    except Exception:
        return set()


def _is_system_death(error: BaseException) -> bool:
    """A worker process or its node disappeared (as opposed to an exception in user code)."""
    from ray.exceptions import RayActorError

    inner = getattr(error, "health_check_failure", error)
    return isinstance(inner, RayActorError) or isinstance(error, RayActorError)


def _record(run_url: str, verdict, facts: FailureFacts, decision, error) -> None:
    try:
        from workers.events import EventLog
        from workers.storage import RunStorage

        EventLog(RunStorage(run_url), source="controller").emit(
            "failure", classified=verdict.kind, reason=verdict.reason, decision=decision.value,
            ranks=sorted(getattr(error, "worker_failures", {}) or {}), messages=list(facts.messages)[:4],
            dead_nodes=list(facts.dead_attempt_nodes))
    except Exception:
        pass


@contextlib.contextmanager
def installed(run_url: str) -> Iterator[None]:
    """Make ``DataParallelTrainer`` build ``SyncpointFailurePolicy`` while a trainer runs ``fit()``."""
    original = _dpt.create_failure_policy
    _dpt.create_failure_policy = lambda failure_config: SyncpointFailurePolicy(failure_config, run_url)
    try:
        yield
    finally:
        _dpt.create_failure_policy = original
