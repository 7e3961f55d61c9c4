"""One rank of a launch without Ray (``syncpoint.workers.supervision.launch.run_spawned``): its process's
entry point, the address exchange of in-place supervisors and a local run's stop notice.

Why a module of its own, importing neither torch nor DeepSpeed: an in-place rank only supervises (its
training processes are forked from the node's warm server, which has them imported), so a launch that
has no preloaded fork server running yet starts its supervisors as fresh interpreters that import this
alone, instead of first starting a fork server that imports torch and DeepSpeed for processes that never
use them (``syncpoint run --local``'s start-up: issue 50). The rank that trains imports them itself.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.failures import REPORTED_ATTR
from syncpoint.policies.decisions.grace_window import Notice
from syncpoint.workers.supervision.fork_context import adopt_environment
from syncpoint.workers.supervision.store_agent import open_store


def rank_main(
    spec_json: str,
    rank: int,
    world: int,
    port: int,
    quiet: bool,
    submission_id: str,
    environ: dict[str, str],
    in_place: bool = False,
    warm_key: str | None = None,
    start_wait_s: float = 600,
    namespace: str = "",
    stop_file: str | None = None,
    child_setup: Callable[[JobSpec], None] | None = None,
) -> None:
    """One rank's process: its environment and output taken over, then either its supervisor
    (``in_place``: its training processes forked from the warm server ``warm_key`` names, or from a
    fork server of its own) or the training loop on a process group it joins through rank 0's store."""
    # A forked rank inherits the fork server's environment (from when it started): take the caller's.
    adopt_environment(
        {
            **environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    # A process started by a fork server or by spawn makes that its default start method, so the
    # rank's DataLoader workers would be forked by a fork server of the rank's own: they then watch
    # that server, not the rank, and outlive a rank that dies hard (each holding the rank's memory).
    # Forked from the rank, as in a Ray Train worker, they notice its death and exit.
    mp.set_start_method("fork", force=True)
    try:
        spec = JobSpec.model_validate_json(spec_json)
        from syncpoint.workers.observation.rank_output import own_output

        own_output(rank, spec.train.prints)  # each print once (train.prints), before the task is built
        if in_place:  # this rank supervises its training process, as a Ray Train worker does
            from syncpoint.workers.supervision.supervisor import CoordinatorPlan, Hooks, Supervisor, in_place_decider

            hooks = Hooks(
                # a local run's driver has no failure policy of its own: an escalation is recorded here
                decide=in_place_decider(spec, submission_id, record_escalation=stop_file is not None),
                notice=driver_notice(stop_file) if stop_file else None,
                child_setup=child_setup,
                submission_id=submission_id,
                print_progress=not quiet,
                warm_key=warm_key,
            )
            # no process group here, as in a Ray Train worker: the supervisors only exchange an address
            exchange = StoreExchange(rank, port, start_wait_s, namespace)
            plan = CoordinatorPlan(rank, world, "127.0.0.1", spec.scaling.collective_timeout_s, exchange)
            Supervisor(spec, plan, rank, hooks).run()
        else:  # this process trains: torch and DeepSpeed (a fork server's child has them imported)
            import torch.distributed as dist

            from syncpoint.workers.training.device import backend, collective_timeout, prepare_process
            from syncpoint.workers.training.loop import run_worker
            from syncpoint.workers.training.worker_context import WorkerContext

            prepare_process(spec)  # NCCL binds a communicator to the current GPU
            timeout = collective_timeout(spec)
            store = open_store("127.0.0.1", port, namespace, max(timeout.total_seconds(), 60.0), serve=rank == 0)
            dist.init_process_group(
                backend(spec),
                store=store,
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
            run_worker(spec, WorkerContext(print_progress=not quiet, submission_id=submission_id))
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - a spawned rank: any failure prints its traceback and exits non-zero
        if not getattr(e, REPORTED_ATTR, False):  # in place: rank 0's decision printed it (supervisor.reported)
            traceback.print_exc()
        os._exit(1)
    os._exit(0)


class StoreExchange:
    """Rank 0's value on every rank, through a ``TCPStore`` that rank 0 serves on the launcher's port
    (loopback alone, under the launcher's secret namespace, so no other local account reads or forges
    it): what Ray Train's ``broadcast_from_rank_zero`` is to a supervisor on Ray.

    Why not ``scaling.collective_timeout_s`` as its bound: rank 0 first starts its store agent, which
    waits for its fork server's imports of torch and DeepSpeed, and on a starved machine that took
    over a minute. A rank waits for rank 0's value as long as the launcher lets the run live
    (``wait_s``); rank 0's death closes the store, which ends the wait at once."""

    KEY = "syncpoint/supervisors"

    def __init__(self, rank: int, port: int, wait_s: float, namespace: str) -> None:
        self.rank = rank
        self.store = open_store("127.0.0.1", port, namespace, wait_s, serve=rank == 0)

    def __call__(self, value: Any) -> Any:
        if self.rank == 0:
            self.store.set(self.KEY, json.dumps(value))
            return value
        return json.loads(self.store.get(self.KEY))


def driver_notice(stop_file: str) -> Callable[[], Notice | None]:
    """A local run's notice source: the driver's stop, once its signal's name is in ``stop_file``
    (in the driver's private temp directory, 0700: only this user can write it). Read at each
    boundary: one ``stat`` while there is none."""
    from syncpoint.workers.supervision.preemption import DRIVER

    def notice() -> Notice | None:
        try:
            fd = os.open(stop_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            name = os.read(fd, 16).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        return {"source": DRIVER, "signal": name} if name in SIGNAL_NAMES else None

    return notice


SIGNAL_NAMES = ("SIGINT", "SIGTERM", "SIGHUP")
