"""A Ray Train callback that records what ``ray.train.report`` delivered, for
tests/integration/orchestrator/test_cli_first_hour.py's embedded-Ray run.

Why a callback and not ``Result.metrics``: in Ray Train v2 a report without a checkpoint reaches the
controller's report callbacks only; ``Result.metrics`` holds the metrics of the latest *checkpoint*
(``TrainController._build_result``), and syncpoint registers none. Ray builds the callbacks named in
``RAY_TRAIN_CALLBACKS`` in the driver (``DataParallelTrainer._create_default_callbacks``); this one
reads its output file from the driver's environment there and appends one JSON line per report from
the controller (same machine). It implements the internal ``ReportCallback`` because Ray wraps only
``RunConfig(callbacks=...)`` in the public ``UserCallback`` handler, and the run's RunConfig is
syncpoint's own.

It is also a worker-group callback: it keeps each worker's pid from the group's start, and each
report line says which of those processes map torch's library (``/proc/<pid>/maps``), so a test
sees whether a Ray Train worker imported torch while it ran, and which actor classes the cluster
had started by then (from the GCS's actor table, which needs no dashboard).
"""

from __future__ import annotations

import json
import os

import ray._private.state
from ray.train.v2._internal.execution.callback import ReportCallback, WorkerGroupCallback

ENV = "SYNCPOINT_TEST_REPORTS"


class RecordReports(ReportCallback, WorkerGroupCallback):
    def __init__(self) -> None:
        self.path = os.environ[ENV]
        self.pids: list[int] = []
        self.actor_classes: list[str] = []

    def after_worker_group_start(self, worker_group) -> None:
        self.pids = [w.metadata.pid for w in worker_group.get_workers()]
        self.actor_classes = sorted({a["ActorClassName"] for a in ray._private.state.actors().values()})

    def after_report(self, training_report, metrics) -> None:
        line = {
            "per_rank": metrics,
            "checkpoint": training_report.checkpoint is not None,
            "worker_pids": self.pids,
            "workers_with_torch": [pid for pid in self.pids if _maps_torch(pid)],
            "actor_classes": self.actor_classes,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _maps_torch(pid: int) -> bool:
    """Whether the process has torch's C++ library mapped (it imported torch)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False
