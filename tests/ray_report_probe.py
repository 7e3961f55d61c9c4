"""A Ray Train callback that records what ``ray.train.report`` delivered, for
tests/integration/test_first_hour.py's embedded-Ray run.

Why a callback and not ``Result.metrics``: in Ray Train v2 a report without a checkpoint reaches the
controller's report callbacks only; ``Result.metrics`` holds the metrics of the latest *checkpoint*
(``TrainController._build_result``), and syncpoint registers none. Ray builds the callbacks named in
``RAY_TRAIN_CALLBACKS`` in the driver (``DataParallelTrainer._create_default_callbacks``); this one
reads its output file from the driver's environment there and appends one JSON line per report from
the controller (same machine). It implements the internal ``ReportCallback`` because Ray wraps only
``RunConfig(callbacks=...)`` in the public ``UserCallback`` handler, and the run's RunConfig is
syncpoint's own.
"""

from __future__ import annotations

import json
import os

from ray.train.v2._internal.execution.callback import ReportCallback

ENV = "SYNCPOINT_TEST_REPORTS"


class RecordReports(ReportCallback):
    def __init__(self) -> None:
        self.path = os.environ[ENV]

    def after_report(self, training_report, metrics) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"per_rank": metrics, "checkpoint": training_report.checkpoint is not None}) + "\n")
