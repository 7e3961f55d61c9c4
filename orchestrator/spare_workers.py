"""Spare Ray worker processes for the job's next worker group, started ahead on each node that hosts ranks.

Why: a new Ray Train worker group (a lost node, a preemption, any failure that is not recovered in
place) waits for Ray to start one new Python process per worker and for each to import Ray Train
before its actor exists: most of what was left of a lost node's restart (bench P4). Ray's raylet
can start worker processes for a job and runtime environment ahead of any request
(``PrestartWorkers``), and hands an idle one to the next actor with the same job and runtime
environment; with Ray Train's worker module preloaded (``PRELOAD_ENV``, read by every worker process
the raylet starts) the new group's actors exist in a fraction of that time (P4 has the numbers).

Why by hand: Ray has no Python API for that call (its core worker's C++ method is not exposed), so
this sends the raylet's own gRPC request (``node_manager_pb2``, Ray's generated stubs, pinned with
Ray in ``pyproject.toml``) with this worker's own job id and serialized runtime environment: the
exact string the raylet hashes to match a worker to an actor. Anything that goes wrong (an older or
newer raylet, no route to it) costs only the speed-up: ``request`` never raises.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from syncpoint.orchestrator.ray_internals import TRAIN_WORKER_MODULE
from syncpoint.policies.contracts.spec import JobSpec

# Ray's raylet setting (read when the raylet starts) for modules every worker process imports before
# it takes work; syncpoint sets it for the raylet of an embedded Ray, a cluster's operator on theirs.
PRELOAD_ENV = "RAY_preload_python_modules"
# How long an idle spare is kept even when the node has more workers than CPUs (Ray's soft limit);
# after that Ray may end it, and the next worker group asks again. The job's end ends them all.
KEEP_ALIVE_S = 24 * 3600
REQUEST_TIMEOUT_S = 10.0
DELAY_S = 10.0  # after a rank's first step: its node's spares start while it trains (``AfterFirstStep``)


@contextlib.contextmanager
def preloading_raylet(spec: JobSpec) -> Iterator[None]:
    """For the block (an embedded ``ray.init``, which starts this node's raylet): every worker process
    that raylet starts imports Ray Train's worker module first, so a spare is warm when an actor
    takes it. A value the caller set wins; the driver's environment is as before afterwards."""
    from syncpoint.orchestrator.warm_nodes import wanted

    if not wanted(spec) or PRELOAD_ENV in os.environ:
        yield
        return
    os.environ[PRELOAD_ENV] = TRAIN_WORKER_MODULE
    try:
        yield
    finally:
        os.environ.pop(PRELOAD_ENV, None)


def request(count: int) -> bool:
    """Ask this node's raylet for ``count`` idle worker processes with this worker's job and runtime
    environment; False (and nothing started) when it could not be asked."""
    try:
        import ray

        from syncpoint.orchestrator.ray_internals import init_grpc_channel

        if not ray.is_initialized():  # not a Ray worker (``ray.nodes`` would connect somewhere)
            return False
        context = ray.get_runtime_context()
        node = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
        common, manager, stubs, runtime_env = _protos()
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        try:
            stubs.NodeManagerServiceStub(channel).PrestartWorkers(
                manager.PrestartWorkersRequest(
                    language=common.Language.PYTHON,
                    job_id=bytes.fromhex(context.get_job_id()),
                    runtime_env_info=runtime_env.RuntimeEnvInfo(
                        serialized_runtime_env=context.get_runtime_env_string()
                    ),
                    keep_alive_duration_secs=KEEP_ALIVE_S,
                    num_workers=count,
                ),
                timeout=REQUEST_TIMEOUT_S,
            )
        finally:
            channel.close()
    except Exception:  # noqa: BLE001 - only the speed-up is lost: the next group starts its workers itself
        return False
    return True


def _protos() -> tuple[Any, Any, Any, Any]:
    """Ray's generated protobuf modules (untyped: their classes are made at import time)."""
    from syncpoint.orchestrator.ray_internals import (
        common_pb2,
        node_manager_pb2,
        node_manager_pb2_grpc,
        runtime_environment_pb2,
    )

    return common_pb2, node_manager_pb2, node_manager_pb2_grpc, runtime_environment_pb2


class AfterFirstStep:
    """Requests ``count`` spares once, on a daemon thread, ``DELAY_S`` after it is first called: the
    supervisor calls it at each heartbeat of its rank, the first of which follows the rank's first
    optimizer step.

    Why not at launch, and not at once: a spare's start (a Python process importing Ray Train, about
    a CPU-second) beside a restore or an in-place recovery slows them on a small node (bench P4:
    spares asked for at the first step tripled an in-place recovery that followed half a second
    later). A failure that soon after a start is rare; the spares start while the rank trains, and
    they serve every later worker group of the job."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.timer: threading.Timer | None = None

    def __call__(self) -> None:
        if self.timer is None:
            self.timer = threading.Timer(DELAY_S, request, args=(self.count,))
            self.timer.name, self.timer.daemon = "syncpoint-spares", True
            self.timer.start()
