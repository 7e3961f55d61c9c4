"""What a rank's training is told and what it returns: its launcher's surroundings, its start-up
profile, its result.

Why apart from the loop: the launchers (Ray Train's worker function, the spawned ranks, a supervisor's
training process) build and read these records without importing the loop and DeepSpeed behind it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.workers.observation.metric_sinks import ReportFn
from syncpoint.workers.supervision.preemption import RayNotice

if TYPE_CHECKING:
    pass


@dataclass
class WorkerContext:
    """What the launcher (Ray Train, or a test) tells the loop about its surroundings."""

    # Returns details of an imminent preemption (e.g. from Ray's get_preemption_info), or None.
    # Called at every sync boundary on every rank (Ray's call is itself a collective).
    preemption_notice: RayNotice | None = None
    node_id: str = ""
    # The Ray Train worker's actor id ("" outside Ray): logged per rank, so an in-place recovery
    # (syncpoint.workers.supervision.supervisor) shows it kept the worker group.
    worker_id: str = ""
    print_progress: bool = True
    # One id per `syncpoint run` invocation: a Ray restart inside the same submission shares it, so
    # `resume.policy: fresh` starts over only once and restarts continue their own progress.
    submission_id: str = ""
    # Ray Train's `report` (syncpoint.workers.observation.metric_sinks.RayReport), or None outside Ray. A barrier: every
    # rank calls it at the same boundaries (logged steps as often as Ray collects them, evaluations).
    report_metrics: ReportFn | None = None
    # The driver's heartbeat board (a Ray actor handle, ``syncpoint.workers.supervision.heartbeat``), or None outside
    # Ray:
    # each rank beats its micro-step there, so a failure's real interruption point is measured.
    heartbeat_board: Any | None = None
    # When the launcher started this worker (before its imports); None: when run_worker starts.
    launched_at: float | None = None
    # When the launcher's imports (torch, DeepSpeed, syncpoint) were done; None: not measured.
    imported_at: float | None = None
    # Whether this training process was forked from the node's warm server (syncpoint.workers.supervision.zygote)
    # that was already running when its worker started; None: not forked from one.
    warm_start: bool | None = None


class SetupLaps:
    """Rank 0's start-up profile: seconds per phase from the launch to the attempt's start, in order
    (``AttemptStarted.setup``; bench P12 prints it). Why in the event: a restart's cost is mostly
    start-up, and where it goes must be visible in every run's log, not only in a benchmark."""

    def __init__(self, since: float) -> None:
        self.last = since
        self.seconds: list[tuple[str, float]] = []

    def mark(self, phase: str, at: float | None = None) -> None:
        """The phase that ended now (or at ``at``)."""
        now = time.time() if at is None else at
        self.seconds.append((phase, round(max(0.0, now - self.last), 4)))
        self.last = now


@dataclass
class WorkerResult:
    """What a rank's training returns to the driver: where it ended and the per-step history the
    run's summary, plot and drills read."""

    final_state: str
    global_micro_step: int
    optimizer_step: int
    resumed_from: str | None
    history: list[JSONObject] = field(default_factory=list)
