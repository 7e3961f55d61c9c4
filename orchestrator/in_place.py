"""Ray Train's side of in-place recovery: each worker's training function becomes the supervisor of
its rank's training process (``syncpoint.workers.supervision.supervisor``), with Ray's calls it proxies.

Why the preemption notice is read from the worker's local preemption context (a Ray Train
internal, checked by ``tests/integration/orchestrator/test_failure_policy.py`` with the policy's other names) and not
through ``ray.train.get_preemption_info``: that call is a barrier across the worker group, and a
generation that fails between two of them would leave the survivors' supervisors waiting in it.
The loop agrees on notices itself at every boundary (every rank's count, all-reduced).
"""

from __future__ import annotations

import time
from typing import Any

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.grace_window import Notice


def notice_record(info: Any) -> Notice | None:
    """Ray's ``PreemptionInfo`` (or None) in the loop's notice format."""
    if info is None:
        return None
    return {
        "source": "ray-drain",
        "deadline_ms": info.deadline_ms,
        "nodes": info.preempted_node_ids,
        "ranks": info.preempted_ranks,
    }


def local_preemption_notice() -> Notice | None:
    """This worker's copy of Ray's preemption info (the PreemptionWatcher fans it out to every
    worker), in the loop's notice format."""
    from syncpoint.orchestrator.ray_internals import train_context

    return notice_record(train_context.get_train_context().preemption_context.preemption_info)


def supervise_on_ray(spec: JobSpec, config: dict[str, Any], launched_at: float) -> None:
    """Run this Ray Train worker's rank as a supervisor until the run finishes or a failure goes to Ray."""
    import ray
    import ray.train
    import ray.train.collective

    from syncpoint.orchestrator.driver_signals import StopWatch
    from syncpoint.orchestrator.failure_policy import record_interruption
    from syncpoint.orchestrator.quiet import quiet_training_process
    from syncpoint.orchestrator.spare_workers import AfterFirstStep
    from syncpoint.orchestrator.warm_nodes import server_key, wanted
    from syncpoint.workers.supervision.supervisor import CoordinatorPlan, Hooks, Supervisor, in_place_decider

    ctx = ray.train.get_context()
    submission = config["submission_id"]
    board: Any = config.get("heartbeat")

    # one request per node, for its ranks, once this rank trains (``spare_workers.AfterFirstStep``)
    spares = AfterFirstStep(ctx.get_local_world_size()) if wanted(spec) and ctx.get_local_rank() == 0 else None

    def beat(rank: int, attempt: int, step: int, at: float) -> None:
        if spares is not None:
            spares()
        board.beat.remote(rank, attempt, step, at)  # fire and forget, as the loop's Heartbeat sends it

    driver = StopWatch(board)

    def notice() -> Notice | None:  # the driver's own signal stops the job; a drain's node goes
        return driver.notice() or local_preemption_notice()

    def before(journal: Any) -> None:  # the measured interruption point, as Ray's failure policy writes it
        record_interruption(spec.run_url, board, time.time(), journal, submission)

    hooks = Hooks(
        decide=in_place_decider(spec, submission, before),
        notice=notice,
        beat=beat if board is not None else None,
        report=ray.train.report,  # Train v2: a barrier, every rank at the same logged steps; no checkpoint
        node_id=ray.get_runtime_context().get_node_id(),
        worker_id=ray.get_runtime_context().get_actor_id() or "",
        submission_id=submission,
        print_progress=config.get("print_progress", True),
        launched_at=launched_at,
        child_setup=quiet_training_process,
        warm_key=server_key(spec, submission)[0] if wanted(spec) else None,
    )
    plan = CoordinatorPlan(
        rank=ctx.get_world_rank(),
        world=ctx.get_world_size(),
        host=ray.util.get_node_ip_address(),
        timeout_s=spec.scaling.collective_timeout_s,
        exchange=ray.train.collective.broadcast_from_rank_zero,  # Ray Train's own: no torch process group
    )
    if spares is not None and board is None:  # no heartbeats to wait for: DELAY_S after the launch
        spares()
    try:
        Supervisor(spec, plan, ctx.get_local_rank(), hooks).run()
    finally:
        driver.close()
