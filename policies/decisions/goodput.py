"""Goodput of a run, read from its journal: the share of wall time that became committed, kept
training progress, and where the rest went.

Why a pure function over the journal: the same figure is shown by ``syncpoint events``, the plot
and the drill, and a goodput simulator (``bench/``) checks itself against it on a real drill's
log; one definition, no I/O, testable over hand-built journals.

The run is the newest submission (``current_run``): a run directory submitted again after a failure,
or with ``syncpoint run --fresh``, counts only its own attempts, and the earlier ones stay in the
log (``syncpoint events``). Its wall time (its submission -- without a driver, rank 0's launch -- to
its ``finished`` event, or to the log's last event while it runs) is cut into consecutive pieces, so
the parts always add up to ``total_s``:

* ``startup_s``: from the submission (the first attempt) or the worker's launch (a restart:
  ``attempt_started.launched_at``) to the attempt's start (Ray workers, DeepSpeed, the state load
  and the resume negotiation); older logs without ``launched_at`` count a restart's whole wait as a
  restart gap;
* ``productive_s``: from an attempt's start to the snapshot of the state the run went on from
  (the next attempt's, or the attempt's own final state), less the saves that blocked the loop;
* ``save_blocked_s``: what the loop waited for saves (``state_committed.blocked_seconds``);
* ``recomputed_s``: a failed attempt's training after that snapshot up to where it was last seen
  computing (``Journal.reached``: the measured heartbeat when the log has it) -- the lost work that
  the next attempt computes again (or, for a run that failed for good, never keeps);
* ``restart_gap_s``: from there to the next attempt's launch (detection, the new worker group), and
  from a failure to the log's end when no attempt followed;
* ``uncommitted_s``: trained but not yet committed: the tail of a run still going (0 for a
  finished or failed run).

``ratio`` = productive / total. Evaluations are not productive (``evaluation``, below) unless
they fall in recomputed work, which is wasted whatever it computed.

The same pass sorts every second by cause, in the taxonomy of Google's ``ml-goodput-measurement``
(``Goodput.badput``, keys in ``BADPUT``, documented in ``docs/metrics.md``): the end-of-run
summary, ``syncpoint events``, ``syncpoint status`` and the plot all read this one split, so their
numbers agree. ``productive_s`` + ``badput`` + ``uncommitted_s`` = ``total_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from syncpoint.policies.contracts.journal import AttemptStarted, Evaluated, Finished, Journal, StateCommitted, Submitted

# The badput categories, in the order people read them: (key, label). Keys are Google's
# ml-goodput-measurement BadputType names, lower-cased and shortened (docs/metrics.md maps them);
# they are stable (``syncpoint status --json``, and metrics labels later): never rename one.
BADPUT: tuple[tuple[str, str], ...] = (
    ("initialization", "initialization"),  # TPU_INITIALIZATION + TRAINING_PREP
    ("compilation", "compilation"),  # PROGRAM_STARTUP: DeepSpeed's engine and its ops
    ("data_loading", "data loading"),  # DATA_LOADING_SYNC: the data source opened at the resumed sample
    ("checkpoint_save", "checkpoint save"),  # UNPRODUCTIVE_CHECKPOINT_SAVE_TIME
    ("checkpoint_restore", "checkpoint restore"),  # UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME
    ("evaluation", "evaluation"),  # CUSTOM_BADPUT_EVENTS (MaxText's eval)
    ("wasted_progress", "disruption: wasted progress"),  # WASTED_PROGRESS_FROM_DISRUPTION
    ("recovery", "disruption: recovery"),  # INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION
    ("other", "other / idle"),  # OTHER
)

# rank 0's start-up phases (``AttemptStarted.setup``, workers/training/loop.py's SetupLaps) by cause: a phase
# named here by its first words; any other phase, and start-up no phase covers, is initialization
_SETUP_PHASES: tuple[tuple[str, str], ...] = (
    ("DeepSpeed engine", "compilation"),
    ("selection and state load", "checkpoint_restore"),
    ("metrics, data source", "data_loading"),
)


@dataclass(frozen=True)
class RestartCost:
    """What one failed attempt cost the run."""

    attempt: int  # the attempt that failed
    lost_micro_steps: int  # computed beyond the state the next attempt resumed from
    recomputed_s: float
    restart_gap_s: float
    startup_s: float  # the next attempt's start-up
    measured: bool  # the interruption point is the heartbeat's, not the last flushed progress


@dataclass(frozen=True)
class Goodput:
    """A run's wall time, split (see the module docstring); the parts add up to ``total_s``."""

    total_s: float
    productive_s: float
    startup_s: float
    save_blocked_s: float
    recomputed_s: float
    restart_gap_s: float
    uncommitted_s: float = 0.0
    restarts: tuple[RestartCost, ...] = field(default=())
    finished: bool = False
    evaluation_s: float = 0.0  # evaluations in kept training (not productive)
    # seconds by cause (every key of ``BADPUT``, in its order); with productive and uncommitted, the total
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys((key for key, _ in BADPUT), 0.0))

    @property
    def ratio(self) -> float:
        """Productive share of the wall time (the effective training time ratio); 0 for an empty run."""
        return self.productive_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def badput_s(self) -> float:
        """All badput seconds (not the uncommitted tail of a run still going: not lost yet)."""
        return sum(self.badput.values())

    @property
    def losses(self) -> dict[str, float]:
        """Every non-productive part by its label, in the order people read them (``BADPUT``), then
        the uncommitted tail of a run still going."""
        return {label: self.badput[key] for key, label in BADPUT} | {"uncommitted": self.uncommitted_s}


def submission_start(journal: Journal, at: float, after: float = float("-inf")) -> float | None:
    """When the submission running at ``at`` began: the newest ``submitted`` event in ``(after, at]``;
    None where the log has none (a run outside ``syncpoint run``: one process group, no driver)."""
    times = [s.time for s in journal.of_kind(Submitted) if after < s.time <= at]
    return max(times) if times else None


def current_run(journal: Journal) -> Journal:
    """The events of the newest submission in the log: from the ``submitted`` event of the newest
    attempt's submission (earlier submissions' failed attempts are the log's history, not this run's
    restarts), and never before the last ``finished`` that precedes it, up to the finish that ends it."""
    last = journal.last_attempt
    if last is None:
        return journal
    before = [f.time for f in journal.finishes if f.time < last.time]
    after = [f.time for f in journal.finishes if f.time >= last.time]
    begin = max(before) if before else float("-inf")
    end = min(after) if after else float("inf")
    start = submission_start(journal, last.time, begin)
    return Journal(e for e in journal.events if begin < e.time <= end and (start is None or e.time >= start))


def goodput(journal: Journal) -> Goodput | None:
    """The newest run's goodput and badput by cause (``current_run``); None when no attempt started.

    ``journal``: ``syncpoint.policies.contracts.journal.Journal``, e.g. ``EventLog(storage).journal()`` or
    ``Journal.parse(records)`` over the stored records (``syncpoint events --json``)."""
    run = current_run(journal)
    attempts = run.attempts
    if not attempts:
        return None
    finish = run.last_finish
    t_start, t_end = _run_start(run, attempts[0]), (finish.time if finish else run.events[-1].time)
    acc = _Accounts()
    prev_end = t_start
    for i, a in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        # before training: the gap since the previous attempt stopped, then this attempt's start-up
        launched = _launched(run, a, prev_end) if i else t_start
        gap, startup = launched - prev_end, a.time - launched
        acc.add("gap", "recovery", gap)
        acc.parts["startup"] += startup
        _split_startup(a, startup, acc.bad)
        if acc.costs:  # the previous attempt failed: this is its restart
            acc.costs[-1] = replace(acc.costs[-1], restart_gap_s=gap, startup_s=startup)
        prev_end = _account_training(run, a, nxt, (finish, t_end), acc)
    bad = acc.bad
    bad["other"] += max(0.0, (t_end - t_start) - acc.parts["productive"] - acc.uncommitted - sum(bad.values()))
    return Goodput(
        total_s=t_end - t_start,
        productive_s=acc.parts["productive"],
        startup_s=acc.parts["startup"],
        save_blocked_s=acc.parts["blocked"],
        recomputed_s=acc.parts["recomputed"],
        restart_gap_s=acc.parts["gap"],
        uncommitted_s=acc.uncommitted,
        restarts=tuple(acc.costs),
        finished=finish is not None,
        evaluation_s=bad["evaluation"],
        badput=bad,
    )


def _run_start(run: Journal, first: AttemptStarted) -> float:
    """When the run began: its first event (its submission, under ``syncpoint run``); a run with no
    driver (no ``submitted``: ranks launched by hand or by a test) began when rank 0 was launched,
    before its first event, so its first start-up counts too."""
    start = run.events[0].time
    if not run.of_kind(Submitted) and first.launched_at is not None:
        return min(start, first.launched_at)
    return start


@dataclass
class _Accounts:
    """The running sums of one pass: the coarse parts (``Goodput``'s fields) and badput by cause."""

    parts: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("productive", "startup", "blocked", "recomputed", "gap"), 0.0)
    )
    bad: dict[str, float] = field(default_factory=lambda: dict.fromkeys((key for key, _ in BADPUT), 0.0))
    uncommitted: float = 0.0
    costs: list[RestartCost] = field(default_factory=list)

    def add(self, part: str, cause: str, seconds: float) -> None:
        self.parts[part] += seconds
        self.bad[cause] += seconds


def _account_training(
    run: Journal,
    a: AttemptStarted,
    nxt: AttemptStarted | None,
    ends: tuple[Finished | None, float],
    acc: _Accounts,
) -> float:
    """Adds one attempt's training: kept up to the cut (productive, less its saves and evaluations),
    lost or uncommitted after it; returns when it was last seen computing."""
    finish, t_end = ends
    end, cut, lost_steps, measured = _training(run, a, nxt, finish, t_end)
    kept_blocked, after_blocked = _blocked(run.commits, a.time, cut, end)
    acc.add("blocked", "checkpoint_save", kept_blocked + after_blocked)
    kept = (cut - a.time) - kept_blocked
    evaluated = min(_evaluated(run, a, cut), max(0.0, kept))
    acc.bad["evaluation"] += evaluated
    acc.parts["productive"] += kept - evaluated
    tail = (end - cut) - after_blocked
    if nxt is not None:
        acc.add("recomputed", "wasted_progress", tail)
        acc.costs.append(
            RestartCost(
                attempt=a.attempt,
                lost_micro_steps=lost_steps,
                recomputed_s=tail,
                restart_gap_s=0.0,
                startup_s=0.0,
                measured=measured,
            )
        )
        return end
    failures = [f for f in run.failures if f.time > a.time]
    if failures:  # failed: the tail is lost (for good, or the next attempt will compute it again)
        acc.add("recomputed", "wasted_progress", tail)
    else:
        acc.uncommitted += tail
    # from the failure to the log's end: a restart under way, or a run that failed for good
    retrying = bool(failures) and failures[-1].decision.upper() == "RETRY"
    acc.add("gap", "recovery" if retrying else "other", t_end - end)
    return end


def _split_startup(a: AttemptStarted, startup: float, bad: dict[str, float]) -> None:
    """An attempt's start-up by cause: rank 0's measured phases (``_SETUP_PHASES``), newest first and
    at most the start-up in all; the rest (Ray, the worker group, imports, the task) initialization."""
    left = max(0.0, startup)
    for phase, seconds in reversed(a.setup):
        cause = next((c for prefix, c in _SETUP_PHASES if phase.startswith(prefix)), "initialization")
        taken = min(max(0.0, seconds), left)
        bad[cause] += taken
        left -= taken
    bad["initialization"] += left


def _evaluated(run: Journal, a: AttemptStarted, cut: float) -> float:
    """Seconds this attempt spent evaluating before the cut (kept training; later ones are wasted)."""
    return sum(
        e.seconds for e in run.of_kind(Evaluated) if e.attempt == a.attempt and a.time <= e.time - e.seconds <= cut
    )


def _launched(run: Journal, a: AttemptStarted, prev_end: float) -> float:
    """When this attempt's workers were launched: recorded by rank 0, or the submission that started
    it; without either, the attempt's start (its whole wait counts as a restart gap)."""
    submitted = [s.time for s in run.of_kind(Submitted) if prev_end < s.time <= a.time]
    t = a.launched_at if a.launched_at is not None else (submitted[-1] if submitted else a.time)
    return min(max(t, prev_end), a.time)


def _training(
    run: Journal, a: AttemptStarted, nxt: AttemptStarted | None, finish: Finished | None, t_end: float
) -> tuple[float, float, int, bool]:
    """(end, cut, lost micro-steps, measured) of an attempt's training: ``end`` when it was last seen
    computing, ``cut`` the snapshot of the state the run went on from (``a.time`` <= cut <= end)."""
    if nxt is None and finish is not None:  # the run finished in this attempt: all of it is kept
        return t_end, t_end, 0, False
    step, seen, measured = run.reached(a, until=nxt.time if nxt else None)
    failed_for_good = nxt is None and any(f.time > a.time for f in run.failures)
    end = min(max(seen, a.time), nxt.time if nxt else t_end) if (nxt or failed_for_good) else t_end
    if nxt is not None:
        commit = _last_commit(run, nxt.resumed_from, before=nxt.time)
        lost = max(0, step - nxt.global_micro_step)
    else:  # still running or failed for good: kept up to its newest commit
        mine = [c for c in run.commits if a.time <= c.time <= end]
        commit, lost = (mine[-1] if mine else None), 0
    cut = commit.time - commit.seconds if commit else a.time
    return end, min(max(cut, a.time), end), lost, measured


def _last_commit(run: Journal, state: str | None, before: float) -> StateCommitted | None:
    return next((c for c in reversed(run.commits) if c.state == state and c.time <= before), None)


def _blocked(commits: list[StateCommitted], start: float, cut: float, end: float) -> tuple[float, float]:
    """Loop-blocked seconds of the saves taken in [start, end], split by where their snapshot lies:
    before the cut (kept) or at and after it; each part at most its piece of time."""
    kept = after = 0.0
    for c in commits:
        snapshot = c.time - c.seconds
        if start <= snapshot <= end:
            if snapshot < cut:
                kept += c.blocked_seconds
            else:
                after += c.blocked_seconds
    return min(kept, cut - start), min(after, end - cut)
