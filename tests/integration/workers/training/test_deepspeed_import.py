"""DeepSpeed imported through syncpoint skips MLflow (``syncpoint.workers.training.deepspeed_import``): its
autotuner sees no MLflow, nothing imported it, and MLflow imports as before afterwards; a process that
imported MLflow first is left as it was. Each case in a fresh interpreter: an import happens once."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT, needs

pytestmark = needs("mlflow")

PROBE = """
import json, sys
{first}
import syncpoint.workers, deepspeed
from deepspeed.autotuning import autotuner
before = "mlflow" in sys.modules
import mlflow
print(json.dumps({{"mlflow_before": before, "autotuner_has_mlflow": autotuner.has_mlflow,
                  "mlflow_imports": hasattr(mlflow, "start_run")}}))
"""


def _probe(first: str = "") -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        cwd=ROOT,
        env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_deepspeed_through_syncpoint_leaves_mlflow_out_until_asked_for():
    assert _probe() == {"mlflow_before": False, "autotuner_has_mlflow": False, "mlflow_imports": True}


def test_mlflow_imported_first_is_left_to_deepspeed_as_before():
    assert _probe("import mlflow") == {"mlflow_before": True, "autotuner_has_mlflow": True, "mlflow_imports": True}
