"""The boundary-aware training loop over a DeepSpeed engine.

It needs only a torch process group (one process, several spawned by a test, or Ray Train's
workers), which keeps the big equivalence grids fast and Ray-free. The rules it enforces:

* optimizer steps fire at sync boundaries computed from the 1-indexed position within the epoch
  (``policies.boundaries``); the epoch end flushes a short cycle whose loss is averaged over the
  micro-batches it really accumulated;
* save requests (interval trigger, preemption notice, final) stay pending until a boundary and
  are serviced there: never dropped, never written mid-cycle;
* on start every rank agrees on one state chosen by the resume policy from metadata alone; the
  data position is restored by index arithmetic and every RNG after the skip, right before the
  first fetch.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from policies.boundaries import cycle_length, is_boundary, optimizer_steps_per_epoch
from policies.candidates import TRAINER_SCHEMA_VERSION, Candidate, Expectation, Verdict, identity_record
from policies.elastic import Layout, layout
from policies.errors import JobConfigError, LeaseRefused, NoResumableState, ResumeRefused
from policies.import_path import load_object
from policies.redact import redact_url
from policies.resume import ContinueSubmission, NewestResumable, ResumePolicy, enforce_safe, make_policy
from policies.retention import plan_retention
from policies.save_triggers import PendingSave, Tick, trigger_from_interval
from policies.spec import JobSpec
from workers import rng
from workers.checkpoint_engine import install as install_streaming
from workers.data import derive_seed, epoch_loader
from workers.device import check_engine_device, prepare_process, to_device
from workers.discovery import discover, discover_lazy, read_candidate
from workers.engine import apply_hyperparameters, build_engine, model_fingerprint, set_lr
from workers.events import EventLog
from workers.export import export_final
from workers.faults import Faults
from workers.lease import RunLease
from workers.saving import SaveCoordinator
from workers.schedule import lr_at, phases, resume_position, schedule_record
from workers.signing import load_key
from workers.state_reader import StateRefused, fetch_state, load_into_engine
from workers.state_writer import delete_state
from workers.storage import RunStorage
from workers.task import load_task

PROGRESS_FLUSH_S = 2.0  # how stale the event log's view of progress may get (lost-work accounting)


@dataclass
class WorkerContext:
    """What the launcher (Ray Train, or a test) tells the loop about its surroundings."""

    # Returns details of an imminent preemption (e.g. from Ray's get_preemption_info), or None.
    # Called at every sync boundary on every rank (Ray's call is itself a collective).
    preemption_notice: Callable[[], dict[str, Any] | None] | None = None
    node_id: str = ""
    print_progress: bool = True
    # One id per `syncpoint run` invocation: a Ray restart inside the same submission shares it, so
    # `resume.policy: fresh` starts over only once and restarts continue their own progress.
    submission_id: str = ""


@dataclass
class WorkerResult:
    final_state: str
    global_micro_step: int
    optimizer_step: int
    resumed_from: str | None
    history: list[dict[str, Any]] = field(default_factory=list)


def job_identity(spec: JobSpec) -> str:
    return hashlib.sha256(f"{spec.name}|{spec.task.path}".encode()).hexdigest()[:16]


class _SigtermNotice:
    """A SIGTERM in the worker process is a preemption notice too (second source besides Ray).

    The previous handler comes back when the run ends, so a process that hosts the loop (a test, a
    notebook) can still be terminated afterwards."""

    def __init__(self) -> None:
        self.flag = False
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            try:
                self.previous = signal.signal(signal.SIGTERM, self._handle)
            except (ValueError, OSError):
                pass

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None

    def _handle(self, signum, frame) -> None:
        self.flag = True


def run_worker(spec: JobSpec, ctx: WorkerContext | None = None) -> WorkerResult:
    ctx = ctx or WorkerContext()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = dist.get_rank(), dist.get_world_size()
    storage = RunStorage(spec.run_url)
    events = EventLog(storage) if rank == 0 else None
    faults = Faults(spec.faults, storage, rank)
    t = spec.train
    # Intra-op threads follow the spec, not the host: CPU reductions split by thread count, so a
    # resumed attempt on a bigger node would otherwise differ in the last bits (Ray does the same
    # with OMP_NUM_THREADS; this makes every launcher agree).
    torch.set_num_threads(max(1, int(spec.scaling.cpus_per_worker)))
    prepare_process(spec)  # this rank's GPU and deterministic kernels, before any CUDA work

    rng.seed_everything(t.seed)  # model init is identical on every rank and every attempt
    task = load_task(spec.task.path, spec.task.config)
    lay = layout(len(task.dataset), t.micro_batch_size, t.grad_accum, world,  # type: ignore[arg-type]
                 spec.scaling.min_workers, spec.scaling.max_workers)
    mbpe, accum = lay.micro_batches_per_epoch, lay.grad_accum
    engine = build_engine(spec, task.model, accum)
    check_engine_device(spec, engine.device)
    install_streaming(engine)  # saves stream through syncpoint's checkpoint engine; refused config fails now
    expectation = Expectation(
        job_identity=job_identity(spec), world_size=world, micro_batch_size=t.micro_batch_size, grad_accum=accum,
        micro_batches_per_epoch=mbpe, zero_stage=spec.deepspeed.zero_stage,
        model_fingerprint=model_fingerprint(task.model), seed=t.seed, elastic=spec.scaling.elastic,
        global_batch=lay.global_batch, samples_per_epoch=lay.samples_per_epoch, num_samples=len(task.dataset),  # type: ignore[arg-type]
        precision=spec.deepspeed.precision, optimizer_type=t.optimizer.type, scheduler_type=t.scheduler.type,
        scheduler_phases=tuple(phases(t.scheduler)), reset_schedule=spec.resume.reset_schedule,
        reset_optimizer=spec.resume.reset_optimizer)
    signing_key = load_key(spec.checkpoint.signing_key_env)  # every rank: a missing key fails here, clearly
    attempt = faults.attempt = _attempt_number(events)
    lease = _acquire_lease(spec, storage, expectation, rank, ctx.submission_id)
    try:
        return _train(spec, ctx, storage, events, faults, task, engine, expectation, attempt, lay, lease, signing_key)
    except BaseException:
        if lease:
            lease.stop()  # as a crash would: the heartbeat stops, the driver or the TTL frees the lease
        raise
    finally:
        if faults.sigterm_flag is not None:
            faults.sigterm_flag.restore()


def _train(spec: JobSpec, ctx: WorkerContext, storage: RunStorage, events: EventLog | None, faults: Faults,
           task, engine, expectation: Expectation, attempt: int, lay: Layout, lease: RunLease | None,
           signing_key: bytes | None = None) -> WorkerResult:
    rank, world = dist.get_rank(), dist.get_world_size()
    t, accum, mbpe = spec.train, lay.grad_accum, lay.micro_batches_per_epoch
    device = engine.device  # DeepSpeed placed the model there (CPU, or this rank's GPU)

    resumed = _negotiate_resume(spec, storage, expectation, engine, rank, events, attempt, ctx.submission_id,
                                signing_key)
    trainer, rng_bytes = resumed.trainer, resumed.rng_bytes
    steps_per_epoch = optimizer_steps_per_epoch(accum, mbpe)
    total_steps = min(t.max_steps or 2**62, (t.epochs or 2**40) * steps_per_epoch)
    sched = t.scheduler
    horizon = sched.total or (total_steps if sched.unit == "optimizer_steps" else (t.epochs or 1))

    rederive_rng = False
    if trainer:
        data = trainer.get("data") or {}
        saved_world = trainer["world_size"]
        samples_in_epoch = data.get("samples_in_epoch", trainer["position_in_epoch"] * t.micro_batch_size * saved_world)
        epoch, pos = trainer["epoch"], lay.position_for(samples_in_epoch)
        gms, opt_step = trainer["global_micro_step"], trainer["optimizer_step"]
        global_samples = data.get("global_samples", gms * t.micro_batch_size * saved_world)
        if saved_world != world:
            # Per-rank RNG streams cannot be carried to another world size: derive them instead.
            rederive_rng, rng_bytes = True, None
            _warn(rank, f"resuming a state saved on {saved_world} worker(s) on {world}: accumulation {accum}, same "
                        "samples per optimizer step; per-rank RNG re-derived from (seed, optimizer step, rank), so "
                        "model-side randomness (dropout) differs from the uninterrupted run")
        if pos == mbpe:
            epoch, pos = epoch + 1, 0
        sched_pos = resume_position(trainer.get("scheduler"), sched, optimizer_step=opt_step, epoch_done=epoch,
                                    reset=spec.resume.reset_schedule, warn=lambda m: _warn(rank, m))
    else:
        epoch = pos = gms = opt_step = sched_pos = global_samples = 0
    finished = _already_finished(spec, rank, resumed.name, opt_step, epoch, total_steps)
    nodes: list[str | None] = [None] * world
    dist.all_gather_object(nodes, ctx.node_id)
    if events:
        events.emit("attempt_started", attempt=attempt, world_size=world, nodes=nodes, submission=ctx.submission_id,
                    resumed_from=resumed.name, global_micro_step=gms, optimizer_step=opt_step)
    faults.sigterm_flag = sigterm_flag = _SigtermNotice()

    trigger = _make_trigger(spec)
    wall_clock = getattr(trigger, "wall_clock", False)
    pending, sigterm = PendingSave(), sigterm_flag
    noticed = False
    progress = _ProgressLog(events, attempt)
    saves = SaveCoordinator(engine, storage, faults, events, rank=rank, attempt=attempt,
                            use_async=spec.checkpoint.async_save, flush_progress=progress.flush,
                            full_optimizer_state=spec.scaling.elastic and spec.deepspeed.zero_stage in (1, 2, 3),
                            retain=lambda: _retain(spec, storage, expectation, faults, lease, keep=saves.last_saved,
                                                   signing_key=signing_key),
                            last_saved=resumed.name,
                            checksum=spec.checkpoint.checksum, lease=lease, signing_key=signing_key)
    last_log_time, last_log_samples = time.monotonic(), gms

    while not finished and (t.epochs is None or epoch < t.epochs):
        loader = epoch_loader(task.dataset, micro_batch_size=t.micro_batch_size, world_size=world, rank=rank,
                              seed=t.seed, epoch=epoch, start=pos, collate=task.collate,
                              num_workers=t.dataloader_workers, samples_per_epoch=lay.samples_per_epoch)
        if rng_bytes is not None:  # after the skip and start-up, immediately before the first fetch
            rng.restore(rng_bytes)
            rng_bytes = None
        elif rederive_rng:
            rng.seed_everything(derive_seed(t.seed, opt_step, rank, 0xE1A5))
            rederive_rng = False
        cycle_samples: list[list[int]] = []
        cycle_loss = 0.0
        for batch in loader:
            pos, gms = pos + 1, gms + 1
            global_samples += t.micro_batch_size * world
            if t.record_samples:
                cycle_samples.append(loader.batch_sampler.indices(pos - 1))  # type: ignore[union-attr]
            boundary = is_boundary(pos, accum, mbpe)
            engine.set_gradient_accumulation_boundary(boundary)
            loss = task.loss(engine, to_device(batch, device))
            engine.backward(loss / cycle_length(pos, accum, mbpe), scale_wrt_gas=False)
            cycle_loss += float(loss.detach())
            lr = None
            if boundary:
                lr = lr_at(sched_pos, t.lr, sched, horizon)
                set_lr(engine, lr)
            engine.step()
            if boundary:
                opt_step += 1
                if sched.unit == "optimizer_steps":
                    sched_pos += 1
            if not wall_clock and trigger.wants_save(Tick(gms, opt_step, boundary, time.monotonic() - saves.last_save_time)):
                pending.request("interval")
            if boundary:
                notice = ctx.preemption_notice() if ctx.preemption_notice else None
                if notice is None and sigterm.flag:
                    notice = {"source": "sigterm"}
                flags = torch.tensor([
                    cycle_loss,
                    float(notice is not None),
                    float(wall_clock and trigger.wants_save(Tick(gms, opt_step, True, time.monotonic() - saves.last_save_time))),
                    saves.still_uploading(),
                ], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
                dist.all_reduce(flags)  # one collective: every rank takes the same decision
                step_loss = flags[0].item() / (cycle_length(pos, accum, mbpe) * world)
                if noticed:
                    # Inside a notice's grace window every boundary commits: whatever is computed before
                    # the node goes away survives (at most one accumulation cycle is recomputed).
                    pending.request("preemption")
                elif flags[1] > 0:
                    noticed = True
                    pending.request("preemption")
                    if events:
                        events.emit("preemption_notice", attempt=attempt, global_micro_step=gms, optimizer_step=opt_step,
                                    **(notice or {"source": "another rank"}))
                if flags[2] > 0:
                    pending.request("interval")
                record = {"optimizer_step": opt_step, "global_micro_step": gms, "epoch": epoch, "loss": step_loss,
                          "lr": lr, "time": time.time()}
                if t.record_samples:
                    record["samples"] = _gather_samples(cycle_samples, world)
                    cycle_samples = []
                progress.add(record)
                epoch_end = pos == mbpe
                if epoch_end and sched.unit == "epochs":
                    sched_pos += 1
                last = opt_step >= total_steps or (epoch_end and t.epochs is not None and epoch + 1 >= t.epochs)
                if last:
                    pending.request("final")
                if rank == 0 and ctx.print_progress and (opt_step % t.log_every == 0 or last):
                    now = time.monotonic()
                    sps = (gms - last_log_samples) * t.micro_batch_size * world / max(now - last_log_time, 1e-9)
                    last_log_time, last_log_samples = now, gms
                    print(f"[syncpoint] attempt {attempt} epoch {epoch + 1}{'/' + str(t.epochs) if t.epochs else ''} "
                          f"step {opt_step}/{total_steps} micro-step {gms} loss {step_loss:.4f} lr {lr:.3g} "
                          f"{sps:,.0f} samples/s", flush=True)
                saves.at_boundary(
                    pending, lambda reasons: _trainer_record(
                        spec, expectation, epoch=epoch, pos=pos, gms=gms, opt_step=opt_step, sched_pos=sched_pos,
                        loss=step_loss, reasons=reasons, attempt=attempt, num_samples=len(task.dataset),  # type: ignore[arg-type]
                        global_samples=global_samples, submission=ctx.submission_id),
                    ranks_uploading=flags[3].item(), last=last, micro_step=gms)
                cycle_loss = 0.0
                if last:
                    finished = True
            faults.at_micro_step(gms)
            if finished:
                break
        if not finished:
            epoch, pos = epoch + 1, 0

    last_saved = saves.last_saved
    if rank == 0 and spec.checkpoint.export_final:
        export_final(engine, storage, {"state": last_saved, "optimizer_step": opt_step, "task": spec.task.path})
    if events:
        progress.flush()
        events.emit("finished", attempt=attempt, state=last_saved, global_micro_step=gms, optimizer_step=opt_step)
    dist.barrier()
    if lease:
        lease.release()
    return WorkerResult(final_state=last_saved or "", global_micro_step=gms, optimizer_step=opt_step,
                        resumed_from=resumed.name, history=progress.history)


# ------------------------------------------------------------------ helpers


class _ProgressLog:
    """Per optimizer step records, flushed to the event log at every commit and every few seconds."""

    def __init__(self, events: EventLog | None, attempt: int) -> None:
        self.events, self.attempt = events, attempt
        self.history: list[dict[str, Any]] = []
        self.unflushed: list[dict[str, Any]] = []
        self.last_flush = time.monotonic()

    def add(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self.unflushed.append(record)
        if time.monotonic() - self.last_flush > PROGRESS_FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.events and self.unflushed:
            self.events.emit("progress", attempt=self.attempt, records=self.unflushed)
        self.unflushed, self.last_flush = [], time.monotonic()


def _make_trigger(spec: JobSpec):
    if not spec.checkpoint.save_trigger:
        return trigger_from_interval(spec.checkpoint.save_every.value, spec.checkpoint.save_every.unit)
    try:
        return load_object(spec.checkpoint.save_trigger)()
    except (ValueError, TypeError) as e:
        raise JobConfigError(f"checkpoint.save_trigger: {e}. It must name a class with wants_save(tick) -> bool, "
                             "constructible without arguments, importable on every worker") from None


def _warn(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[syncpoint] WARNING: {message}", file=sys.stderr, flush=True)


def _acquire_lease(spec: JobSpec, storage: RunStorage, exp: Expectation, rank: int, submission: str) -> RunLease | None:
    """Rank 0 takes the run directory's lease; every rank learns the outcome (one broadcast)."""
    lease, box = None, [None]
    if rank == 0:
        lease = RunLease(storage, job_identity=exp.job_identity, job_name=spec.name,
                         submission=submission or uuid.uuid4().hex, ttl_s=spec.resume.lease_ttl_s)
        try:
            lease.acquire()
        except LeaseRefused as e:
            box = [str(e)]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ResumeRefused(box[0])
    return lease


def _attempt_number(events: EventLog | None) -> int:
    n = 1
    if events is not None:
        n = 1 + sum(1 for name in events.storage.list_files("events") if "-attempt_started-" in name)
    box = [n]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _gather_samples(cycle: list[list[int]], world: int) -> list[int]:
    """Sample ids of one optimizer step, in global order (micro-batch major, rank minor)."""
    parts: list[list[list[int]] | None] = [None] * world
    dist.all_gather_object(parts, cycle)
    return [i for m in range(len(cycle)) for r in range(world) for i in parts[r][m]]  # type: ignore[index]


def _trainer_record(spec: JobSpec, exp: Expectation, *, epoch: int, pos: int, gms: int, opt_step: int,
                    sched_pos: int, loss: float, reasons: list[str], attempt: int, num_samples: int,
                    global_samples: int, submission: str) -> dict[str, Any]:
    return {
        "schema_version": TRAINER_SCHEMA_VERSION,
        "job_name": spec.name,
        **identity_record(exp),  # what selection compares (read back by expectation_from_trainer)
        "epoch": epoch,
        "position_in_epoch": pos,
        "global_micro_step": gms,
        "optimizer_step": opt_step,
        "scheduler": schedule_record(spec.train.scheduler, sched_pos),
        "data": {"sampler": exp.sampler, "num_samples": num_samples, "global_samples": global_samples,
                 "samples_in_epoch": pos * exp.micro_batch_size * exp.world_size,
                 "samples_per_epoch": exp.samples_per_epoch, "global_batch": exp.global_batch},
        # the optimizer state loads at another world size (ZeRO 0 holds it whole; 1/2 in elastic form)
        "elastic_optimizer": exp.zero_stage == 0 or exp.elastic,  # elastic ZeRO-1/2 add optim/full.safetensors
        "metrics": {"loss": loss},
        "save_reasons": reasons,
        "attempt": attempt,
        "submission": submission,  # a restart of this submission continues from its own states
        "created_at": time.time(),
    }


@dataclass
class _Resumed:
    name: str | None
    trainer: dict[str, Any] | None
    rng_bytes: bytes | None


def _negotiate_resume(spec: JobSpec, storage: RunStorage, exp: Expectation, engine, rank: int,
                      events: EventLog | None, attempt: int, submission_id: str,
                      signing_key: bytes | None = None) -> _Resumed:
    """Rank 0 decides from metadata; every rank fetches, verifies and loads; all agree or try the next.

    Any refusal after selection (a checksum, an unsafe file, a read error) marks that candidate
    corrupt and asks the policy again, so a damaged newest state costs one fallback, not the run.
    """
    restart = rank == 0 and _is_restart(events, submission_id)
    policy = _resume_policy(spec, submission_id if restart else "")
    cands = discover_lazy(storage, exp, signing_key) if rank == 0 else []
    spec_dict = spec.model_dump(mode="json")
    while True:
        msg: dict[str, Any] = {}
        if rank == 0:
            try:
                decision = enforce_safe(policy.choose(cands, spec_dict), cands)
                chosen = next((c for c in cands if c.name == decision.state), None)
                if decision.state is None and cands and spec.resume.policy == "fresh" and not restart:
                    _clear_for_fresh(spec, storage)
                msg = {"state": decision.state, "reason": decision.reason,
                       "manifest": chosen.manifest if chosen else None, "trainer": chosen.trainer if chosen else None}
            except NoResumableState as e:
                msg = {"error": str(e)}
            if events:
                looked_at = cands.inspected() if hasattr(cands, "inspected") else list(cands)
                events.emit("resume_decision", attempt=attempt, chosen=msg.get("state"), reason=msg.get("reason") or msg.get("error"),
                            total_candidates=len(cands),
                            candidates=[{"state": c.name, "verdict": c.verdict.value if c.verdict else None,
                                         "reason": c.reason} for c in looked_at])
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        msg = box[0]
        if "error" in msg:
            raise ResumeRefused(msg["error"])
        if msg["state"] is None:
            if rank == 0:
                print(f"[syncpoint] {msg['reason']}", flush=True)
            _maybe_init_from(spec, engine, rank)
            return _Resumed(None, None, None)
        cand = Candidate(name=msg["state"], manifest=msg["manifest"], trainer=msg["trainer"])
        resumed, bad = _fetch_and_load(spec, storage, cand, engine, rank)
        if bad is None:
            assert resumed is not None
            if rank == 0:
                print(f"[syncpoint] resuming from state {cand.name}: {msg['reason']}", flush=True)
                if spec.resume.init_from:
                    print("[syncpoint] resume.init_from ignored: this run's own resumable state wins", flush=True)
            return resumed
        if rank == 0:
            for c in cands:
                if c.name == cand.name:
                    c.verdict, c.reason = Verdict.CORRUPT, f"verification failed: {bad}"


def _is_restart(events: EventLog | None, submission_id: str) -> bool:
    """Whether an earlier attempt of this same submission already started (a Ray restart)."""
    return bool(events and submission_id and any(
        e["kind"] == "attempt_started" and e.get("submission") == submission_id for e in events.read_all()))


def _resume_policy(spec: JobSpec, restart_of: str) -> ResumePolicy:
    """The spec's policy chooses where a submission starts; a restart continues its own states.

    ``fresh`` already emptied the directory on the submission's first attempt, so on a restart
    whatever is there was written by this submission (torn debris included)."""
    name = spec.resume.policy
    try:
        start = NewestResumable() if (restart_of and name == "fresh") else make_policy(name, spec.resume.policy_args)
    except (ValueError, TypeError) as e:
        raise JobConfigError(f"resume.policy / resume.policy_args: {name}: {e}. Give the keyword arguments "
                             "the policy's constructor takes (pinned: {state: N}; best-metric: {metric, mode})") from None
    return ContinueSubmission(restart_of, start) if restart_of else start


def _fetch_and_load(spec: JobSpec, storage: RunStorage, cand: Candidate, engine,
                    rank: int) -> tuple[_Resumed | None, str | None]:
    """Every rank fetches and verifies, then loads; (resumed, None) or (None, the first rank's refusal).

    Both steps end in a collective so every rank takes the same branch. A refusal during the load
    (an unsafe file) leaves the engine partly loaded: the next candidate's load replaces all of it,
    and when none is left the run fails (it never trains on a half-loaded engine)."""
    fetched, error = None, None
    try:
        fetched = fetch_state(storage, cand, rank)
    except Exception as e:
        error = _refusal(e)
    bad = _first_error(error)
    if bad is None:
        assert fetched is not None
        try:
            load_into_engine(engine, fetched, module_only=spec.resume.reset_optimizer,
                             other_world_size=cand.trainer["world_size"] != dist.get_world_size())  # type: ignore[index]
        except Exception as e:
            error = _refusal(e)
        bad = _first_error(error)
    if fetched:
        fetched.cleanup()
    if bad is not None:
        return None, bad
    _apply_live_hyperparameters(spec, engine, rank)
    return _Resumed(cand.name, cand.trainer, fetched.rng_bytes if fetched else None), None


def _refusal(e: BaseException) -> str:
    return str(e) if isinstance(e, StateRefused) else f"{type(e).__name__}: {e}"


def _first_error(error: str | None) -> str | None:
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _apply_live_hyperparameters(spec: JobSpec, engine, rank: int) -> None:
    """Config wins: the state supplied moments and positions, the live spec supplies every
    hyper-parameter (the loaded param groups carried the old ones); each change is said once."""
    changes = apply_hyperparameters(engine, spec)
    if spec.resume.reset_optimizer:
        _warn(rank, "resume.reset_optimizer: weights and position come from the state; the optimizer state "
                    "(moments) starts fresh")
    for line in changes:
        _warn(rank, line)


def _already_finished(spec: JobSpec, rank: int, state: str | None, opt_step: int, epoch: int,
                      total_steps: int) -> bool:
    """A state at or past the run's end finishes at once (export and finish only), whatever unit
    ended it: re-submitting a finished run, or restarting after its final commit, trains nothing."""
    t = spec.train
    done = opt_step >= total_steps or (t.epochs is not None and epoch >= t.epochs)
    if done and state is not None and rank == 0:
        if t.max_steps is not None and opt_step > t.max_steps:
            _warn(rank, f"state {state} is at optimizer step {opt_step}, past train.max_steps {t.max_steps}: the run "
                        f"finishes at once and its final model is that state's weights (step {opt_step})")
        print(f"[syncpoint] state {state} already reached the end of the run (optimizer step {opt_step}); "
              "nothing left to train", flush=True)
    return done


def _clear_for_fresh(spec: JobSpec, storage: RunStorage) -> None:
    mode = spec.resume.on_existing
    if mode == "refuse":
        raise NoResumableState([], (
            f"resume.policy fresh, but {redact_url(storage.url)}/states already holds states; set resume.on_existing: "
            "archive (move them to archive/) or overwrite (delete them), or use another run name."))
    if mode == "archive":
        storage.rename_tree(("states",), ("archive", f"states-{int(time.time())}"))
    else:
        storage.delete_tree("states")


def _maybe_init_from(spec: JobSpec, engine, rank: int) -> None:
    """Fine-tune: take weights (optionally optimizer state) from another run; never its position."""
    url = spec.resume.init_from
    if not url:
        return
    base, sep, name = url.rstrip("/").rpartition("/states/")
    src = RunStorage(base if sep else url)
    key = load_key(spec.resume.init_from_signing_key_env, "resume.init_from_signing_key_env") or \
        load_key(spec.checkpoint.signing_key_env)
    if not sep:
        cands = discover(src, signing_key=key)
        name = next((c.name for c in cands if c.manifest and not c.trust_error), "")
        if not name:
            raise ResumeRefused(f"resume.init_from: {redact_url(url)} holds no committed"
                                f"{' and trusted' if key else ''} state")
    cand = read_candidate(src, name, key)
    if cand.manifest is None:
        raise ResumeRefused(f"resume.init_from: {redact_url(url)} is not a committed state (no manifest.json)")
    if cand.trust_error:
        raise ResumeRefused(f"resume.init_from: {redact_url(url)}/states/{name} is untrusted: {cand.trust_error}. "
                            "Give the source run's key with resume.init_from_signing_key_env")
    fetched = fetch_state(src, cand, rank, want_rng=False)
    try:
        load_into_engine(engine, fetched, module_only=not spec.resume.init_optimizer)
    finally:
        fetched.cleanup()
    if rank == 0:
        print(f"[syncpoint] init_from {redact_url(src.url)}/states/{name}: weights imported; schedule, RNG and data start fresh",
              flush=True)


def _retain(spec: JobSpec, storage: RunStorage, exp: Expectation, faults: Faults, lease: RunLease | None = None,
            keep: str | None = None, signing_key: bytes | None = None) -> None:
    """Retention after a commit. ``keep`` (the state this run just committed) is never deleted, even
    when newer states of another trajectory (a run resumed from an older pin) outnumber it: a restart
    of this submission continues from it."""
    if spec.checkpoint.keep_last == 0 and not spec.checkpoint.prune_unsafe:
        return  # keep everything (torn debris included): no need to read every state after each save
    if lease is not None and lease.confirm() is not None:
        return  # lost: delete nothing; every rank stops at the next boundary (SaveCoordinator's vote)
    plan = plan_retention(discover(storage, exp, signing_key), spec.checkpoint.keep_last, spec.checkpoint.prune_unsafe,
                          kinds=storage.entry_kinds("states"))
    for i, name in enumerate(n for n in plan.delete if n != keep):
        delete_state(storage, name)
        if i == 0:
            faults.at_phase("during_retention")
    for line in plan.reported:
        print(f"[syncpoint] retention kept unsafe state {line}", file=sys.stderr, flush=True)
