"""The run's ``syncpoint_*`` metric series, as samples computed from its journal: goodput, badput by
cause, restarts, saves, restore, throughput and the newest committed state.

Why pure and here: the driver publishes these on Ray's Prometheus endpoint
(``syncpoint.orchestrator.metrics_export``), and their numbers must agree with the run's last line,
``syncpoint events`` and ``syncpoint status``: they come from the same one accounting
(``syncpoint.policies.decisions.goodput.goodput``), and everything else is read from the same
journal; no I/O, no Ray, so a hand-built journal tests every value.

Label values are bounded: ``job_name`` (the spec's name, a validated identifier), ``submission`` (the
driver's id, one per ``syncpoint run``), ``cause`` (``BADPUT``'s keys), ``kind`` (``RESTART_KINDS``) and
``source`` (``RESTORE_SOURCES``). What the journal does not hold is not made up: tokens per second
would need the task's sequence length, so throughput is in samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from syncpoint.policies.contracts.journal import AttemptStarted, Journal, ProgressRecord, Submitted
from syncpoint.policies.decisions.goodput import BADPUT, Goodput, current_run, goodput

# how a failed attempt was followed: its training processes restarted in the same worker group, a new
# worker group (Ray Train's restart), or a new ``syncpoint run`` of the same run (after a stop, a lost
# head, a failure); stable label values (dashboards select on them): never rename one
RESTART_KINDS = ("in_place", "new_worker_group", "new_submission")
# where a rank read the state its attempt resumed (``AttemptStarted.restored_from``); stable label values
RESTORE_SOURCES: tuple[Literal["memory", "storage"], ...] = ("memory", "storage")
BASE_LABELS = ("job_name", "submission")
THROUGHPUT_WINDOW_S = 30.0  # step time and samples/s: the newest attempt's progress over this much time
_RESTORE_PHASE = "selection and state load"  # rank 0's start-up phase (workers/training/loop.py's SetupLaps)


@dataclass(frozen=True)
class Series:
    """One published series: its name (Ray's exporter prefixes ``ray_``), meaning and extra label."""

    name: str
    help: str
    label: str | None = None  # beyond BASE_LABELS: "cause", "kind" or "source"


SERIES: tuple[Series, ...] = (
    Series("syncpoint_goodput_ratio", "productive share of the run's wall time (0-1), the run's goodput"),
    Series("syncpoint_productive_seconds", "training the run kept, less save and evaluation waits"),
    Series("syncpoint_wall_seconds", "the run's wall time so far: productive + badput + uncommitted"),
    Series("syncpoint_badput_seconds", "non-productive seconds by cause (docs/metrics.md's table)", "cause"),
    Series("syncpoint_uncommitted_seconds", "trained since the newest committed state (a run still going)"),
    Series("syncpoint_restarts", "failed attempts the run went on from, by how it went on", "kind"),
    Series("syncpoint_recovery_seconds", "restarts' recovery: restart gap plus the next start-up, by kind", "kind"),
    Series("syncpoint_last_recovery_seconds", "the newest restart's recovery: restart gap plus start-up"),
    Series("syncpoint_lost_micro_steps", "micro-steps computed again after restarts (work lost)"),
    Series("syncpoint_saves", "states committed by this submission"),
    Series("syncpoint_last_save_blocked_seconds", "how long the loop waited for the newest save"),
    Series("syncpoint_last_save_bytes", "the newest committed state's size"),
    Series("syncpoint_last_save_durable_seconds", "the newest save, from its snapshot to its commit on storage"),
    Series("syncpoint_last_restore_seconds", "the newest attempt's state selection and load (it resumed a state)"),
    Series(
        "syncpoint_restored_ranks",
        "the newest attempt's ranks by where they read the state it resumed: their node's memory copy or storage",
        "source",
    ),
    Series("syncpoint_step_seconds", "wall time per optimizer step over the newest 30 s of progress"),
    Series("syncpoint_samples_per_second", "samples trained per second, all ranks, over the newest 30 s"),
    Series("syncpoint_committed_micro_step", "the newest committed state's global micro-step"),
    Series("syncpoint_committed_optimizer_step", "the newest committed state's optimizer step"),
    Series("syncpoint_attempt", "the newest attempt's number"),
    Series("syncpoint_optimizer_step", "the newest optimizer step the run logged"),
    Series("syncpoint_finished", "1 once the run finished, else 0"),
    Series("syncpoint_journal_time_seconds", "the newest event's time (Unix seconds): the values are as of it"),
)
SERIES_NAMES = frozenset(s.name for s in SERIES)


_Put = Callable[..., None]  # ``_Samples.put``: how the parts below add a sample


@dataclass(frozen=True)
class Sample:
    """One value of one series with its labels (BASE_LABELS, and the series' own label when it has one)."""

    series: str
    labels: tuple[tuple[str, str], ...]
    value: float


class _Samples(list[Sample]):
    """The samples being gathered, each with the base labels; a value not known (None) is left out."""

    def __init__(self, base: tuple[tuple[str, str], ...]) -> None:
        super().__init__()
        self.base = base

    def put(self, name: str, value: float | None, extra: tuple[tuple[str, str], ...] = ()) -> None:
        if value is not None:
            self.append(Sample(name, self.base + extra, float(value)))


def samples(journal: Journal, *, job_name: str, submission: str, micro_batch_size: int) -> list[Sample]:
    """Every series' values for the newest run in ``journal`` (``goodput.current_run``); empty before
    its first attempt started. ``micro_batch_size``: the spec's, for samples per second (the journal
    counts micro-steps)."""
    g = goodput(journal)
    if g is None:
        return []
    run = current_run(journal)
    out = _Samples((("job_name", job_name), ("submission", submission)))
    put = out.put
    _goodput_samples(g, put)
    _restart_samples(journal, run, g, put)
    _save_samples(journal, run, put)
    last = run.attempts[-1]
    put("syncpoint_last_restore_seconds", restore_seconds(last))
    if last.restored_from:
        for source in RESTORE_SOURCES:
            put("syncpoint_restored_ranks", last.restored_from.count(source), (("source", source),))
    step_s, per_s = throughput(run.progress_of(last.attempt), micro_batch_size * last.world_size)
    put("syncpoint_step_seconds", step_s)
    put("syncpoint_samples_per_second", per_s)
    put("syncpoint_attempt", last.attempt)
    steps = [r.optimizer_step for r in run.progress_of(last.attempt)]
    put("syncpoint_optimizer_step", max(steps, default=last.optimizer_step))
    put("syncpoint_finished", 1.0 if g.finished else 0.0)
    put("syncpoint_journal_time_seconds", run.events[-1].time)
    return list(out)


def _goodput_samples(g: Goodput, put: _Put) -> None:
    put("syncpoint_goodput_ratio", g.ratio)
    put("syncpoint_productive_seconds", g.productive_s)
    put("syncpoint_wall_seconds", g.total_s)
    for cause, _ in BADPUT:
        put("syncpoint_badput_seconds", g.badput[cause], (("cause", cause),))
    put("syncpoint_uncommitted_seconds", g.uncommitted_s)


def _restart_samples(journal: Journal, run: Journal, g: Goodput, put: _Put) -> None:
    """Restarts and their recovery by kind: within the submission, in place or by a new worker group
    (the failure that ended the attempt says which); before it, the earlier submissions it followed."""
    kinds = restart_kinds(run)
    count = dict.fromkeys(RESTART_KINDS, 0)
    recovery = dict.fromkeys(RESTART_KINDS[:2], 0.0)
    for cost in g.restarts:
        kind = kinds.get(cost.attempt, "new_worker_group")
        count[kind] += 1
        recovery[kind] += cost.restart_gap_s + cost.startup_s
    count["new_submission"] = resubmissions(journal, run)
    for kind in RESTART_KINDS:
        put("syncpoint_restarts", count[kind], (("kind", kind),))
    for kind, seconds in recovery.items():  # a new submission's wait is before this run's wall time
        put("syncpoint_recovery_seconds", seconds, (("kind", kind),))
    if g.restarts:
        put("syncpoint_last_recovery_seconds", g.restarts[-1].restart_gap_s + g.restarts[-1].startup_s)
    put("syncpoint_lost_micro_steps", sum(c.lost_micro_steps for c in g.restarts))


def _save_samples(journal: Journal, run: Journal, put: _Put) -> None:
    """This submission's saves, and the newest committed state: this submission's newest commit, else
    the state its newest attempt resumed (committed by an earlier submission)."""
    put("syncpoint_saves", len(run.commits))
    newest = run.commits[-1] if run.commits else None
    if newest is not None:
        put("syncpoint_last_save_blocked_seconds", newest.blocked_seconds)
        put("syncpoint_last_save_bytes", newest.bytes)
        put("syncpoint_last_save_durable_seconds", newest.seconds)
    else:
        resumed = run.attempts[-1].resumed_from
        newest = journal.commit_of(resumed) if resumed else None
    if newest is not None:
        put("syncpoint_committed_micro_step", newest.global_micro_step)
        put("syncpoint_committed_optimizer_step", newest.optimizer_step)


def restart_kinds(run: Journal) -> dict[int, str]:
    """Per failed attempt followed by another in this submission: ``in_place`` when the failure that
    ended it was recovered in its worker group, else ``new_worker_group``."""
    attempts = run.attempts
    kinds = {}
    for prev, nxt in zip(attempts, attempts[1:], strict=False):
        failure = run.failure_between(prev.time, nxt.time)
        kinds[prev.attempt] = "in_place" if failure is not None and failure.in_place else "new_worker_group"
    return kinds


def resubmissions(journal: Journal, run: Journal) -> int:
    """Earlier submissions this run followed: those since the run directory's last finish before this
    submission that started an attempt (each was stopped, lost or failed, and this one went on)."""
    if not run.events:
        return 0
    begin = run.events[0].time
    finishes = [f.time for f in journal.finishes if f.time < begin]
    after = max(finishes) if finishes else float("-inf")
    submitted = sorted(s.time for s in journal.of_kind(Submitted) if after < s.time < begin)
    started = [a.time for a in journal.attempts if after < a.time < begin]
    ends = [*submitted[1:], begin] if submitted else []
    return sum(1 for s, end in zip(submitted, ends, strict=True) if any(s <= t < end for t in started))


def restore_seconds(attempt: AttemptStarted) -> float | None:
    """Rank 0's state selection and load at the attempt's start, when it resumed a state (None: it
    started fresh, or its start-up was not measured)."""
    if attempt.resumed_from is None:
        return None
    return next((s for phase, s in attempt.setup if phase.startswith(_RESTORE_PHASE)), None)


def throughput(records: list[ProgressRecord], samples_per_micro_step: int) -> tuple[float | None, float | None]:
    """(seconds per optimizer step, samples per second) over the newest ``THROUGHPUT_WINDOW_S`` of one
    attempt's progress records; None where fewer than two records span some time."""
    if not records:
        return None, None
    newest = max(r.time for r in records)
    window = sorted((r for r in records if r.time >= newest - THROUGHPUT_WINDOW_S), key=lambda r: r.time)
    first, last = window[0], window[-1]
    dt = last.time - first.time
    if dt <= 0:
        return None, None
    steps, micro = last.optimizer_step - first.optimizer_step, last.global_micro_step - first.global_micro_step
    step_s = dt / steps if steps > 0 else None
    per_s = micro * samples_per_micro_step / dt if micro > 0 else None
    return step_s, per_s
