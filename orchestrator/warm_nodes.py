"""Keep a warm training-process server on every node that can host a rank, for the job's length.

Why the driver: a new Ray Train worker group forks its training processes from its node's warm
server (``syncpoint.workers.supervision.zygote``) and skips importing torch and DeepSpeed, but a lost node's
replacement that is already in the cluster holds no rank yet, so no supervisor of this job has
warmed it. The driver knows the cluster's nodes and outlives every attempt: every
``zygote.WARM_EVERY_S`` it starts (or touches) the server on each live node with a worker's CPUs,
so nodes that join later (an autoscaler's replacement) are warm within a round, and on an embedded
run the local node's imports overlap Ray's own start. When the job ends, it stops them all; a
server the driver could not reach ends by itself (``zygote.IDLE_S`` after its last touch).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from syncpoint.policies.contracts.spec import JobSpec

STOP_WAIT_S = 30.0


def _warm(k: str, hash_seed: str, env: dict[str, str]) -> bool:
    from syncpoint.workers.supervision import zygote

    # DS_ACCELERATOR as each worker sets it before DeepSpeed is imported; ``env``: zygote.server_env's
    sock, _ = zygote.ensure(k, hash_seed, "touch", {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), **env})
    sock.close()
    return True


def server_key(spec: JobSpec, submission: str) -> tuple[str, str]:
    """The submission's key for its nodes' warm servers, and the hash seed they start with."""
    from syncpoint.policies.decisions.seeds import hash_seed as job_hash_seed
    from syncpoint.workers.supervision import zygote

    hash_seed = str(job_hash_seed(spec.train.seed))
    return zygote.key(submission, hash_seed), hash_seed


def warm_this_node(spec: JobSpec, submission: str) -> bool:
    """Start this node's server now, before an embedded Ray starts here (its ranks will run on this
    node): its imports then overlap Ray's own start instead of following it. False when not wanted
    or not possible (the workers then start it, as on a cluster)."""
    if not wanted(spec):
        return False
    try:
        _warm(*server_key(spec, submission), _server_env(spec))
    except Exception:  # noqa: BLE001 - no warm server here: the workers start one, or fork their own
        return False
    return True


def _server_env(spec: JobSpec) -> dict[str, str]:
    from syncpoint.workers.supervision import zygote

    return zygote.server_env(spec)


def stop_this_node(spec: JobSpec, submission: str) -> None:
    """Stop this node's server of the submission (a job whose embedded Ray never reached the end)."""
    from syncpoint.workers.supervision import zygote

    with contextlib.suppress(Exception):
        zygote.stop(server_key(spec, submission)[0])


def wanted(spec: JobSpec) -> bool:
    """Whether the job's training processes come from warm servers (CPU ranks that recover in place)."""
    return spec.failure.in_place and spec.failure.warm_nodes and not spec.scaling.use_gpu


@contextlib.contextmanager
def warm_nodes(spec: JobSpec, submission: str, embedded: bool = False) -> Iterator[None]:
    """For the block (the job's fit): warm every node now and each round; stop them all after.

    ``embedded``: the cluster is this node alone, so the driver warms its server itself, each round
    after the first (``warm_this_node`` did that one), instead of through a Ray task per round: a
    task's worker process (two, with the one Ray starts beside it) would start on the job's cores
    while its controller and workers do."""
    if not wanted(spec):
        yield
        return
    k, hash_seed = server_key(spec, submission)
    env = _server_env(spec)
    done = threading.Event()
    target, args = (
        (_keep_this_node_warm, (k, hash_seed, env, done))
        if embedded
        else (_keep_warm, (k, hash_seed, env, spec.scaling.cpus_per_worker, done))
    )
    thread = threading.Thread(target=target, args=args, name="syncpoint-warm-nodes")
    thread.daemon = True
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)
        with contextlib.suppress(Exception):  # best effort: a server nobody reaches ends when idle
            if embedded:
                from syncpoint.workers.supervision import zygote

                zygote.stop(k)
            else:
                _stop_all(k)


def _keep_warm(k: str, hash_seed: str, env: dict[str, str], cpus: float, done: threading.Event) -> None:
    import ray

    from syncpoint.orchestrator.node_tasks import live_nodes, run_on_nodes
    from syncpoint.workers.supervision import zygote

    refs: list[Any] = []
    while not done.is_set():
        with contextlib.suppress(Exception):  # a round that fails (Ray busy, a node leaving) is retried next round
            if refs:
                _, refs = ray.wait(refs, num_returns=len(refs), timeout=0)  # drop finished ones
            refs += run_on_nodes(_warm, live_nodes(cpus), k, hash_seed, env)
        done.wait(zygote.WARM_EVERY_S)


def _keep_this_node_warm(k: str, hash_seed: str, env: dict[str, str], done: threading.Event) -> None:
    from syncpoint.workers.supervision import zygote

    while not done.wait(zygote.WARM_EVERY_S):
        with contextlib.suppress(Exception):  # a round that fails is retried next round
            _warm(k, hash_seed, env)


def _stop_all(k: str) -> None:
    import ray

    from syncpoint.orchestrator.node_tasks import live_nodes, run_on_nodes
    from syncpoint.workers.supervision import zygote

    refs = run_on_nodes(zygote.stop, live_nodes(), k)
    ray.wait(refs, num_returns=len(refs), timeout=STOP_WAIT_S)
