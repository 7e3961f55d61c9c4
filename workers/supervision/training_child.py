"""The training process a supervisor starts: the loop, with Ray's calls proxied over a pipe to its supervisor.

Why a child: a failure of the training process (a crash, an exception, a hung collective) must not
end the Ray Train worker, which recovers in place by starting another; the child reports how it
ended as plain data, never a traceback to unpickle from anyone else.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from syncpoint.policies.contracts.errors import JOB_REFUSALS
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.failures import (
    FINISHED,
    RAISED,
    REPORTED_ATTR,
    TRACEBACK_LIMIT,
    RankEnd,
    failure_reason,
    failure_signature,
    is_ours,
)
from syncpoint.policies.decisions.grace_window import Notice

if TYPE_CHECKING:
    pass


# ---------------------------------------------------------------- the child's side
class ParentLink:
    """The child's pipe to its supervisor: Ray's calls, proxied."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def notice(self) -> Notice | None:
        with self.lock:
            self.conn.send(("notice",))
            reply: Notice | None = self.conn.recv()
            return reply

    def report(self, metrics: dict[str, float]) -> None:
        with self.lock:
            self.conn.send(("report", metrics))

    def end(self, end: RankEnd, error: BaseException | None = None) -> None:
        payload: bytes | None = None
        if error is not None:
            with contextlib.suppress(Exception):  # an exception that does not pickle goes by its description
                import pickle

                payload = pickle.dumps(error)
        with self.lock, contextlib.suppress(OSError):
            self.conn.send(("end", asdict(end), payload))


class _Beats:
    """``board.beat.remote(...)`` as the loop's ``Heartbeat`` calls it, sent over the pipe."""

    def __init__(self, link: ParentLink) -> None:
        self.link = link

    def remote(self, rank: int, attempt: int, step: int, at: float) -> None:
        with self.link.lock:
            self.link.conn.send(("beat", (rank, attempt, step, at)))


class _PipeBoard:
    def __init__(self, link: ParentLink) -> None:
        self.beat = _Beats(link)


def describe(error: BaseException, rank: int) -> RankEnd:
    """How a rank's exception ends its generation, as plain data."""
    from syncpoint.workers.supervision.failure_site import SITE_ATTR

    site = getattr(error, SITE_ATTR, None)
    micro_step = site.get("micro_step") if isinstance(site, dict) else None
    reason = failure_reason(error)[0]
    return RankEnd(
        rank=rank,
        status=RAISED,
        message=reason,
        ours=is_ours(error),
        refusal=reason if isinstance(error, JOB_REFUSALS) else None,
        signature=failure_signature(error),
        micro_step=micro_step if isinstance(micro_step, int) else None,
        traceback="".join(traceback.format_exception(error))[-TRACEBACK_LIMIT:],
    )


@dataclass(frozen=True)
class ChildPlan:
    """What a generation's child is told (picklable: it crosses to a forked or spawned process)."""

    spec_json: str
    rank: int
    world: int
    local_rank: int
    store: tuple[str, int, str]  # rank 0's store: host, port and the job's namespace (secret)
    generation: int
    environ: dict[str, str]
    notice: bool
    beat: bool
    report: bool
    node_id: str
    worker_id: str
    submission_id: str
    print_progress: bool
    launched_at: float
    setup: Callable[[JobSpec], None] | None = None
    warm_start: bool | None = None  # forked from a node's server that was warm before this worker started


def child_main(plan: ChildPlan, conn: Any) -> None:
    """A generation's training process: its own process group on the supervisors' store, then the loop."""
    import torch.distributed as dist

    from syncpoint.workers.supervision.fork_context import adopt_environment, die_with_parent
    from syncpoint.workers.supervision.store_agent import MIN_TIMEOUT_S, open_store

    started = time.time()  # forked: torch and DeepSpeed came imported (the fork server's start, in gen 0)
    die_with_parent()
    # a forked child has its fork server's environment: take the supervisor's
    adopt_environment(
        {**plan.environ, "RANK": str(plan.rank), "WORLD_SIZE": str(plan.world), "LOCAL_RANK": str(plan.local_rank)}
    )
    mp.set_start_method("fork", force=True)  # its DataLoader workers die with it (see launch._child)
    link = ParentLink(conn)
    try:
        from syncpoint.workers.training.device import backend, collective_timeout, prepare_process

        spec = JobSpec.model_validate_json(plan.spec_json)
        from syncpoint.workers.observation.rank_output import own_output

        own_output(plan.rank, spec.train.prints)  # each print once (train.prints), before the task is built
        if plan.setup is not None:
            plan.setup(spec)
        prepare_process(spec)
        timeout = collective_timeout(spec)
        host, port, namespace = plan.store
        store = open_store(host, port, namespace, max(timeout.total_seconds(), MIN_TIMEOUT_S))
        dist.init_process_group(
            backend(spec),
            store=dist.PrefixStore(f"g{plan.generation}/", store),
            rank=plan.rank,
            world_size=plan.world,
            timeout=timeout,
        )
        from syncpoint.workers.training.loop import run_worker
        from syncpoint.workers.training.worker_context import WorkerContext

        run_worker(
            spec,
            WorkerContext(
                preemption_notice=link.notice if plan.notice else None,
                node_id=plan.node_id,
                worker_id=plan.worker_id,
                submission_id=plan.submission_id,
                report_metrics=link.report if plan.report else None,
                print_progress=plan.print_progress,
                heartbeat_board=_PipeBoard(link) if plan.beat else None,
                launched_at=plan.launched_at,
                imported_at=started,
                warm_start=plan.warm_start,
            ),
        )
        link.end(RankEnd(rank=plan.rank, status=FINISHED))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - the supervisor decides; rank 0's prints the traceback, once
        from syncpoint.workers.supervision.failure_site import annotate

        annotate(e, plan.rank, None)
        link.end(describe(e, plan.rank), e)  # its traceback travels with it (failure_lines)
        _flush_and_exit(1)
    _flush_and_exit(0)


def reported(error: BaseException) -> BaseException:
    """``error``, marked as printed already (rank 0's decision printed the generation's failure:
    ``failure_lines``), so a launcher that prints a rank's traceback leaves this one out."""
    with contextlib.suppress(AttributeError, TypeError):  # an exception type that takes no attributes
        setattr(error, REPORTED_ATTR, True)
    return error


def _flush_and_exit(code: int) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
