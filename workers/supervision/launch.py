"""Run the loop without Ray: in this process (world size 1) or in spawned processes.

Why: the loop only needs a torch process group. Tests and equivalence grids use this launcher so
they stay fast and Ray-free; Ray Train is just another launcher around the same ``run_worker``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.failures import REPORTED_ATTR
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import release_lease
from syncpoint.workers.supervision import zygote
from syncpoint.workers.supervision.fork_context import adopt_environment
from syncpoint.workers.supervision.fork_context import context as _context
from syncpoint.workers.supervision.fork_context import environ as _environ
from syncpoint.workers.supervision.fork_context import start_method as _start_method
from syncpoint.workers.supervision.free_ports import free_port
from syncpoint.workers.supervision.store_agent import new_namespace, open_store
from syncpoint.workers.training import rng
from syncpoint.workers.training.device import backend, collective_timeout, prepare_process

if TYPE_CHECKING:  # the loop imports DeepSpeed: a launcher imports it when it runs one
    from syncpoint.workers.training.worker_context import WorkerResult


def ensure_single_process_group(backend_name: str = "gloo") -> None:
    """A world-size-1 group for in-process runs, created once per backend and reused."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("in-process launcher needs a world-size-1 process group")
        if dist.get_backend() == backend_name:
            return
        dist.destroy_process_group()
    dist.init_process_group(backend_name, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def run_in_process(spec: JobSpec, **ctx_kwargs: Any) -> WorkerResult:
    """Run the loop in this process; an injected crash with ``mode: raise`` propagates to the caller."""
    from syncpoint.workers.training.loop import run_worker
    from syncpoint.workers.training.worker_context import WorkerContext

    prepare_process(spec)
    ensure_single_process_group(backend(spec))
    ctx_kwargs.setdefault("submission_id", uuid.uuid4().hex)
    try:
        with _local_rank_zero():
            return run_worker(spec, WorkerContext(**ctx_kwargs))
    finally:  # this process is also the driver: the submission is over, free the run directory
        release_lease(RunStorage(spec.run_url), ctx_kwargs["submission_id"])


@contextlib.contextmanager
def _local_rank_zero() -> Iterator[None]:
    """``LOCAL_RANK=0`` for the length of one in-process run, then what was there before.

    DeepSpeed's engine reads ``LOCAL_RANK`` when it is built, so the run needs it; left behind, it
    makes anything the caller starts later in this process (accelerate's ``PartialState``, an HF
    Trainer) take the process for one rank of a multi-process job and wait for ``MASTER_ADDR``.
    """
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


def _child(
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
            exchange = _StoreExchange(rank, port, start_wait_s, namespace)
            plan = CoordinatorPlan(rank, world, "127.0.0.1", spec.scaling.collective_timeout_s, exchange)
            Supervisor(spec, plan, rank, hooks).run()
        else:
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


class _StoreExchange:
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


def driver_notice(stop_file: str) -> Callable[[], dict[str, Any] | None]:
    """A local run's notice source: the driver's stop, once its signal's name is in ``stop_file``
    (in the driver's private temp directory, 0700: only this user can write it). Read at each
    boundary: one ``stat`` while there is none."""
    from syncpoint.workers.supervision.preemption import DRIVER

    def notice() -> dict[str, Any] | None:
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


def run_spawned(
    spec: JobSpec,
    world_size: int | None = None,
    timeout: float = 600,
    quiet: bool = True,
    in_place: bool = False,
    warm: bool | None = None,
    submission: str | None = None,
    stop_file: str | None = None,
    child_setup: Callable[[JobSpec], None] | None = None,
) -> list[int]:
    """Run ``world_size`` ranks as spawned processes; returns their exit codes.

    When one rank dies (an injected crash, an error), the others are killed after a short grace,
    as a real launcher would tear down the group; the storage is left exactly as they left it.
    ``in_place``: each rank supervises its training process (``syncpoint.workers.supervision.supervisor``), as a
    Ray Train worker with ``failure.in_place`` does, so failures within budget recover inside the run.
    ``warm``: with ``in_place``, the supervisors fork from this machine's warm server
    (``syncpoint.workers.supervision.zygote``), stopped when the ranks are done, as the driver stops it on Ray.
    None: as a Ray job does, wherever a warm server applies (ranks forked on CPU); False: each
    supervisor forks from a fork server of its own, the path of a node without one. Why warm by
    default: the ranks' supervisors share one server's imports of torch and DeepSpeed instead of
    each starting its own (measured: an in-place run of two ranks 9.7-11.6 s of CPU vs 14.5-16.0 s).
    ``submission``: the submission id (default a new one); ``stop_file``: with ``in_place``, a local
    run's (``syncpoint run --local``): the driver's stop notice is read from it, and a failure past the
    budget is recorded by rank 0's supervisor; ``child_setup``: run in each training process first (a
    module-level function). However this returns (an exception included), no rank outlives it.
    """
    world = world_size or spec.scaling.max_workers
    port = free_port()
    # every rank (and each DataLoader worker it starts) hashes strings as the job's every other attempt does
    hash_seed = str(rng.hash_seed(spec.train.seed))
    ctx = _context(_start_method(spec), hash_seed)
    submission = submission or uuid.uuid4().hex
    environ = {**os.environ, **spec.scaling.env, "PYTHONHASHSEED": hash_seed}  # the job's variables, as on Ray
    if warm is None:
        warm = _start_method(spec) == "forkserver"
    warm_key = zygote.key(submission, hash_seed) if warm and in_place else None
    # the ranks' own secret (their store's namespace), handed over in their arguments, never over a port
    namespace = new_namespace()
    args = (
        spec.model_dump_json(),
        world,
        port,
        quiet,
        submission,
        environ,
        in_place,
        warm_key,
        min(timeout, 600),
        namespace,
        stop_file,
        child_setup,
    )
    procs = [ctx.Process(target=_child, args=(args[0], r, *args[1:])) for r in range(world)]
    try:
        with _environ(
            PYTHONHASHSEED=hash_seed
        ):  # a spawned rank's interpreter (or a restarted fork server) starts with it
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout
        first_fail = None
        while any(p.is_alive() for p in procs):
            for p in procs:
                if not p.is_alive() and p.exitcode not in (0, None) and first_fail is None:
                    first_fail = time.monotonic()
            if first_fail and time.monotonic() - first_fail > 3:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join()
        if warm_key is not None:
            zygote.stop(warm_key)
        release_lease(RunStorage(spec.run_url), submission)
    return [p.exitcode if p.exitcode is not None else -9 for p in procs]
