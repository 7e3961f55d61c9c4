"""The boundary-aware training loop over a DeepSpeed engine.

It needs only a torch process group (one process, several spawned by a test, or Ray Train's
workers), which keeps the big equivalence grids fast and Ray-free. ``run_worker`` sets up, takes
the run directory's lease, negotiates where to resume, trains and finishes; ``TrainingLoop`` is
*How resume stays exact* (docs/concepts/exact-resume.md), rule by rule:

* optimizer steps fire at sync boundaries computed from the 1-indexed position within the epoch
  (``syncpoint.policies.decisions.boundaries``); the epoch end flushes a short cycle whose loss is averaged over the
  micro-batches it really accumulated (``TrainingLoop.micro_step``);
* save requests (interval trigger, preemption notice, final) stay pending until a boundary and
  are serviced there: never dropped, never written mid-cycle (``TrainingLoop.boundary``, ``save``);
* on start every rank agrees on one state chosen by the resume policy from metadata alone
  (``syncpoint.workers.state.resume_negotiation``); the data position is restored (by index arithmetic for a
  map-style dataset, from each rank's saved stream state for a stream) and every RNG after it,
  right before the first fetch (``TrainingLoop.epoch``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import TrainingDiverged
from syncpoint.policies.contracts.journal import Finished, PreemptionNotice
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions import grace_window
from syncpoint.policies.decisions.boundaries import cycle_length, is_boundary
from syncpoint.policies.decisions.elastic import layout
from syncpoint.policies.decisions.live_job import live_job
from syncpoint.policies.decisions.save_triggers import AutoInterval
from syncpoint.workers.data import corpus, data_plan
from syncpoint.workers.data.source import DataSource, data_source
from syncpoint.workers.data.stream import PreparedStream, check_map_spec, prepare
from syncpoint.workers.integrity.signing import load_key
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.observation.metric_sinks import RunMetrics
from syncpoint.workers.observation.progress import ProgressLine, ProgressLog
from syncpoint.workers.state import user_state
from syncpoint.workers.state.checkpoint_engine import install as install_streaming
from syncpoint.workers.state.export import export_final
from syncpoint.workers.state.memory_copy import memory_copy_for
from syncpoint.workers.state.pretrained import load_pretrained_init
from syncpoint.workers.state.resume_negotiation import ResumeStart, negotiate_resume
from syncpoint.workers.state.saving import SaveCoordinator
from syncpoint.workers.state.writer import SaveResult
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.failure_site import annotate
from syncpoint.workers.supervision.faults import Faults
from syncpoint.workers.supervision.heartbeat import Heartbeat
from syncpoint.workers.supervision.preemption import DRIVER, PreemptionNotices
from syncpoint.workers.task import Task, check_loss, is_stream, load_task
from syncpoint.workers.training import rng, task_rngs
from syncpoint.workers.training.attempt import Attempt
from syncpoint.workers.training.boundary_vote import BoundaryVote
from syncpoint.workers.training.callbacks import Callbacks, EndInfo, StartInfo, StepInfo
from syncpoint.workers.training.device import apply_collective_timeout, check_engine_device, prepare_process, to_device
from syncpoint.workers.training.engine import build_engine, model_buffers, model_fingerprint, parameter_dtypes, set_lr
from syncpoint.workers.training.evaluation import Evaluation, check_task
from syncpoint.workers.training.finite import NonfiniteSteps, scaler_calibrating
from syncpoint.workers.training.loop_state import LoopState, step_record, trainer_record
from syncpoint.workers.training.param_groups import settings_of
from syncpoint.workers.training.schedule import Schedule

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from syncpoint.workers.state.checkpoint_engine import StreamingCheckpointEngine
    from syncpoint.workers.training.position import TrainingPosition
from syncpoint.workers.training.attempt_start import (
    acquire_lease,
    announce_attempt,
    attempt_number,
    check_hash_seed,
    make_trigger,
    measuring,
)
from syncpoint.workers.training.worker_context import SetupLaps, WorkerContext, WorkerResult


def run_worker(spec: JobSpec, ctx: WorkerContext | None = None) -> WorkerResult:
    """Set up, take the lease, agree where to resume, train, finish."""
    ctx = ctx or WorkerContext()
    launched_at = ctx.launched_at if ctx.launched_at is not None else time.time()
    laps = SetupLaps(launched_at)
    if ctx.imported_at is not None:  # measured by a launcher that imports before calling in (Ray's)
        laps.mark("imports", ctx.imported_at)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    storage = RunStorage(spec.run_url)
    events = EventLog(storage) if rank == 0 else None
    notices = PreemptionNotices(ctx.preemption_notice)
    faults = Faults(spec.faults, storage, rank, send_sigterm=notices.send_sigterm)
    # Intra-op threads follow the spec, not the host: CPU reductions split by thread count, so a
    # resumed attempt on a bigger node would otherwise differ in the last bits (Ray does the same
    # with OMP_NUM_THREADS; this makes every launcher agree).
    torch.set_num_threads(max(1, int(spec.scaling.cpus_per_worker)))
    prepare_process(spec)  # this rank's GPU and deterministic kernels, before any CUDA work
    apply_collective_timeout(spec)  # DeepSpeed's groups too, not torch's 30 minutes (a silent peer)

    rng.use_task_generators({})  # an earlier run's in this process are not this task's
    rng.seed_everything(spec.train.seed)  # model init is identical on every rank and every attempt
    corpus.use_job_settings(spec)  # a sharded corpus the task builds caches where the spec says
    laps.mark("process: threads, device, seeds")
    task = load_task(spec.task.path, spec.task.config)
    laps.mark("task built (model, dataset)")
    own_generators, unreproducible = task_rngs.of_task(task)
    rng.use_task_generators(own_generators)  # saved and restored with the rank's RNG from now on
    check_task(spec, task)  # train.eval_every needs an eval set: refused before the lease and the resume
    stream = _prepare_stream(spec, task, rank, world)
    plan = data_plan.plan_for(spec, task.dataset)  # corpus.shuffle and the cache bound: refused here too
    data_layout = (
        stream.layout
        if stream is not None
        else layout(
            len(task.dataset),
            spec.train.micro_batch_size,
            spec.train.grad_accum,
            world,
            spec.scaling.min_workers,
            spec.scaling.max_workers,
        )
    )
    schedule = Schedule(spec.train.scheduler)  # a custom schedule's import path fails here, before any load
    # a pretrained directory as init_from loads into the module before DeepSpeed copies and partitions it
    pretrained = load_pretrained_init(spec.resume.init_from, task.model, storage, spec.resume.policy)
    laps.mark("data plan, schedule, pretrained init")
    engine = build_engine(spec, task.model, data_layout.grad_accum, task_optimizer=task.optimizer)
    laps.mark("DeepSpeed engine (ops loaded)")
    check_engine_device(spec, engine.device)
    streaming = install_streaming(engine)  # saves stream through it; a refused config fails now
    groups = settings_of(engine)  # the param-group layout is part of a state's identity
    if rank == 0 and groups.task_class is not None:  # validate prints train.lr/optimizer: say which one is in effect
        print(
            f"[syncpoint] optimizer: Task.optimizer's {groups.task_class} ({len(groups.base)} param group"
            f"{'s' if len(groups.base) != 1 else ''}); train.lr and train.optimizer are not used",
            flush=True,
        )
    live = live_job(
        spec,
        data_layout,
        model_fingerprint=model_fingerprint(task.model),
        num_samples=None if stream else len(task.dataset),
        stream=stream.record if stream else None,
        param_groups=groups.layout_record,
        optimizer_type=groups.task_class,
        model_buffers=model_buffers(task.model),
        parameter_dtypes=parameter_dtypes(task.model),
        task_generators=rng.task_generator_kinds(),
        corpus=plan.identity,
        sampler=plan.sampler,
        window_shards=plan.window_shards,
        user_state=user_state.names(task.stateful),
    )
    signing_key = load_key(spec.checkpoint.signing_key_env)  # every rank: a missing key fails here, clearly
    journal = events.journal() if events is not None else None  # read once: number and restart
    number = faults.attempt = attempt_number(journal)
    laps.mark("live job, signing key, journal")
    lease = acquire_lease(spec, storage, live, rank, ctx.submission_id)
    laps.mark("lease")
    attempt = Attempt(
        spec,
        storage,
        events,
        faults,
        rank,
        world,
        number,
        ctx.submission_id,
        live,
        data_layout,
        lease,
        signing_key,
        restart=bool(journal and ctx.submission_id and journal.is_restart_of(ctx.submission_id)),
        stateful=task.stateful,
        pretrained=pretrained,
        memory_copy=memory_copy_for(spec.checkpoint.memory_copy, storage),
    )
    for line in unreproducible:
        attempt.warn(line)
    check_hash_seed(attempt)
    start: ResumeStart | None = None
    try:
        start = negotiate_resume(attempt, engine)
        laps.mark("selection and state load")
        if rank == 0:
            data_plan.publish_index(storage, task.dataset, plan.identity)  # selections name a changed shard
        with RunMetrics.open(
            attempt,
            ctx.report_metrics,
            state=start.state,
            optimizer_step=start.position.optimizer_step,
            global_micro_step=start.position.global_micro_step,
        ) as metrics:
            source = data_source(attempt, task, stream, sampler=start.sampler, saved=start.stream_state)
            laps.mark("metrics, data source")
            try:
                launch = (launched_at, ctx.warm_start)
                announce_attempt(attempt, (ctx.node_id, ctx.worker_id), start, launch, laps.seconds)
                parts = LoopParts(ctx, notices, task, engine, schedule, metrics, source)
                return TrainingLoop(attempt, start, parts).run()
            finally:
                source.close()
    except BaseException as e:
        if lease:
            lease.stop()  # as a crash would: the heartbeat stops, the driver or the TTL frees the lease
        if isinstance(e, Exception):  # where, for the driver's last line and the failure policy
            annotate(e, rank, start.position.global_micro_step if start is not None else None)
        raise
    finally:
        notices.stop_listening()
        rng.use_task_generators({})
        _release(engine, streaming)


def _release(engine: DeepSpeedEngine, streaming: StreamingCheckpointEngine) -> None:
    """Free the engine's memory when the run ends (DeepSpeed's own teardown).

    Why: the engine can outlive a run in this process (a test, the Python API, a restart in the same
    process), and its gradient hooks keep it and its buffers alive: ZeRO-1/2's untouched 2 GB
    reduce bucket per engine added up to tens of GiB of address space, and the next ``fork`` failed
    with ENOMEM. A failure here must not hide the run's own outcome, so it is only reported."""
    streaming.arena.drop()
    try:
        engine.destroy()
    except Exception as e:  # noqa: BLE001 - teardown of a finished run: its result or error is what counts
        print(f"[syncpoint] warning: releasing the DeepSpeed engine failed: {type(e).__name__}: {e}", flush=True)


def _prepare_stream(spec: JobSpec, task: Task, rank: int, world: int) -> PreparedStream | None:
    """This rank's part of a stream dataset (checked, split, wrapped), or None for a map-style one."""
    if not is_stream(task.dataset):
        check_map_spec(spec)
        return None
    return prepare(spec, task.dataset, task.collate, rank, world)


@dataclass
class LoopParts:
    """What ``run_worker`` built for the loop, fixed for the attempt."""

    ctx: WorkerContext
    notices: PreemptionNotices
    task: Task
    engine: DeepSpeedEngine
    schedule: Schedule
    metrics: RunMetrics
    source: DataSource


class TrainingLoop:
    """From the agreed start to the end of the run (at once if the state already finished it).

    One method per phase: an epoch (data position, then the saved RNG, then the first fetch), a
    micro-step, a sync boundary (the vote, the step's record, evaluation, the save) and the finish.
    What changes between micro-steps is ``self.state`` (``LoopState``); the rest is fixed for the
    attempt."""

    def __init__(self, attempt: Attempt, start: ResumeStart, parts: LoopParts) -> None:
        train = attempt.spec.train
        self.attempt, self.start, self.parts, self.train = attempt, start, parts, train
        self.engine, self.source, self.world = parts.engine, parts.source, attempt.world_size
        self.samples_per_micro_step = train.micro_batch_size * self.world
        self.heartbeat = Heartbeat(parts.ctx.heartbeat_board, attempt.rank, attempt.number)
        parts.notices.listen_for_sigterm()
        self.trigger = make_trigger(attempt)
        # clocks differ between ranks: a wall-clock trigger is decided by the boundary vote
        self.wall_clock = getattr(self.trigger, "wall_clock", False)
        self.progress = ProgressLog(attempt.events, attempt.number)
        self.console = ProgressLine(
            attempt.number,
            train.epochs,
            attempt.run_length.total_steps,
            self.samples_per_micro_step,
            start.position.global_micro_step,
        )
        self.saves = self._save_coordinator()
        self.evaluation = Evaluation(
            attempt.spec,
            parts.task,
            rank=attempt.rank,
            world_size=self.world,
            attempt=attempt.number,
            events=attempt.events,
            carried=start.metrics,
            print_progress=parts.ctx.print_progress,
        )
        self.state = LoopState(
            at=start.position, nonfinite=NonfiniteSteps(train.max_nonfinite_steps), finished=start.finished
        )
        self.callbacks = Callbacks(parts.task.callbacks)
        self.boundary_times: deque[float] = deque(maxlen=6)  # the recent steps' length, for the grace window
        self.stopping = False  # every rank agreed the driver's notice: this boundary saves, then the job stops

    def _save_coordinator(self) -> SaveCoordinator:
        saves = SaveCoordinator(self.engine, self.attempt, self.progress, last_saved=self.start.state)
        committed: Callable[[SaveResult, list[str]], None] = self.parts.metrics.committed
        if isinstance(self.trigger, AutoInterval):  # save_every auto decides again with each measured save
            committed = measuring(committed, self.trigger, time.monotonic())
        saves.on_commit = self._tell_callbacks(committed)
        saves.stream_state = self.source.capture  # a stream's per-rank position goes into every state
        return saves

    def _tell_callbacks(
        self, on_commit: Callable[[SaveResult, list[str]], None]
    ) -> Callable[[SaveResult, list[str]], None]:
        def committed(result: SaveResult, reasons: list[str]) -> None:
            on_commit(result, reasons)
            self.callbacks.call("on_state_committed", result.name, list(reasons))

        return committed

    def run(self) -> WorkerResult:
        """Train from the resumed position to the end of the last epoch: micro-steps, boundaries
        (saves, notices, evaluation), then the finish (final save, the model's export)."""
        state, at = self.state, self.state.at
        self.callbacks.call(
            "on_start",
            StartInfo(
                attempt=self.attempt.number,
                resumed_from=self.start.state,
                restart=self.attempt.restart,
                optimizer_step=at.optimizer_step,
                global_micro_step=at.global_micro_step,
                rank=self.attempt.rank,
                world_size=self.world,
            ),
        )
        try:
            while not (state.finished or self.stopping) and self.attempt.run_length.has_epoch(state.at.epoch):
                self.epoch()
            return self.stop() if self.stopping and not state.finished else self.finish()
        except BaseException:
            self.saves.settle()  # its upload and deletes end with this attempt, a failed one's too
            raise

    def epoch(self) -> None:
        """One epoch from the current position. The data position is index arithmetic (a stream's:
        restored from its state when the source was built); the saved RNG goes back after it,
        before the first fetch."""
        state = self.state
        loader = self.source.epoch(state.at)
        self.start.restore_rng(self.train.seed, self.attempt.rank)
        state.new_cycle()
        for batch in loader:
            self.micro_step(batch)
            if state.finished or self.stopping:
                break
        if not (state.finished or self.stopping):
            state.at.next_epoch()

    def micro_step(self, batch: Any) -> None:
        """Forward, backward and the engine's step; at a sync boundary the optimizer steps and the
        boundary is serviced. Sync boundaries come from the 1-indexed position in the epoch."""
        state, engine, at = self.state, self.engine, self.state.at
        per_epoch = self.attempt.layout.micro_batches_per_epoch
        at.consume_micro_batch(self.samples_per_micro_step)
        if self.train.record_samples:
            state.cycle_sample_ids.append(self.source.sample_ids(at.position_in_epoch - 1))
        boundary = is_boundary(at.position_in_epoch, self.attempt.layout.grad_accum, per_epoch)
        cycle = cycle_length(at.position_in_epoch, self.attempt.layout.grad_accum, per_epoch)
        self._forward_backward(batch, boundary, cycle)
        if boundary:
            # LR schedule: the live spec decides the factor, the state only the position; each param
            # group's rate is its own base rate times the factor.
            factor = self.parts.schedule.factor(at.schedule_position, self.attempt.run_length.schedule_horizon)
            state.lrs = set_lr(engine, factor)
            self.saves.before_optimizer_step()  # an async save's staged copies are made before it changes them
        engine.step()
        if boundary:
            at.optimizer_stepped(self.train.scheduler.unit)
        self.heartbeat.at_micro_step(at.global_micro_step, boundary)  # computed: before any save or collective
        # Save requests are never dropped: raised at any micro-step, serviced at a boundary.
        if not self.wall_clock and self.trigger.wants_save(at.tick(boundary, self.saves.seconds_since_last_save())):
            state.pending.request("interval")
        if boundary:
            self.boundary(cycle)
        self.attempt.faults.at_micro_step(at.global_micro_step)

    def _forward_backward(self, batch: Any, boundary: bool, cycle: int) -> None:
        """Each micro-batch's loss is divided by the length of the cycle it really belongs to
        (short at the epoch's end)."""
        engine = self.engine
        engine.set_gradient_accumulation_boundary(boundary)
        loss = self.parts.task.loss(engine, to_device(batch, engine.device))
        check_loss(loss, self.attempt.spec.task.path)  # what backward needs, refused at once (a bug that would repeat)
        engine.backward(loss / cycle, scale_wrt_gas=False)
        self.state.add_loss(loss)  # read on the host once per cycle, in the boundary vote

    def boundary(self, cycle: int) -> None:
        """A sync boundary: every rank agrees on the facts (one vote), records the step, stops a
        diverged run, evaluates, then services the pending save; the next cycle begins."""
        state, at = self.state, self.state.at
        agreed = self._vote()
        step_loss = float(agreed.loss_sum) / (cycle * self.world)
        if agreed.wall_clock_saves:
            state.pending.request("interval")
        sample_ids = state.cycle_sample_ids if self.train.record_samples else None
        record = step_record(at, step_loss, state.lrs, sample_ids, self.world)
        self.progress.add(record)
        self._stop_if_diverged(step_loss, agreed)
        epoch_end = at.position_in_epoch == self.attempt.layout.micro_batches_per_epoch
        if epoch_end:
            at.epoch_completed(self.train.scheduler.unit)
        last = self.attempt.run_length.is_last_boundary(at, epoch_end)
        if last:
            state.pending.request("final")  # the run always commits a state at its last micro-step
        logged = at.optimizer_step % self.train.log_every == 0 or last  # the same steps on every rank
        self._print_progress(step_loss, logged)
        evaluated = self.evaluate(epoch_end=epoch_end, last=last)
        if self.callbacks:
            self._call_back(record, step_loss, logged=logged, evaluated=evaluated)
        # TensorBoard (rank 0) every logged step; Ray Train's report (every rank) as often as Ray collects
        self.parts.metrics.at_boundary(
            record,
            logged=logged,
            evaluated=self.evaluation.latest if evaluated else None,
            report=bool(agreed.reports_due) or last,
        )
        self.save(agreed, step_loss, last=last or self.stopping)  # a stop's save commits before it stops
        state.new_cycle()
        state.finished = last

    def _call_back(self, record: JSONObject, step_loss: float, *, logged: bool, evaluated: bool) -> None:
        """The boundary's hooks, after its evaluation and before its save: every step, the logged
        ones, the evaluation's metrics."""
        at = self.state.at
        info = StepInfo(
            at.optimizer_step, at.global_micro_step, at.epoch, step_loss, tuple(self.state.lrs), self.attempt.rank
        )
        self.callbacks.call("on_step", info, self.engine.module)
        if logged:
            self.callbacks.call("on_log", dict(record))
        if evaluated:
            self.callbacks.call("on_evaluate", dict(self.evaluation.latest))

    def _grace_save_due(self, notice: grace_window.Notice) -> bool:
        """This noticed rank's vote for a save in the grace window: always without a known deadline,
        else only from the last boundary whose save still commits before it
        (``syncpoint.policies.decisions.grace_window``)."""
        deadline = self.parts.notices.deadline(notice, self.attempt.spec.checkpoint.sigterm_grace_s)
        gaps = [b - a for a, b in zip(self.boundary_times, list(self.boundary_times)[1:], strict=False)]
        return grace_window.save_due(time.time(), deadline, max(gaps, default=None), self.saves.last_commit_s)

    def _vote(self) -> BoundaryVote:
        """This rank's facts at the boundary, agreed by every rank. A preemption notice: this
        boundary commits a state, and so does every later one inside the grace window while the
        node's deadline is near or unknown, so whatever is computed before the node goes survives."""
        notices, at = self.parts.notices, self.state.at
        self.boundary_times.append(time.monotonic())
        notice = notices.poll()
        clock_says_save = self.wall_clock and self.trigger.wants_save(
            at.tick(True, self.saves.seconds_since_last_save())
        )
        agreed = BoundaryVote(
            self.state.cycle_loss_sum,
            preemption_notices=int(notice is not None),
            grace_saves=int(notice is not None and self._grace_save_due(notice)),
            wall_clock_saves=int(clock_says_save),
            stops=int(notices.stop_noticed),
            uploading=int(self.saves.uploading()),
            lease_lost=int(self.saves.lease_lost()),
            reports_due=int(self.parts.metrics.report_due()),
            skipped_updates=int(not self.engine.was_step_applied()),
        ).agree(self.engine.device)
        first_notice = notices.agreed(agreed.preemption_notices)
        self.stopping = bool(agreed.stops)
        if first_notice or self.stopping or (notices.in_grace_window and agreed.grace_saves):
            self.state.pending.request("preemption")
        if first_notice and self.attempt.events:
            self.attempt.events.emit(
                PreemptionNotice(
                    attempt=self.attempt.number,
                    global_micro_step=at.global_micro_step,
                    optimizer_step=at.optimizer_step,
                    **(notice or {"source": DRIVER if self.stopping else "another rank"}),
                )
            )
        return agreed

    def _stop_if_diverged(self, step_loss: float, agreed: BoundaryVote) -> None:
        """Every rank, at the same boundary (agreed values)."""
        at = self.state.at
        diverged = self.state.nonfinite.observe(
            loss=step_loss,
            skipped=bool(agreed.skipped_updates),
            optimizer_step=at.optimizer_step,
            micro_step=at.global_micro_step,
            calibrating=scaler_calibrating(self.engine),
        )
        if diverged:
            self.progress.flush()
            raise TrainingDiverged(diverged)

    def _print_progress(self, step_loss: float, logged: bool) -> None:
        at = self.state.at
        if self.attempt.rank == 0 and self.parts.ctx.print_progress and logged:
            self.console.print(
                epoch=at.epoch,
                optimizer_step=at.optimizer_step,
                global_micro_step=at.global_micro_step,
                loss=step_loss,
                lr=self.state.lrs[0],
            )

    def evaluate(self, *, epoch_end: bool, last: bool) -> bool:
        """Evaluation runs before the save at the same boundary, so the state records it."""
        due = self.evaluation.due(self.state.at, epoch_end=epoch_end, last=last)
        if due:
            self.evaluation.run(self.engine, self.state.at)
        return due

    def save(self, agreed: BoundaryVote, step_loss: float, *, last: bool) -> None:
        """Hand the boundary to the save coordinator: a pending request is serviced here, or stays
        pending for the next boundary (never dropped, never written mid-cycle)."""
        at = self.state.at
        record = partial(
            trainer_record,
            self.attempt,
            at,
            self.engine,
            loss=step_loss,
            evaluated=self.evaluation.latest,
            sampler=self.start.sampler,
        )
        self.saves.at_boundary(
            self.state.pending, record, agreed, last=last, micro_step=at.global_micro_step, loss=step_loss
        )

    def stop(self) -> WorkerResult:
        """The driver was signalled (``syncpoint run`` got SIGINT/SIGTERM/SIGHUP): this boundary's state
        is committed and the job stops without finishing, so a rerun resumes from that state. No export,
        no ``finished`` event, no ``on_end``: the run is not over; the lease is released for the rerun."""
        if self.attempt.events:
            self.progress.flush()
        return self._leave(self.saves.last_saved, self.state.at)

    def finish(self) -> WorkerResult:
        """Export (rank 0, when asked), the final events, a barrier, the lease released."""
        attempt, at, last_saved = self.attempt, self.start.position, self.saves.last_saved
        if attempt.rank == 0 and attempt.spec.checkpoint.export_final:
            export_final(
                self.engine,
                attempt.storage,
                {"state": last_saved, "optimizer_step": at.optimizer_step, "task": attempt.spec.task.path},
                attempt.spec,
            )
        if attempt.events:
            self.progress.flush()
            attempt.events.emit(
                Finished(
                    attempt=attempt.number,
                    state=last_saved,
                    global_micro_step=at.global_micro_step,
                    optimizer_step=at.optimizer_step,
                )
            )
        self.callbacks.call("on_end", EndInfo(last_saved or "", at.optimizer_step, at.global_micro_step, attempt.rank))
        return self._leave(last_saved, at)

    def _leave(self, last_saved: str | None, at: TrainingPosition) -> WorkerResult:
        """Every rank here, then this node's memory copy removed and the lease released: the run ends
        or stops at this boundary, so neither may outlive it (a rerun restores from storage)."""
        attempt = self.attempt
        self.saves.retention.wait()  # its deletes end before the lease is released
        dist.barrier()
        if attempt.memory_copy is not None:
            attempt.memory_copy.remove()
        if attempt.lease:
            attempt.lease.release()
        return WorkerResult(
            final_state=last_saved or "",
            global_micro_step=at.global_micro_step,
            optimizer_step=at.optimizer_step,
            resumed_from=self.start.state,
            history=self.progress.history,
        )
