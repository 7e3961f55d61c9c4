"""Where an attempt starts: every rank agrees on one state, loads it, and learns its position.

Rank 0 chooses from metadata alone (the resume policy over discovered candidates); every rank
fetches, verifies and loads; all agree or try the next candidate. With no state to resume,
``resume.policy: fresh`` archives or deletes what a previous submission left, and
``resume.init_from`` imports another run's weights. The result is one small record the loop
starts from: the state, the position, how to restore the RNG, and whether anything is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from syncpoint.policies.contracts.errors import (
    JobConfigError,
    NoResumableState,
    ResumeRefused,
    RunDirectoryRefused,
    StateMismatch,
)
from syncpoint.policies.contracts.journal import CandidateSeen, ResumeDecision
from syncpoint.policies.contracts.state_format import RNG, SAMPLER_VERSION, STREAM, STREAM_SAMPLER, TrainState
from syncpoint.policies.decisions.candidates import Candidate, Verdict
from syncpoint.policies.decisions.resume import (
    ContinueSubmission,
    NewestResumable,
    ResumePolicy,
    enforce_safe,
    make_policy,
    starts_over,
)
from syncpoint.workers.data.stream_state import SavedStream
from syncpoint.workers.state import rank_parts
from syncpoint.workers.state.discovery import discover_lazy
from syncpoint.workers.state.reader import StateRefused, fetch_state, load_into_engine
from syncpoint.workers.training import rng
from syncpoint.workers.training.attempt import Attempt
from syncpoint.workers.training.engine import apply_hyperparameters, set_counters
from syncpoint.workers.training.position import TrainingPosition
from syncpoint.workers.training.schedule import horizon_changed, resume_position

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
from syncpoint.workers.state.resume_choice import ResumeChoice, node_peers
from syncpoint.workers.state.run_origin import already_finished, clear_for_fresh, maybe_init_from


@dataclass
class ResumeStart:
    """Where this attempt starts, the same on every rank."""

    state: str | None  # the state loaded, or None for a fresh start (init_from weights included)
    position: TrainingPosition
    finished: bool  # the state is at or past the run's end: export and finish, train nothing
    rng_state: rng.SavedRng | None = None  # this rank's saved RNG streams (verified), restored before the first fetch
    rederive_rng: bool = False  # saved on another world size: per-rank streams are derived instead
    metrics: dict[str, Any] | None = None  # the resumed state's trainer.json metrics (evaluations carry on)
    # the epoch order's algorithm: the resumed state's, or NEW_RUN_SAMPLER (shard-window/v1 where the job asks)
    sampler: str = SAMPLER_VERSION
    stream_state: SavedStream | None = None  # a stream's: this rank's saved position (verified), restored first
    # where this rank read the state it loaded: "memory" (its node's memory copy) or "storage"; None: fresh
    restored_from: str | None = None

    def restore_rng(self, seed: int, rank: int) -> None:
        """After the data skip and every start-up draw, immediately before the first fetch (once)."""
        if self.rng_state is not None:
            rng.restore(self.rng_state)
        elif self.rederive_rng:
            rng.reseed_for_resized_world(seed, self.position.optimizer_step, rank)
        self.rng_state, self.rederive_rng = None, False


# What a run that starts without a state orders its epochs with (a test sets the legacy one to write
# states as syncpoint did before the per-position sampler).
NEW_RUN_SAMPLER = SAMPLER_VERSION


def negotiate_resume(attempt: Attempt, engine: DeepSpeedEngine) -> ResumeStart:
    """The one entry point: choose, fetch, load (falling back past refused states), then position.
    A state at or past the run's end finishes the run at once (a finished run stays finished)."""
    name, trainer, loaded = _choose_and_load(attempt, engine)
    live_data = attempt.live.identity.data
    new_run = NEW_RUN_SAMPLER if live_data.sampler == SAMPLER_VERSION else live_data.sampler
    start = ResumeStart(
        name,
        TrainingPosition(),
        finished=False,
        rng_state=loaded.rng_state,
        sampler=new_run if live_data.stream is None else STREAM_SAMPLER,
        stream_state=loaded.stream_state,
        restored_from=loaded.source,
    )
    if trainer is not None:
        _position_from(attempt, trainer, start)
        start.metrics = trainer.metrics
    set_counters(engine, start.position, resumed=name is not None)  # a loss may read DeepSpeed's counters
    if start.rng_state is not None and start.rng_state.task is None and rng.task_generator_kinds():
        attempt.warn(
            f"state {name} was written before syncpoint saved task-owned generators: "
            f"{', '.join(rng.task_generator_kinds())} continue from their freshly built state"
        )
    start.finished = already_finished(attempt, name, start.position, attempt.run_length)
    return start


def _position_from(attempt: Attempt, state: TrainState, start: ResumeStart) -> None:
    """The loaded state's position at this attempt's layout (index arithmetic, no sample touched);
    ``state`` was classified: its legacy counters are filled in."""
    spec, layout, at = attempt.spec, attempt.layout, start.position
    saved_world = state.world_size
    start.sampler = state.data.sampler  # classified already: one this syncpoint knows
    at.epoch, at.position_in_epoch = state.epoch, layout.position_for(state.data.samples_in_epoch)
    at.global_micro_step, at.optimizer_step = state.global_micro_step, state.optimizer_step
    at.global_samples = state.data.global_samples
    if saved_world != attempt.world_size:
        # Per-rank RNG streams cannot be carried to another world size: derive them instead.
        start.rederive_rng, start.rng_state = True, None
        attempt.warn(
            f"resuming a state saved on {saved_world} worker(s) on {attempt.world_size}: accumulation "
            f"{layout.grad_accum}, same samples per optimizer step; per-rank RNG re-derived from (seed, "
            "optimizer step, rank), so model-side randomness (dropout) differs from the uninterrupted run"
            + (
                f"; module buffers (BatchNorm statistics) of rank r are those of saved rank r mod {saved_world}"
                if state.per_rank_buffers
                else ""
            )
        )
    if at.position_in_epoch == layout.micro_batches_per_epoch:
        at.next_epoch()
    at.schedule_position = resume_position(
        state.scheduler,
        spec.train.scheduler,
        optimizer_step=at.optimizer_step,
        epoch_done=at.epoch,
        reset=spec.resume.reset_schedule,
        warn=attempt.warn,
    )
    line = horizon_changed(
        state.schedule_horizon, attempt.run_length.schedule_horizon, spec.train.scheduler, at.schedule_position
    )
    if line and attempt.rank == 0 and not spec.resume.reset_schedule:
        print(f"[syncpoint] {line}", flush=True)


@dataclass
class Loaded:
    """What this rank keeps of the state it loaded, beyond the engine: its RNG and its stream position
    (the parts the loop restores itself, ``rank_parts``), and where it read the state."""

    rng_state: rng.SavedRng | None = None
    stream_state: SavedStream | None = None
    source: str | None = None  # "memory" (this node's memory copy) or "storage"; None: nothing loaded


def _choose_and_load(attempt: Attempt, engine: DeepSpeedEngine) -> tuple[str | None, TrainState | None, Loaded]:
    """Rank 0 decides from metadata; every rank fetches, verifies and loads; all agree or try the next.

    Any refusal after selection marks that candidate and asks the policy again, so a bad newest
    state costs one fallback, not the run: corrupt when fetching or verifying refused it (a
    checksum, an unsafe file, a read error), incompatible when its verified files do not fit this
    model (``_load_refusal``). Returns the state's name, its trainer record and this rank's RNG
    state and stream position (None and empty: fresh start).
    """
    spec, rank = attempt.spec, attempt.rank
    restart = rank == 0 and attempt.restart
    policy = _resume_policy(spec.resume.policy, spec.resume.policy_args, attempt.submission_id if restart else "")
    candidates: Sequence[Candidate] = []
    discovered = rank != 0
    spec_dict = spec.model_dump(mode="json")
    while True:
        msg = ResumeChoice()
        if rank == 0:
            msg, candidates, discovered = _decide(attempt, policy, candidates, discovered, spec_dict)
            _emit_decision(attempt, msg, candidates)
        msg = msg.broadcast()
        if msg.error is not None:
            raise ResumeRefused(msg.error)
        if msg.state is None:
            attempt.say(msg.reason)
            maybe_init_from(attempt, engine)
            return None, None, Loaded()
        candidate = msg.candidate()
        loaded, refusal = _fetch_and_load(attempt, candidate, engine)
        if refusal is None:
            _say_resuming(attempt, candidate, msg)
            return candidate.name, candidate.state, loaded
        if rank == 0:
            for c in candidates:
                if c.name == candidate.name:
                    c.verdict, c.reason = _refused_verdict(refusal)


def _decide(
    attempt: Attempt,
    policy: ResumePolicy,
    candidates: Sequence[Candidate],
    discovered: bool,
    spec_dict: dict[str, Any],
) -> tuple[ResumeChoice, Sequence[Candidate], bool]:
    """Rank 0: discover once (here, so a refused run directory reaches every rank), ask the policy,
    and say what every rank fetches (or the error every rank raises)."""
    spec, restart = attempt.spec, attempt.restart
    try:
        if not discovered:
            candidates, discovered = discover_lazy(attempt.storage, attempt.live, attempt.signing_key), True
        decision = enforce_safe(policy.choose(candidates, spec_dict), candidates)
        chosen = next((c for c in candidates if c.name == decision.state), None)
        if decision.state is None and candidates and starts_over(spec.resume.policy) and not restart:
            clear_for_fresh(attempt)
        msg = ResumeChoice.of(decision.state, chosen, decision.reason)
    except (NoResumableState, RunDirectoryRefused) as e:
        msg = ResumeChoice(error=str(e))
    return msg, candidates, discovered


def _emit_decision(attempt: Attempt, msg: ResumeChoice, candidates: Sequence[Candidate]) -> None:
    if attempt.events:
        looked_at = candidates.inspected() if hasattr(candidates, "inspected") else list(candidates)
        attempt.events.emit(
            ResumeDecision(
                attempt=attempt.number,
                chosen=msg.state,
                reason=msg.reason or msg.error,
                total_candidates=len(candidates),
                candidates=[
                    CandidateSeen(state=c.name, verdict=c.verdict.value if c.verdict else None, reason=c.reason)
                    for c in looked_at
                ],
            )
        )


def _say_resuming(attempt: Attempt, candidate: Candidate, msg: ResumeChoice) -> None:
    attempt.say(f"resuming from state {candidate.name}: {msg.reason}")
    if attempt.signing_key is not None and msg.legacy_signature:
        attempt.warn(
            f"state {candidate.name} was signed before syncpoint bound signatures to their run "
            "directory: it is trusted by the key alone; the states this run writes are bound"
        )
    if attempt.spec.resume.init_from:
        attempt.say("resume.init_from ignored: this run's own resumable state wins")


def _resume_policy(name: str, policy_args: dict[str, Any], restart_of: str) -> ResumePolicy:
    """The spec's policy chooses where a submission starts; a restart continues its own states.

    ``fresh`` already emptied the directory on the submission's first attempt, so on a restart
    whatever is there was written by this submission (torn debris included)."""
    try:
        start = NewestResumable() if (restart_of and starts_over(name)) else make_policy(name, policy_args)
    except (ValueError, TypeError) as e:
        raise JobConfigError(
            f"resume.policy / resume.policy_args: {name}: {e}. Give the keyword arguments the "
            "policy's constructor takes (pinned: {state: N}; best-metric: {metric, mode})"
        ) from None
    return ContinueSubmission(restart_of, start) if restart_of else start


def _memory_note(attempt: Attempt, line: str, from_memory: bool) -> None:
    """Where the restore read the state: rank 0 says it for all when the memory copy served; a rank
    that fell back to storage says so itself (its node's copy was missing or failed)."""
    if from_memory:
        attempt.say(line)
    else:
        print(f"[syncpoint] rank {attempt.rank}: {line}", flush=True)


def _fetch_and_load(attempt: Attempt, candidate: Candidate, engine: DeepSpeedEngine) -> tuple[Loaded, str | None]:
    """Every rank fetches and verifies (its file of each per-rank part parsed whole: the RNG file
    tried too), then loads; (this rank's RNG state and stream position, None) or (nothing, the
    first rank's refusal).

    Both steps end in a collective so every rank takes the same branch. A refusal during the load
    (an unsafe file) leaves the engine partly loaded: the next candidate's load replaces all of it,
    and when none is left the run fails (it never trains on a half-loaded engine). Each per-rank
    part (``syncpoint.workers.state.rank_parts``) is checked against the live job with the fetch (module
    buffers against the live module) and put back after DeepSpeed's load, which gave every rank
    the buffers of its module file."""
    fetched, error, prepared = None, None, {}
    state = _classified(candidate)
    same_world = state.world_size == attempt.world_size
    live = rank_parts.LiveRank(attempt.rank, engine.module, attempt.stateful)
    sources = rank_parts.sources(attempt.rank, state)
    peers = node_peers()
    try:
        own = _own_shard(attempt, state, engine)
        # in place (local storage): the load below reads only through the checkpoint engine
        fetched = fetch_state(
            attempt.storage,
            candidate,
            attempt.rank,
            own_shard=own,
            in_place=same_world and not attempt.spec.resume.reset_optimizer,
            sources=sources,
            memory=attempt.memory_copy,
            say=lambda line, from_memory: _memory_note(attempt, line, from_memory),
            peers=peers,
            preload=own is not None,  # DeepSpeed then reads exactly the files fetched
        )
        for name, parsed in fetched.parts.items():
            part = rank_parts.behaviour(name)
            prepared[name] = part.prepare(parsed, part.layout.file(sources[name]), state, live)
    except Exception as e:  # noqa: BLE001 - any failure to fetch is a refusal of this candidate, agreed below
        error = _refusal(e)
    if peers is not None:
        peers.finish()  # a failure before the fetch made none of its gathers
    refusal = _first_refusal(error)
    if refusal is None:
        assert fetched is not None
        try:
            load_into_engine(
                engine,
                fetched,
                module_only=attempt.spec.resume.reset_optimizer,
                other_world_size=not same_world,
            )
            for part in rank_parts.PARTS:
                warning = part.apply(prepared.get(part.layout.name), live, candidate.name)
                if warning:
                    attempt.warn(warning)
        except Exception as e:  # noqa: BLE001 - as above: refused, and every rank agrees on it
            error = _load_refusal(e)
        refusal = _first_refusal(error)
    if fetched:
        fetched.cleanup()
    if refusal is not None:
        return Loaded(), refusal
    _apply_live_hyperparameters(attempt, engine, state)
    assert fetched is not None
    parts = fetched.parts
    return Loaded(parts.get(RNG.name), parts.get(STREAM.name), "memory" if fetched.mapped else "storage"), None


def _classified(candidate: Candidate) -> TrainState:
    """The chosen state's trainer record: selection admitted only states whose record parses."""
    state = candidate.parse().state
    assert state is not None, "a chosen state was classified resumable"
    return state


def _own_shard(attempt: Attempt, state: TrainState, engine: DeepSpeedEngine) -> int | None:
    """This rank's data-parallel rank where DeepSpeed's load reads only its own ZeRO files
    (``syncpoint.workers.state.reader``): ZeRO-1/2/3, same world size, optimizer loaded, no model
    parallelism, no ``zero_optimization.elastic_checkpoint``; else ``None`` (every shard is fetched)."""
    if (
        state.world_size != attempt.world_size
        or attempt.spec.resume.reset_optimizer
        or engine.zero_optimization_stage() not in (1, 2, 3)
        or engine.mpu is not None
        or engine.zero_elastic_checkpoint()
    ):
        return None
    return int(dist.get_rank(group=engine.optimizer.dp_process_group))


def _refusal(e: BaseException) -> str:
    if isinstance(e, StateMismatch):
        return _DOES_NOT_FIT + " ".join(str(e).split())
    return str(e) if isinstance(e, StateRefused) else f"{type(e).__name__}: {e}"


_DOES_NOT_FIT = "does not fit this model: "


def _load_refusal(e: BaseException) -> str:
    """A load that failed on files already verified against the manifest: those bytes are the ones
    the writer wrote, so anything but a refusal of a file (``StateRefused``) or a failing disk or
    memory is the state not fitting the live model (DeepSpeed's or torch's size mismatch, missing or
    unexpected keys): incompatible, never corrupt. DeepSpeed's multi-line messages become one line."""
    if isinstance(e, (StateRefused, OSError, MemoryError)):
        return _refusal(e)
    text = " ".join(str(e).split()).rstrip(".")
    return _DOES_NOT_FIT + (text if len(text) <= 400 else text[:397] + "...")


def _refused_verdict(refusal: str) -> tuple[Verdict, str]:
    """The verdict and reason of a candidate whose fetch or load every rank refused."""
    if refusal.startswith(_DOES_NOT_FIT):
        return Verdict.INCOMPATIBLE, (
            f"{refusal}. The state is intact, this run's model differs from the one that "
            "wrote it: restore the previous model (task / task.config), or start a new run "
            "(another name, or resume.policy: fresh)"
        )
    return Verdict.CORRUPT, f"verification failed: {refusal}"


def _first_refusal(error: str | None) -> str | None:
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _apply_live_hyperparameters(attempt: Attempt, engine: DeepSpeedEngine, state: TrainState) -> None:
    """Config wins for what the user sets: the state supplied moments, positions and the param
    groups' running state (the keys it records as changed by the optimizer itself), the live spec
    every other hyper-parameter (the loaded param groups carried the old ones); each change is said once."""
    running = None
    if not attempt.spec.resume.reset_optimizer:
        running = state.optimizer.running
    restored = apply_hyperparameters(engine, attempt.spec, running)
    if attempt.spec.resume.reset_optimizer:
        attempt.warn(
            "resume.reset_optimizer: weights and position come from the state; the optimizer state "
            "(moments) starts fresh"
        )
    for line in restored.changes:
        attempt.warn(line)
    for line in restored.kept:
        attempt.say(line)
