"""Ray Train wiring: a ``TorchTrainer`` whose workers run ``syncpoint.workers.training.loop.run_worker``.

Storage is the source of truth for resuming: every new worker group (a Ray Train restart, a
re-submitted job, a new KubeRay cluster) negotiates its state from ``<storage>/<name>/states``
through the resume policy. Committed states are deliberately *not* registered with Ray's
checkpoint manager: Ray's snapshot would then name directories that syncpoint's retention
deletes, and Ray fails start-up on a checkpoint someone else removed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from syncpoint.orchestrator.failure_report import failure_report
from syncpoint.orchestrator.job_env import HEALTH_CHECK_ENV as HEALTH_CHECK_ENV  # where it was first
from syncpoint.orchestrator.job_env import (
    driver_env_vars,
    job_runtime_env,
    ray_storage_path,
    ray_train_defaults,
    submitted_to,
    worker_runtime_env,
)
from syncpoint.orchestrator.quiet import quiet_driver, quiet_driver_start, quiet_worker
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.grace_window import Notice
from syncpoint.policies.decisions.redact import redact_text

if TYPE_CHECKING:
    from syncpoint.orchestrator.driver_signals import DriverSignals
    from syncpoint.orchestrator.timeline import RunSummary
from syncpoint.orchestrator.run_outcome import finish, not_retried, placement_report


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point inside each Ray Train worker (a torch process group is already set up)."""
    launched_at = time.time()  # before the imports below (DeepSpeed's takes seconds): start-up begins here
    import ray
    import ray.train

    spec = JobSpec.model_validate(config["spec"])
    from syncpoint.workers.observation.rank_output import own_output

    own_output(ray.train.get_context().get_world_rank(), spec.train.prints)  # each print once (train.prints)
    # before syncpoint.workers.training.loop imports DeepSpeed; a supervisor's training process quiets its own
    quiet_worker(spec, trains_here=not spec.failure.in_place)
    if spec.failure.in_place:  # this worker supervises its rank's training process
        from syncpoint.orchestrator.in_place import supervise_on_ray

        supervise_on_ray(spec, config, launched_at)
        return

    from syncpoint.workers.training.loop import run_worker
    from syncpoint.workers.training.worker_context import WorkerContext

    imported_at = time.time()
    ctx = ray.train.get_context()
    os.environ["LOCAL_RANK"] = str(ctx.get_local_rank())

    from syncpoint.orchestrator.driver_signals import StopWatch
    from syncpoint.orchestrator.in_place import notice_record

    driver = StopWatch(config.get("heartbeat"))

    def notice() -> Notice | None:
        drain = notice_record(ray.train.get_preemption_info())  # a collective: every rank, every boundary
        return driver.notice() or drain  # the driver's own signal stops the job; a drain's node goes

    def report(metrics: dict[str, float]) -> None:
        ray.train.report(metrics)  # Train v2: a barrier, every rank at the same logged steps; no checkpoint

    try:
        run_worker(
            spec,
            WorkerContext(
                preemption_notice=notice,
                node_id=ray.get_runtime_context().get_node_id(),
                submission_id=config["submission_id"],
                report_metrics=report,
                print_progress=config.get("print_progress", True),
                heartbeat_board=config.get("heartbeat"),
                launched_at=launched_at,
                imported_at=imported_at,
            ),
        )
    except Exception as e:  # a failure while setting up: where (the loop's own, when it has one, wins)
        from syncpoint.workers.supervision.failure_site import annotate, attach_traceback

        annotate(e, ctx.get_world_rank(), None)
        attach_traceback(e)  # the controller prints it once for the worker group (failure_policy.print_failure)
        raise
    finally:
        driver.close()


def connect(spec: JobSpec, address: str | None, *, dashboard: bool = False, metrics_port: int | None = None) -> bool:
    """Connect to a cluster, or start an embedded local Ray (with Ray's dashboard only if ``dashboard``:
    ``syncpoint.orchestrator.embedded_ray``; its Prometheus endpoint on ``metrics_port``, said in one
    line); returns True if embedded."""
    import ray

    if ray.is_initialized():  # a caller (drill, tests) already connected
        quiet_driver()
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    quiet_driver_start()
    runtime_env = job_runtime_env(driver_env_vars())
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
        quiet_driver()
        return False
    from syncpoint.orchestrator.embedded_ray import init_options

    needed = spec.scaling.max_workers * spec.scaling.cpus_per_worker
    # address="local": a new embedded instance even when another Ray runs on this machine (without
    # it, ray.init joins that one and then refuses num_cpus: "When connecting to an existing cluster").
    num_cpus = max(int(needed + 0.999), 1)
    from syncpoint.orchestrator.spare_workers import preloading_raylet

    with preloading_raylet(spec):
        ray.init(
            address="local",
            num_cpus=num_cpus,
            log_to_driver=True,
            runtime_env=runtime_env,
            **init_options(dashboard, metrics_port),
        )
    quiet_driver()
    if metrics_port is not None:
        print(
            f"syncpoint: Ray's metrics, the run's syncpoint_* series among them: {metrics_url(metrics_port)}",
            flush=True,
        )
    return True


def metrics_url(port: int) -> str:
    """Where an embedded Ray serves its Prometheus endpoint (``--metrics-port``)."""
    return f"http://127.0.0.1:{port}/metrics"


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended, as ``run_job`` returns it: the run's last line and, for a failed run, why.

    ``reason`` and ``details`` are already redacted (worker errors may quote the storage URL: never
    its credentials); ``summary`` is the finished run's summary (None when failed, or when the fit
    returned without a finish event)."""

    line: str
    failed: bool
    reason: str = ""
    details: str = ""
    summary: RunSummary | None = None
    exit_code: int | None = None  # a stopped run's (128 + the driver's signal); None: 1 if failed, else 0

    @property
    def code(self) -> int:
        """The process's exit code for this outcome."""
        return self.exit_code if self.exit_code is not None else int(self.failed)


def run_on_ray(
    spec: JobSpec,
    address: str | None = None,
    *,
    progress_bar: bool = False,
    dashboard: bool = False,
    rerun: str | None = None,
    metrics_port: int | None = None,
) -> int:
    """Run the job to completion on Ray and print its last line; returns the process exit code (0 ok,
    1 failed, 128 + the signal for a run the driver's signal stopped). A failure's details go to stderr
    above its line.

    ``progress_bar``: the driver shows a live bar (``syncpoint.orchestrator.progress_bar``) and the workers
    print no progress lines of their own. ``dashboard``: an embedded Ray keeps its dashboard. ``rerun``:
    the command that resumes the job; given (the command line's own driver), the driver's SIGINT, SIGTERM
    and SIGHUP are the job's stop notice (``syncpoint.orchestrator.driver_signals``), its last line names
    that command, and a watchdog ends whatever it started when it ends (``run_watchdog``). ``metrics_port``:
    an embedded Ray serves its Prometheus endpoint there (``metrics_export``)."""
    return run_reported(
        spec, address, progress_bar=progress_bar, dashboard=dashboard, rerun=rerun, metrics_port=metrics_port
    ).code


def run_reported(
    spec: JobSpec,
    address: str | None = None,
    *,
    progress_bar: bool = False,
    dashboard: bool = False,
    rerun: str | None = None,
    signals: DriverSignals | None = None,
    metrics_port: int | None = None,
) -> JobOutcome:
    """``run_on_ray``'s run and printing, returning how it ended: a drill names a failed run's last
    line in its verdict. ``signals``: see ``run_job``."""
    return show_outcome(
        run_job(
            spec,
            address,
            progress_bar=progress_bar,
            dashboard=dashboard,
            rerun=rerun,
            signals=signals,
            metrics_port=metrics_port,
        )
    )


def show_outcome(outcome: JobOutcome) -> JobOutcome:
    """Print a run's last line: a failed run's on stderr, after its details, a stopped or finished
    run's on stdout."""
    if outcome.failed:  # printed last: a failed run's last line says why
        if outcome.details:
            print(outcome.details, file=sys.stderr)
        print(outcome.line, file=sys.stderr, flush=True)
    else:
        print(outcome.line, flush=True)
    return outcome


def run_job(
    spec: JobSpec,
    address: str | None = None,
    *,
    progress_bar: bool = False,
    dashboard: bool = False,
    rerun: str | None = None,
    signals: DriverSignals | None = None,
    metrics_port: int | None = None,
) -> JobOutcome:
    """Run the job to completion on Ray (``address``, ``RAY_ADDRESS``, else an embedded local Ray,
    with Ray's dashboard if ``dashboard``); returns how it ended without printing its last line
    (``run_on_ray`` and ``syncpoint.run`` both call this). ``rerun``: see ``run_on_ray``. ``signals``:
    a caller's own (a drill's, whose runs share one notice: it installed them and watches its own
    processes), used instead of ``rerun``'s. ``metrics_port``: see ``run_on_ray``."""
    import ray

    how = _How(progress_bar, dashboard, metrics_port)
    embedded = not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS"))
    with ray_train_defaults(spec, embedded):
        if signals is not None:
            return _run_noticed(spec, address, how, signals)
        if rerun is None:
            return _run_job(spec, address, how)
        from syncpoint.orchestrator.driver_signals import DriverSignals
        from syncpoint.orchestrator.run_watchdog import ensure

        ensure()  # the command's own driver: nothing it starts outlives it, however it ends

        with DriverSignals(spec.checkpoint.sigterm_grace_s, _driver_lines(spec), rerun) as signals:
            return _run_noticed(spec, address, how, signals)


@dataclass(frozen=True)
class _How:
    """How the driver shows and serves a run: the live bar, an embedded Ray's dashboard and metrics port."""

    progress_bar: bool = False
    dashboard: bool = False
    metrics_port: int | None = None


def _run_noticed(spec: JobSpec, address: str | None, how: _How, signals: DriverSignals) -> JobOutcome:
    """The job with the driver's signals as its notice; a second signal stops it at once."""
    try:
        return _run_job(spec, address, how, signals=signals)
    except KeyboardInterrupt:  # StopNow, or Ray's own for it (``driver_signals.StopNow``)
        if not signals.at_once:
            raise
        return stopped(spec, signals, at_once=True)


def _driver_lines(spec: JobSpec) -> Callable[[str], None]:
    """The driver's own lines about a signal: redacted, flushed, on stderr (the last line goes to stdout)."""

    def say(line: str) -> None:
        print(redact_text(line, spec.storage), file=sys.stderr, flush=True)

    return say


def finished_since(spec: JobSpec, since: float) -> bool:
    """Whether the run's log has a ``finished`` event written since ``since`` (this submission's end)."""
    from syncpoint.policies.contracts.journal import Finished
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    try:
        return any(e.time >= since for e in EventLog(RunStorage(spec.run_url)).journal().of_kind(Finished))
    except Exception:  # noqa: BLE001 - an unreadable log: not known to have finished
        return False


def stopped(spec: JobSpec, signals: DriverSignals, *, at_once: bool = False) -> JobOutcome:
    """A run the driver's signal stopped: what it kept (the last committed state) and how to go on."""
    from syncpoint.policies.contracts.journal import StateCommitted
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    try:
        commits = EventLog(RunStorage(spec.run_url)).journal().of_kind(StateCommitted)
    except Exception:  # noqa: BLE001 - an unreadable log: the line still says how to go on
        commits = []
    last = commits[-1] if commits else None
    how = f"at once on a second signal after {signals.name}" if at_once else f"on {signals.name}"
    nothing_more = "; nothing more was saved" if at_once else ""
    if last is None:
        line = f"syncpoint: stopped {how}{nothing_more}; no state was committed: `{signals.rerun}` starts it again"
    else:
        kept = f"state {last.state} (optimizer step {last.optimizer_step})"
        then = "resumes it" if signals.rerun_resumes else "starts over"
        line = f"syncpoint: stopped {how} at {kept}{nothing_more}; `{signals.rerun}` {then}"
    return JobOutcome(line=redact_text(line, spec.storage), failed=False, exit_code=signals.exit_code())


def _run_job(spec: JobSpec, address: str | None, how: _How, signals: DriverSignals | None = None) -> JobOutcome:
    import ray

    from syncpoint.orchestrator.warm_nodes import warm_nodes, warm_this_node
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    submitted = EventLog(RunStorage(spec.run_url), source="driver").emit(
        "submitted", name=spec.name, address=submitted_to(address, os.environ, connected=ray.is_initialized())
    )
    await_predecessor(spec)
    if signals is not None:
        signals.install()  # from here on the driver's signals are the job's notice
    # A connection this call makes, it closes before the last line: a connected driver keeps
    # streaming worker logs (Ray's deduplicated repeats arrive late), which would follow that line.
    ours = not ray.is_initialized()
    submission = uuid.uuid4().hex
    embedded = ours and not (address or os.environ.get("RAY_ADDRESS"))
    prewarmed = embedded and warm_this_node(spec, submission)  # its imports overlap Ray's start
    connect(spec, address, dashboard=how.dashboard, metrics_port=how.metrics_port if embedded else None)
    if signals is not None:
        signals.install()  # again: ray.init's core worker put its own SIGTERM handler (a stack dump) in place
    board = None
    finished = False
    failure: tuple[str, str] | None = None
    try:
        board = heartbeat_board()
        if signals is not None:
            signals.attach(board)
        trainer = _job_trainer(spec, embedded, how, submission, board, own_sigint=signals is not None)
        from syncpoint.orchestrator.failure_policy import installed

        try:
            policy = installed(spec.run_url, board, spec.failure.placement_timeout_s, submission)
            with (
                policy,
                warm_nodes(spec, submission, embedded),
                _progress_bar(spec, how.progress_bar, since=submitted.time),
                _metrics(spec, submission),
            ):
                if signals is None or signals.received is None:  # stopped before it started: no training
                    trainer.fit()
            finished = True
        except Exception as e:  # noqa: BLE001 - any failure of the fit is reported by its reason, below
            failure = placement_report(spec, e) or failure_report(e)
            failure = (failure[0] + not_retried(spec, submission), failure[1])
    finally:
        _end_submission(spec, submission, finished=finished, board=board, ours=ours, prewarmed=prewarmed)
    return _outcome(spec, failure, signals, lambda: finished_since(spec, submitted.time))


def _job_trainer(spec: JobSpec, embedded: bool, how: _How, submission: str, board: Any, *, own_sigint: bool) -> Any:
    """The job's trainer, its workers running ``train_loop_per_worker`` with the job's scaling, failure
    budget, storage and runtime env."""
    # Train V2's classes, what `ray.train` and `ray.train.torch` export at run time (type checkers see V1's there)
    from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig

    s = spec.scaling
    return _trainer(spec, embedded, how.dashboard, own_sigint=own_sigint)(
        train_loop_per_worker,
        train_loop_config={
            "spec": spec.model_dump(mode="json"),
            "submission_id": submission,
            "print_progress": not how.progress_bar,
            "heartbeat": board,
        },
        scaling_config=ScalingConfig(
            num_workers=(s.min_workers, s.max_workers) if s.elastic else s.max_workers,
            use_gpu=s.use_gpu,
            resources_per_worker={"CPU": s.cpus_per_worker},
        ),
        **_backend(spec),
        run_config=RunConfig(
            name=spec.name,
            storage_path=ray_storage_path(spec),
            worker_runtime_env=dict(worker_runtime_env(spec)),
            failure_config=FailureConfig(
                max_failures=spec.failure.max_failures, max_preemption_failures=spec.failure.max_preemptions
            ),
        ),
    )


def _end_submission(spec: JobSpec, submission: str, *, finished: bool, board: Any, ours: bool, prewarmed: bool) -> None:
    """What a submission leaves behind goes, however it ended: its memory copies, its lease, its
    heartbeat board, the Ray it started and the warm server it started ahead of Ray."""
    import ray

    from syncpoint.orchestrator.memory_cleanup import remove_on_nodes
    from syncpoint.orchestrator.warm_nodes import stop_this_node
    from syncpoint.workers.state.memory_copy import keeps_copies, remove_for
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.storage.lease import release_lease

    # the run's memory copies must not outlive the job: this node's, and (when the job did not
    # finish, so a reaper may have kept one for Ray Train's restart) every node's its ranks ran on
    remove_for(spec.run_url)
    if not finished and keeps_copies(spec.checkpoint.memory_copy, RunStorage(spec.run_url)) and ray.is_initialized():
        with contextlib.suppress(Exception):  # best effort: a node that is gone took its tmpfs with it
            remove_on_nodes(spec.run_url, submission)
    release_lease(RunStorage(spec.run_url), submission)  # the submission is over, whatever its outcome
    if board is not None:
        with contextlib.suppress(Exception):  # the board dies with the driver anyway
            ray.kill(board)
    if ours:
        ray.shutdown()
    if prewarmed:  # stopped with the job's other servers, unless Ray never got that far
        stop_this_node(spec, submission)


def _outcome(
    spec: JobSpec, failure: tuple[str, str] | None, signals: DriverSignals | None, finished_run: Callable[[], bool]
) -> JobOutcome:
    """The job's last line: why it failed, what a driver's signal kept, or the finished run's summary
    (``finished_run``: whether this submission's run finished, read from its log only when a signal came)."""
    if failure is not None:
        reason, details = (redact_text(text, spec.storage) for text in failure)
        return JobOutcome(
            line=f"syncpoint: job {spec.name!r} failed: {reason}", failed=True, reason=reason, details=details
        )
    if signals is not None and signals.received is not None and not finished_run():
        return stopped(spec, signals)
    line, summary = finish(spec)
    return JobOutcome(line=line, failed=False, summary=summary)


def _trainer(spec: JobSpec, embedded: bool = False, dashboard: bool = False, own_sigint: bool = False) -> Any:
    """Ray Train's trainer for the job: a ``TorchTrainer`` when the Ray workers train (their torch
    process group is the job's), Ray Train's plain ``DataParallelTrainer`` when they supervise; without
    a dataset manager, and on an embedded Ray without the helpers only a long-lived cluster needs
    (``embedded_ray``).

    Why: a supervisor never trains; its training processes form their own process group
    (``syncpoint.workers.supervision.supervisor``). A ``TorchTrainer``'s backend imports torch in every worker
    and forms a group there, 3.5 s of every worker group's start on two cores (measured: 4.0-4.4 s
    against 7.3-8.6 s for a no-op train function's group), that is of every restart that needs a
    new group (a lost node) and of every cold start."""
    trainer: type
    if spec.failure.in_place:
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer as trainer
    else:  # its module imports torch
        from ray.train.v2.torch.torch_trainer import TorchTrainer as trainer
    if own_sigint:
        trainer = without_sigint_handler(trainer)
    from syncpoint.orchestrator.embedded_ray import lean_trainer

    return lean_trainer(trainer, embedded, keep_cleaner=dashboard)


def without_sigint_handler(trainer_cls: type) -> type:
    """``trainer_cls`` without Ray Train's own SIGINT handler (it aborts the run at the first Ctrl-C,
    saving nothing): the driver's SIGINT is syncpoint's stop notice (``driver_signals``). Ray is pinned,
    so a rename of the method fails this project's Ray tests rather than a user's run."""

    class OwnSigint(trainer_cls):
        def _register_sigint_handler(self, controller: Any) -> None:
            """Nothing: the handler ``driver_signals.DriverSignals`` installed stays."""

    OwnSigint.__name__ = OwnSigint.__qualname__ = trainer_cls.__name__
    return OwnSigint


def _backend(spec: JobSpec) -> dict[str, Any]:
    """The trainer's backend argument (see ``_trainer``)."""
    if spec.failure.in_place:
        from ray.train.backend import BackendConfig

        return {"backend_config": BackendConfig()}  # nothing to set up: the supervisors exchange an address
    from ray.train.torch import TorchConfig

    # the world group's collective timeout (Ray's default is 1800 s); the workers set it for
    # DeepSpeed's own groups too (syncpoint.workers.training.device.apply_collective_timeout)
    s = spec.scaling
    return {"torch_config": TorchConfig(backend="nccl" if s.use_gpu else "gloo", timeout_s=s.collective_timeout_s)}


def await_predecessor(spec: JobSpec) -> str:
    """A re-submission of this job whose predecessor died without a word (a lost head pod takes the
    driver, the Train controller and the lease holder at once) finds that submission's lease still
    young. Rather than start workers that would be refused (a whole KubeRay retry spent), wait here,
    bounded by the lease's remaining TTL and this job's own ``resume.lease_ttl_s``, until it expires
    or its holder shows it is alive (``syncpoint.workers.storage.lease.await_expiry``); rank 0's acquisition then
    decides as always."""
    from syncpoint.policies.decisions.candidates import job_identity
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.storage.lease import await_expiry

    return await_expiry(
        RunStorage(spec.run_url),
        job_identity(spec),
        own_ttl_s=spec.resume.lease_ttl_s,
        say=lambda m: print(redact_text(f"syncpoint: {m}", spec.storage), flush=True),
    )


def heartbeat_board() -> Any:
    """The submission's heartbeat board (``syncpoint.workers.supervision.heartbeat``): a Ray actor without CPUs, kept
    on the
    head (``board_node``), which outlives the worker nodes a preemption takes.

    Why hard affinity: Ray documents that a soft one falls back only when the node is gone or
    infeasible, yet on a local cluster with a CPU-less head it put the board on a worker node in 7 of
    12 creations, and a hard node loss then took the board with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from syncpoint.workers.supervision.heartbeat import BeatBoard

    return (
        ray.remote(BeatBoard)
        .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(board_node(), soft=False))
        .remote()
    )


def board_node() -> str:
    """The head node (Ray marks it with the ``node:__internal_head__`` resource), else the driver's.

    Why not simply the driver's node: a driver started on a machine that runs several raylets (a
    local multi-node cluster, the storm drill, the tests) may attach to a worker node's raylet; the
    board would then live on a node a preemption can take, and every later interruption point would
    go unmeasured."""
    import ray

    try:
        for node in ray.nodes():
            if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
                return str(node["NodeID"])
    except Exception:  # noqa: BLE001 - no node table (GCS busy): the driver's node
        pass
    return str(ray.get_runtime_context().get_node_id())


def _metrics(spec: JobSpec, submission: str) -> contextlib.AbstractContextManager[Any]:
    """The run's ``syncpoint_*`` series on Ray's metrics while it trains (``metrics_export``)."""
    from syncpoint.orchestrator.metrics_export import publishing
    from syncpoint.workers.storage import RunStorage

    return publishing(
        RunStorage(spec.run_url),
        job_name=spec.name,
        submission=submission,
        micro_batch_size=spec.train.micro_batch_size,
    )


def _progress_bar(spec: JobSpec, show: bool, since: float) -> contextlib.AbstractContextManager[Any]:
    if not show:
        return contextlib.nullcontext()
    from syncpoint.orchestrator.progress_bar import live_progress
    from syncpoint.workers.storage import RunStorage

    return live_progress(
        RunStorage(spec.run_url), since=since, micro_batch_size=spec.train.micro_batch_size, epochs=spec.train.epochs
    )
