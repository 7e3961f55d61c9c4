"""What an attempt does before its first step: take the run's lease, announce itself, build the
save trigger, check the hash seed, number itself.

Why apart from the loop: each is a one-time step of ``run_worker`` with its own rule and its own
failure message; the loop module keeps the per-micro-step and per-boundary logic.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch.distributed as dist

from syncpoint.policies.contracts.errors import JobConfigError, LeaseRefused, ResumeRefused
from syncpoint.policies.contracts.import_path import load_class
from syncpoint.policies.contracts.journal import AttemptStarted, Journal
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.candidates import LiveJob
from syncpoint.policies.decisions.save_interval import (
    DEFAULT_PREEMPTIONS_PER_HOUR,
    AutoDecision,
    PreemptionHistory,
    preemption_history,
)
from syncpoint.policies.decisions.save_triggers import AutoInterval, SaveTrigger, trigger_from_interval
from syncpoint.workers.observation.events import skipped_line
from syncpoint.workers.state.resume_negotiation import ResumeStart
from syncpoint.workers.state.writer import SaveResult
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import RunLease
from syncpoint.workers.training import rng
from syncpoint.workers.training.attempt import Attempt

if TYPE_CHECKING:
    pass


def announce_attempt(
    attempt: Attempt,
    where: tuple[str, str],
    start: ResumeStart,
    launch: tuple[float, bool | None],
    setup: list[tuple[str, float]],
) -> None:
    """Rank 0 logs the attempt's start with every rank's (node, worker) and where it read its state."""
    gathered: list[tuple[str, str, str | None] | None] = [None] * attempt.world_size
    dist.all_gather_object(gathered, (*where, start.restored_from))
    nodes = [g[0] if g else "" for g in gathered]
    workers = [g[1] if g else "" for g in gathered]
    sources = [g[2] for g in gathered if g and g[2] in ("memory", "storage")]
    if attempt.events:
        attempt.events.emit(
            AttemptStarted(
                attempt=attempt.number,
                world_size=attempt.world_size,
                nodes=nodes,
                workers=workers if any(workers) else [],
                submission=attempt.submission_id,
                resumed_from=start.state,
                global_micro_step=start.position.global_micro_step,
                optimizer_step=start.position.optimizer_step,
                total_steps=attempt.run_length.total_steps,
                launched_at=launch[0],
                warm_start=launch[1],
                setup=setup,
                restored_from=sources if len(sources) == len(gathered) else [],
            )
        )


def make_trigger(attempt: Attempt) -> SaveTrigger:
    """The attempt's save trigger: the spec's own (``checkpoint.save_trigger`` or ``save_every``), or ``auto``'s."""
    spec = attempt.spec
    if not spec.checkpoint.save_trigger and spec.checkpoint.save_every.unit == "auto":
        return _auto_trigger(attempt)
    if not spec.checkpoint.save_trigger:
        return trigger_from_interval(spec.checkpoint.save_every.value, spec.checkpoint.save_every.unit)
    try:
        trigger: SaveTrigger = load_class(spec.checkpoint.save_trigger, "wants_save")()
        return trigger
    except (ValueError, TypeError) as e:
        raise JobConfigError(
            f"checkpoint.save_trigger: {e}. It must name a class with wants_save(tick) -> bool, "
            "constructible without arguments, importable on every worker"
        ) from None


def _auto_trigger(attempt: Attempt) -> AutoInterval:
    """``save_every: auto``: rank 0 reads the run's preemptions and save costs so far from the event
    log and every rank starts from the same history (one broadcast); rank 0 logs each decision."""
    box: list[PreemptionHistory | None] = [None]
    if attempt.events is not None:
        box[0] = preemption_history(attempt.events.journal())
    dist.broadcast_object_list(box, src=0)
    rate = attempt.spec.checkpoint.expected_preemptions_per_hour or DEFAULT_PREEMPTIONS_PER_HOUR
    return AutoInterval(rate, box[0], on_decision=_log_decision if attempt.rank == 0 else None)


def _log_decision(decision: AutoDecision) -> None:
    print(f"[syncpoint] {decision.describe()}", file=sys.stderr, flush=True)


def measuring(
    committed: Callable[[SaveResult, list[str]], None], trigger: AutoInterval, started: float
) -> Callable[[SaveResult, list[str]], None]:
    """``committed`` that also tells ``auto``'s interval what each save cost (``save_interval.cost_of``)."""

    def on_commit(result: SaveResult, reasons: list[str]) -> None:
        committed(result, reasons)
        trigger.observe_save(result.blocked_seconds + result.contended_seconds, time.monotonic() - started)

    return on_commit


def acquire_lease(spec: JobSpec, storage: RunStorage, live: LiveJob, rank: int, submission: str) -> RunLease | None:
    """Rank 0 takes the run directory's lease; every rank learns the outcome (one broadcast)."""
    lease, box = None, [cast(str | None, None)]
    if rank == 0:
        lease = RunLease(
            storage,
            job_identity=live.identity.job_identity,
            job_name=spec.name,
            submission=submission or uuid.uuid4().hex,
            ttl_s=spec.resume.lease_ttl_s,
        )
        try:
            lease.acquire()
        except LeaseRefused as e:
            box = [str(e)]
        else:
            line = lease.takeover_line()
            if line:  # a dead holder's expired lease (a lost head, a killed driver): say whose, and how old
                print(f"[syncpoint] {line}", flush=True)
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ResumeRefused(box[0])
    return lease


_HASH_SEED_WARNED: set[int] = set()


def check_hash_seed(attempt: Attempt) -> None:
    """Every rank checks that its interpreter runs with the job's PYTHONHASHSEED (one gather);
    rank 0 warns once per process, naming the ranks and the fix."""
    expected = rng.hash_seed(attempt.spec.train.seed)
    problems: list[str | None] = [None] * attempt.world_size
    dist.all_gather_object(problems, rng.hash_seed_problem(expected))
    bad = [r for r, p in enumerate(problems) if p]
    if bad and expected not in _HASH_SEED_WARNED:
        _HASH_SEED_WARNED.add(expected)
        attempt.warn(f"rank(s) {bad}: {problems[bad[0]]}")


def attempt_number(journal: Journal | None) -> int:
    """This attempt's number: one more than the attempts the journal holds (rank 0 reads, all learn).
    Rank 0 says which event files it skipped (planted or damaged: the run goes on without them)."""
    if journal is not None and journal.skipped:
        print(f"[syncpoint] {skipped_line(journal.skipped)}", file=sys.stderr, flush=True)
    box = [journal.next_attempt() if journal is not None else 1]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
