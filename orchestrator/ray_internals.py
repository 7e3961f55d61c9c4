"""Every name syncpoint takes from Ray's private modules, in one place, written for Ray 2.60 (``WRITTEN_FOR``).

Why one module: Ray moves its private names (``ray._private``, ``ray.train.v2._internal``, its
generated protobufs) between releases without notice. Listed here, each is imported only when first
used (several belong to one kind of process: the driver, a worker, the controller), and
``tests/integration/orchestrator/test_ray_internals.py`` resolves every one against the installed Ray,
so an upgrade that moves one fails that test rather than a user's run. No other production module
names a private Ray module (a test reads them all); ``pyproject.toml`` pins Ray to this minor version.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

WRITTEN_FOR = "2.60"

# name here -> (Ray's module, its attribute there; None: the module itself)
NAMES: dict[str, tuple[str, str | None]] = {
    # the driver: the cluster's messages and the worker log stream it prints (quiet.quiet_driver)
    "ray_worker": ("ray._private.worker", None),
    "stdstream_dispatcher": ("ray._private.ray_logging", "global_worker_stdstream_dispatcher"),
    "ray_constants": ("ray._private.ray_constants", None),
    # a worker: its train context (the preemption info a drain notice fills in, the report logger)
    "train_context": ("ray.train.v2._internal.execution.context", None),
    # the controller: the failure policy syncpoint puts in place of Ray's (failure_policy)
    "DefaultFailurePolicy": ("ray.train.v2._internal.execution.failure_handling.default", "DefaultFailurePolicy"),
    "is_preemption_failure": ("ray.train.v2._internal.execution.failure_handling.default", "_is_preemption_failure"),
    "FailureDecision": ("ray.train.v2._internal.execution.failure_handling.failure_policy", "FailureDecision"),
    "WorkerGroupStartupTimeoutError": ("ray.train.v2._internal.exceptions", "WorkerGroupStartupTimeoutError"),
    "DEFAULT_WORKER_GROUP_START_TIMEOUT_S": (
        "ray.train.v2._internal.constants",
        "DEFAULT_WORKER_GROUP_START_TIMEOUT_S",
    ),
    "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR": (
        "ray.train.v2._internal.constants",
        "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR",
    ),
    # an embedded run's controller: the helpers it leaves out (embedded_ray)
    "DatasetsCallback": ("ray.train.v2._internal.callbacks.datasets", "DatasetsCallback"),
    "PlacementGroupCleanerCallback": (
        "ray.train.v2._internal.callbacks.placement_group_callback",
        "PlacementGroupCleanerCallback",
    ),
    "FixedScalingPolicy": ("ray.train.v2._internal.execution.scaling_policy.fixed", "FixedScalingPolicy"),
    # spare worker processes asked of a node's raylet (spare_workers)
    "init_grpc_channel": ("ray._private.grpc_utils", "init_grpc_channel"),
    "common_pb2": ("ray.core.generated.common_pb2", None),
    "node_manager_pb2": ("ray.core.generated.node_manager_pb2", None),
    "node_manager_pb2_grpc": ("ray.core.generated.node_manager_pb2_grpc", None),
    "runtime_environment_pb2": ("ray.core.generated.runtime_environment_pb2", None),
    # a drill's or storm's cluster node (cluster_utils.Cluster hands them out)
    "ClusterNode": ("ray._private.node", "Node"),
}

# Ray's private modules by name only: loggers whose lines syncpoint drops, and the module a spare
# worker process imports ahead (resolved by the test too)
AUTH_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
TRAINING_ERROR_LOGGER = "ray.train.v2._internal.util"
BACKEND_SETUP_LOGGER = "ray.train.v2._internal.callbacks.backend_setup"
RESOURCE_REQUEST_LOGGER = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
TRAIN_WORKER_MODULE = "ray.train.v2._internal.execution.worker_group.worker"
MODULE_NAMES = (
    AUTH_TOKEN_LOGGER,
    TRAINING_ERROR_LOGGER,
    BACKEND_SETUP_LOGGER,
    RESOURCE_REQUEST_LOGGER,
    TRAIN_WORKER_MODULE,
)
__all__ = [
    "WRITTEN_FOR",
    "NAMES",
    "MODULE_NAMES",
    "AUTH_TOKEN_LOGGER",
    "TRAINING_ERROR_LOGGER",
    "BACKEND_SETUP_LOGGER",
    "RESOURCE_REQUEST_LOGGER",
    "TRAIN_WORKER_MODULE",
    "ray_worker",
    "stdstream_dispatcher",
    "ray_constants",
    "train_context",
    "DefaultFailurePolicy",
    "is_preemption_failure",
    "FailureDecision",
    "WorkerGroupStartupTimeoutError",
    "DEFAULT_WORKER_GROUP_START_TIMEOUT_S",
    "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR",
    "DatasetsCallback",
    "PlacementGroupCleanerCallback",
    "FixedScalingPolicy",
    "init_grpc_channel",
    "common_pb2",
    "node_manager_pb2",
    "node_manager_pb2_grpc",
    "runtime_environment_pb2",
    "ClusterNode",
]  # NAMES' keys and the constants above (a test checks)

if TYPE_CHECKING:  # what mypy checks the callers against: the same names, imported eagerly
    from ray._private import ray_constants as ray_constants
    from ray._private import worker as ray_worker
    from ray._private.grpc_utils import init_grpc_channel as init_grpc_channel
    from ray._private.node import Node as ClusterNode
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as stdstream_dispatcher
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback as DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback as PlacementGroupCleanerCallback,
    )
    from ray.train.v2._internal.constants import (
        DEFAULT_WORKER_GROUP_START_TIMEOUT_S as DEFAULT_WORKER_GROUP_START_TIMEOUT_S,
    )
    from ray.train.v2._internal.constants import (
        WORKER_GROUP_START_TIMEOUT_S_ENV_VAR as WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
    )
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError as WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution import context as train_context
    from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy as DefaultFailurePolicy
    from ray.train.v2._internal.execution.failure_handling.default import (
        _is_preemption_failure as is_preemption_failure,
    )
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision as FailureDecision
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy as FixedScalingPolicy

    common_pb2: Any
    node_manager_pb2: Any
    node_manager_pb2_grpc: Any
    runtime_environment_pb2: Any


def __getattr__(name: str) -> Any:
    """``from syncpoint.orchestrator.ray_internals import X`` imports Ray's module for ``X`` then."""
    try:
        module, attribute = NAMES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    found = importlib.import_module(module)
    return found if attribute is None else getattr(found, attribute)
