"""Run the loop without Ray: in this process (world size 1) or in spawned processes.

Why: the loop only needs a torch process group. Tests and equivalence grids use this launcher so
they stay fast and Ray-free; Ray Train is just another launcher around the same ``run_worker``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import release_lease
from syncpoint.workers.supervision import zygote
from syncpoint.workers.supervision.fork_context import context as _context
from syncpoint.workers.supervision.fork_context import environ as _environ
from syncpoint.workers.supervision.fork_context import fork_server_running
from syncpoint.workers.supervision.fork_context import start_method as _start_method
from syncpoint.workers.supervision.free_ports import free_port
from syncpoint.workers.supervision.rank_process import rank_main
from syncpoint.workers.supervision.store_agent import new_namespace
from syncpoint.workers.training import rng
from syncpoint.workers.training.device import backend, prepare_process

if TYPE_CHECKING:  # the loop imports DeepSpeed: a launcher imports it when it runs one
    from multiprocessing.process import BaseProcess

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


def _rank_context(spec: JobSpec, hash_seed: str, *, supervisors_only: bool) -> Any:
    """How the ranks' processes start: forked from this process's preloaded fork server, except
    supervisors whose training processes fork from a warm server when no such fork server runs yet:
    fresh interpreters importing ``rank_process`` alone, not a fork server importing torch and
    DeepSpeed for processes that never use them."""
    if supervisors_only and not fork_server_running(hash_seed):
        return mp.get_context("spawn")
    return _context(_start_method(spec), hash_seed)


def _wait_for_ranks(procs: list[BaseProcess], timeout: float) -> None:
    """Until every rank ended, 3 s after the first failed one (the others then are torn down, as a
    real launcher tears down the group), or ``timeout``."""
    deadline = time.monotonic() + timeout
    first_fail = None
    while any(p.is_alive() for p in procs):
        if first_fail is None and any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
            first_fail = time.monotonic()
        if (first_fail and time.monotonic() - first_fail > 3) or time.monotonic() > deadline:
            return
        time.sleep(0.05)


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
    (``syncpoint.workers.supervision.zygote``) of ``submission``, stopped when the ranks are done, as the
    driver stops it on Ray, when this call started it (one already running is its starter's to stop).
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
    submission = submission or uuid.uuid4().hex
    environ = {**os.environ, **spec.scaling.env, "PYTHONHASHSEED": hash_seed}  # the job's variables, as on Ray
    if warm is None:
        warm = _start_method(spec) == "forkserver"
    warm_key = zygote.key(submission, hash_seed) if warm and in_place else None
    # a warm server someone else started (the `--local` driver's, ahead of its checks) is theirs to stop
    started_before = warm_key is not None and zygote.answers(warm_key)
    ctx = _rank_context(spec, hash_seed, supervisors_only=warm_key is not None)
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
    procs = [ctx.Process(target=rank_main, args=(args[0], r, *args[1:])) for r in range(world)]
    try:
        with _environ(
            PYTHONHASHSEED=hash_seed
        ):  # a spawned rank's interpreter (or a restarted fork server) starts with it
            for p in procs:
                p.start()
        _wait_for_ranks(procs, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join()
        if warm_key is not None and not started_before:
            zygote.stop(warm_key)
        release_lease(RunStorage(spec.run_url), submission)
    return [p.exitcode if p.exitcode is not None else -9 for p in procs]
