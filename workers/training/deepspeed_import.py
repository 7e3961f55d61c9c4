"""DeepSpeed imported without MLflow: its autotuner's optional ``import mlflow`` is refused.

Why: ``import deepspeed`` always imports its autotuner (its config module needs the autotuning
config), and the autotuner tries ``import mlflow`` at import time to log tuning runs, which pulls in
MLflow, its GenAI modules and pandas: 1.0 s of the 2.4 s ``import deepspeed`` takes on this 2-core
machine (``python -X importtime``) wherever MLflow is installed, as in any job that tracks with it.
Every process that imports DeepSpeed pays it: each fork server, warm server and rank, each CLI
command that reads a state. syncpoint never runs DeepSpeed's autotuner; the autotuner already treats
a failed import as "no MLflow". So while (and only while) that one module executes, the finder below
answers ``import mlflow`` with an ``ImportError``; everyone else (syncpoint's own MLflow sink, a task)
imports MLflow as before, and a process that had MLflow imported before DeepSpeed is unchanged.

Why by hand: no setting of DeepSpeed or MLflow skips that import (DeepSpeed 0.19.8: ``try: import
mlflow`` at the autotuner's top level).
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec
from typing import Any

AUTOTUNER = "deepspeed.autotuning.autotuner"
REFUSED = "mlflow"


class _NoMlflowForTheAutotuner:
    """A meta-path finder that refuses ``mlflow`` to DeepSpeed's autotuner while it initialises."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name == REFUSED and _initialising(AUTOTUNER):
            raise ImportError(
                f"{REFUSED} is not imported for {AUTOTUNER} (syncpoint.workers.training.deepspeed_import)"
            )
        return None


def _initialising(module: str) -> bool:
    """Whether ``module`` is being executed right now (Python marks its spec while it runs)."""
    mod = sys.modules.get(module)
    return mod is not None and bool(getattr(getattr(mod, "__spec__", None), "_initializing", False))


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once per process (before DeepSpeed's first import)."""
    if not any(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())


install()
