"""Task builders that resolve without importing torch, for the CLI tests whose subject is another field
(storage, trackers, a policy's arguments, the driver's options).

Why: every ``syncpoint run``/``validate``/``k8s`` checks the spec's import paths by importing them in a
fresh interpreter (``syncpoint.orchestrator.import_check``), and ``tests.tasks`` imports torch there:
1.5-1.8 s of CPU a check, about thirty such checks in ``make test`` where the task is incidental. Called,
each builds the task of ``tests.tasks`` of the same name, so a run with it trains as that one does (its
own job: ``task.path`` is part of a run's identity).
"""

from __future__ import annotations

from typing import Any


def linear(config: dict) -> Any:
    """``tests.tasks:linear``."""
    from tests.tasks import linear as build

    return build(config)
