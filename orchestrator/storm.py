"""``syncpoint drill JOB --storm N``: N interruptions of random kinds at random points, in one run.

The kinds and how each is classified: ``syncpoint.orchestrator.interruptions``.

Spot users meet preemptions in series and at the worst moments; a storm rehearses that. The plan
is drawn from a seed and printed first, so a failing storm can be replayed exactly. It is laid out
on the *reference run's own trajectory* (its boundaries and saves, read from its event log): the
points of a save-phase crash or a SIGTERM notice depend on where the job's boundaries and saves
fall, and only the run itself knows them without building the task on the driver.

Every interruption fires at an exact point, so each one causes its own restart(s) and the report
can say what each one cost:

* worker-side kinds are ``CrashFault``s in the interrupted run's spec (once per run, recorded in
  storage): ``crash`` (``os._exit``), ``sigterm`` (a notice; the rank dies after the next boundary's
  save), ``save-crash`` (``os._exit`` inside a save phase of the first save at or after the point);
* node kinds stop a rank with ``mode: hold`` at the point, and the controller thread here, which
  watches the event log, removes that rank's node (``node``, ``node-gone``, ``two-nodes``: also the
  node of a second rank) while the rank waits. ``crash+node`` is an interruption during the restart
  of another: a crash at the point, then the node of the same rank is removed as soon as the next
  attempt has started (a ``hold`` one micro-step later keeps that attempt from running past it).

A fixed-size job gets every lost node back after a short random delay, as an autoscaler would; an
elastic job's replacement joins before the node goes (so the restart cannot pick a smaller world and
later resize back, a restart nobody planned), and only ``node-gone`` (elastic, last in the plan, at
most once: global micro-steps are renumbered on another world size) leaves it on fewer workers.

Two interruptions never share an attempt: a rank dying at micro-step E leaves the others running to
the next boundary (no collective in between), so the next point lies beyond that boundary.

Every wait here is bounded and says so when it is hit; a rank in ``hold`` gives up on its own
(``SYNCPOINT_FAULT_HOLD_S``).
"""

from __future__ import annotations

import bisect
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from syncpoint.orchestrator.interruptions import NODE_KINDS, InterruptionKind
from syncpoint.orchestrator.storm_report import fired_fault, storm_report, wall_seconds
from syncpoint.policies.contracts.journal import AttemptStarted, Journal
from syncpoint.policies.contracts.spec import CrashFault, JobSpec

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

    from syncpoint.orchestrator.drill import DrillReport
    from syncpoint.orchestrator.driver_signals import DriverSignals
    from syncpoint.orchestrator.ray_internals import ClusterNode

CRASH, SIGTERM, SAVE_CRASH = InterruptionKind.CRASH, InterruptionKind.SIGTERM, InterruptionKind.SAVE_CRASH
NODE, NODE_GONE, TWO_NODES = InterruptionKind.NODE, InterruptionKind.NODE_GONE, InterruptionKind.TWO_NODES
CRASH_THEN_NODE = InterruptionKind.CRASH_THEN_NODE
# the save phases a storm crashes in: every one a save always passes (during_retention fires only
# when retention deletes something, which depends on what earlier interruptions left behind)
SAVE_PHASES = ("before_shards", "after_some_shards", "before_manifest", "during_manifest", "before_retention")
RANK0_PHASES = ("before_manifest", "during_manifest")
MAX_STORM = 1000
PLAN_DRAWS = 200
REPLACEMENT_DELAY_S = (0.5, 2.5)  # a fixed-size job's lost node comes back after this long (uniform)
T = TypeVar("T")


class StormTooShort(ValueError):
    """The job has too few micro-steps for the interruptions asked (a usage error naming --storm)."""


@dataclass
class Trajectory:
    """What the plan needs of the reference run: its length, boundaries and saves (global micro-steps)."""

    total: int  # the last micro-step (the final save)
    boundaries: list[int]  # sorted: every optimizer step's micro-step
    saves: list[int]  # sorted: the micro-steps of the reference's saves before the final one

    @classmethod
    def of(cls, journal: Journal) -> Trajectory:
        finish = journal.last_finish
        total = finish.global_micro_step if finish else journal.furthest_micro_step()
        boundaries = sorted({s.global_micro_step for s in journal.steps().values()})
        saves = sorted({c.global_micro_step for c in journal.commits if c.global_micro_step < total})
        return cls(total, boundaries, saves)

    def next_boundary(self, after: int) -> int:
        """The first boundary strictly after ``after`` (the run's end when none)."""
        i = bisect.bisect_right(self.boundaries, after)
        return self.boundaries[i] if i < len(self.boundaries) else self.total

    def next_save(self, at_or_after: int) -> int | None:
        i = bisect.bisect_left(self.saves, at_or_after)
        return self.saves[i] if i < len(self.saves) else None


@dataclass
class Interruption:
    """One planned interruption of a storm: what strikes, at which micro-step and rank, and by when it has struck."""

    index: int  # 1-based, in plan order
    kind: InterruptionKind
    point: int  # the requested global micro-step
    rank: int
    end: int  # the micro-step by which the interruption has struck (the save, the notice's boundary)
    phase: str | None = None  # save-crash
    save_at: int | None = None  # save-crash: the save it crashes in
    other_rank: int | None = None  # two-nodes: the second rank whose node goes
    replacement_delay_s: float | None = None  # node kinds: None = no replacement; 0 = joins before the loss

    @property
    def faults(self) -> list[CrashFault]:
        """The worker-side part of this interruption."""
        if self.kind == CRASH:
            return [CrashFault(rank=self.rank, at_micro_step=self.point, mode="exit")]
        if self.kind == SIGTERM:
            return [CrashFault(rank=self.rank, at_micro_step=self.point, mode="sigterm")]
        if self.kind == SAVE_CRASH:
            return [CrashFault(rank=self.rank, at_micro_step=self.point, phase=self.phase, mode="exit")]
        if self.kind == CRASH_THEN_NODE:
            return [CrashFault(rank=self.rank, at_micro_step=self.point, mode="exit"), self.hold]
        return [self.hold]

    @property
    def hold(self) -> CrashFault:
        """Node kinds: the rank that waits for its node to go (crash+node: one step after the crash)."""
        step = self.point + 1 if self.kind == CRASH_THEN_NODE else self.point
        return CrashFault(rank=self.rank, at_micro_step=step, mode="hold")

    @property
    def restarts_expected(self) -> int:
        return 2 if self.kind == CRASH_THEN_NODE else 1

    def describe(self) -> str:
        replaced = (
            "no replacement"
            if self.replacement_delay_s is None
            else "a replacement joins first"
            if self.replacement_delay_s == 0
            else f"replaced after {self.replacement_delay_s:.1f} s"
        )
        if self.kind == CRASH:
            return f"rank {self.rank} killed (os._exit)"
        if self.kind == SIGTERM:
            return f"rank {self.rank} gets a preemption notice, saves at {self.end}, then dies"
        if self.kind == SAVE_CRASH:
            return f"rank {self.rank} killed in phase {self.phase} of the save at {self.save_at}"
        if self.kind == NODE:
            return f"the node of rank {self.rank} is lost; {replaced}"
        if self.kind == NODE_GONE:
            return f"the node of rank {self.rank} is lost; {replaced} (elastic: fewer workers from here)"
        if self.kind == TWO_NODES:
            return f"the nodes of ranks {self.rank} and {self.other_rank} are lost at once; {replaced}"
        return (
            f"rank {self.rank} killed, then its node is lost as soon as the next attempt has started "
            f"(at the latest at {self.point + 1}); {replaced}"
        )


@dataclass
class StormPlan:
    """A storm's interruptions, drawn from its seed over the run's trajectory: the same seed, the same storm."""

    seed: int
    trajectory: Trajectory
    world: int
    interruptions: list[Interruption] = field(default_factory=list)

    @property
    def faults(self) -> list[CrashFault]:
        return [f for i in self.interruptions for f in i.faults]

    def count(self, *kinds: InterruptionKind) -> int:
        return sum(i.kind in kinds for i in self.interruptions)

    def table(self) -> str:
        lines = [
            f"storm plan: {len(self.interruptions)} interruptions, seed {self.seed} (replay with --seed "
            f"{self.seed}); the reference ran {self.trajectory.total} micro-steps on {self.world} worker(s)",
            "   #  kind        at micro-step  what",
        ]
        lines += [f"{i.index:>4}  {i.kind:<10}  {i.point:>13}  {i.describe()}" for i in self.interruptions]
        return "\n".join(lines)


def storm_kinds(spec: JobSpec) -> list[InterruptionKind]:
    """The kinds a storm may draw for this spec (``node-gone`` is placed separately: last, elastic)."""
    kinds = [CRASH, SIGTERM, NODE, CRASH_THEN_NODE]
    if not spec.checkpoint.save_trigger and spec.checkpoint.save_every.unit not in ("seconds", "auto"):
        kinds.append(SAVE_CRASH)  # its save is known in advance only with a position-based interval
    if spec.scaling.max_workers >= 2:
        kinds.append(TWO_NODES)
    return kinds


def plan_storm(spec: JobSpec, n: int, seed: int, trajectory: Trajectory) -> StormPlan:
    """Draw ``n`` interruptions (seeded) on the reference's trajectory; ``StormTooShort`` if they do not fit."""
    rng = random.Random(seed)
    world = spec.scaling.max_workers
    kinds = storm_kinds(spec)
    shrinkable = spec.scaling.elastic and spec.scaling.max_workers > spec.scaling.min_workers
    t = trajectory
    cycle = max((b - a for a, b in zip([0, *t.boundaries], t.boundaries, strict=False)), default=1)
    # the fewest micro-steps any interruption takes: its point and the rest of that cycle
    if n * 2 > t.total - 1 or not t.boundaries:
        raise StormTooShort(_too_short(spec, n, t, cycle))
    for _ in range(PLAN_DRAWS):
        drawn = [rng.choice(kinds) for _ in range(n)]
        if shrinkable and rng.random() < 1 / (len(kinds) + 1):
            drawn[-1] = NODE_GONE
        plan = _place(spec, drawn, rng, t, world, cycle)
        if plan is not None:
            return StormPlan(seed, t, world, plan)
    raise StormTooShort(_too_short(spec, n, t, cycle))


def _too_short(spec: JobSpec, n: int, t: Trajectory, cycle: int) -> str:
    return (
        f"--storm {n}: the job is too short for {n} interruptions: its reference run has {t.total} micro-steps, "
        f"and each interruption needs its point plus the rest of its accumulation cycle (up to {cycle} "
        f"micro-steps here; a SIGTERM notice and a crash in a save also the way to their boundary or save) before "
        f"the next can strike, so that each costs a restart of its own; ask for fewer interruptions (--storm), "
        f"or lengthen the job for the drill (e.g. --set train.epochs=N or more task samples)"
    )


def _place(
    spec: JobSpec, kinds: list[InterruptionKind], rng: random.Random, t: Trajectory, world: int, cycle: int
) -> list[Interruption] | None:
    """Points for ``kinds`` in order, spread over the run; None when this draw does not fit."""
    extra = 3 * cycle if spec.checkpoint.async_save else 0  # an async save commits some boundaries later
    cursor, out = 1, []
    for i, kind in enumerate(kinds):
        left = len(kinds) - i
        room = (t.total - 1) - cursor - (left - 1) * (cycle + 1)  # leave the others their shortest span
        if room < 0:
            return None
        point = cursor + rng.randint(0, max(0, 2 * room // (left + 1)))  # evenly spread on average
        rank = rng.randrange(world)
        entry = Interruption(i + 1, kind, point, rank, end=point)
        if kind == SIGTERM:
            entry.end = t.next_boundary(point) + extra
        elif kind == SAVE_CRASH:
            entry.phase = rng.choice(SAVE_PHASES)
            entry.rank = 0 if entry.phase in RANK0_PHASES else rank
            entry.save_at = t.next_save(point)
            if entry.save_at is None:
                return None
            entry.end = entry.save_at + extra
        elif kind == CRASH_THEN_NODE:
            entry.end = point + 1
        elif kind == TWO_NODES:
            entry.other_rank = rng.choice([r for r in range(world) if r != rank])
        if kind in NODE_KINDS:
            entry.replacement_delay_s = (
                None
                if kind == NODE_GONE
                else 0.0
                if spec.scaling.elastic
                else round(rng.uniform(*REPLACEMENT_DELAY_S), 1)
            )
        if entry.end >= t.total:
            return None
        out.append(entry)
        cursor = t.next_boundary(entry.end) + 1  # the other ranks run on to the next boundary
    return out


def storm_variant(spec: JobSpec, plan: StormPlan) -> JobSpec:
    """The interrupted run's spec: the plan's faults, and budgets that cover every interruption."""
    from syncpoint.orchestrator.drill import _variant

    crashes = plan.count(CRASH, SAVE_CRASH, CRASH_THEN_NODE)
    run = _variant(spec, "drill", plan.faults, crashes)
    preemptions = plan.count(SIGTERM, *NODE_KINDS)
    if run.failure.max_preemptions != -1:
        run = run.model_copy(
            update={
                "failure": run.failure.model_copy(update={"max_preemptions": run.failure.max_preemptions + preemptions})
            }
        )
    return run


# ------------------------------------------------------------------ running


def run_storm(
    spec: JobSpec, n: int, seed: int, print_plan: bool = True, signals: DriverSignals | None = None
) -> DrillReport:
    """Reference, plan, interrupted run, verdict, on one local multi-node cluster. ``signals``: the
    command's own (``driver_signals``): a signal is the run in progress's notice (it saves at its next
    boundary and stops), no interruption strikes after it, and the report says the storm stopped."""
    from syncpoint.orchestrator.drill import _variant, local_cluster, stopped_report
    from syncpoint.orchestrator.ray_runner import run_reported
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    if spec.scaling.elastic:  # a world-size change is judged by samples per step, so record them
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"record_samples": True})})
    ref = _variant(spec, "drill-ref", [], 0)
    RunStorage(ref.run_url).delete_tree()
    RunStorage(_variant(spec, "drill", [], 0).run_url).delete_tree()  # a drill owns its two run directories
    with local_cluster(spec) as (cluster, nodes, cpus):
        ref_end = run_reported(ref, cluster.address, signals=signals)
        if signals is not None and signals.received is not None:
            return stopped_report(f"storm: {n} interruptions, seed {seed}", "storm", signals, "its reference run")
        ref_journal = EventLog(RunStorage(ref.run_url)).journal()
        if ref_end.failed:
            from syncpoint.orchestrator.drill import DrillReport

            return DrillReport(
                f"storm: the reference run failed, so no storm was run; its last line:\n  {ref_end.line}\n"
                "RESULT: FAILED (the reference run failed)",
                False,
            )
        plan = plan_storm(spec, n, seed, Trajectory.of(ref_journal))
        if print_plan:
            print(plan.table(), flush=True)
        run = storm_variant(spec, plan)
        ref_wall = wall_seconds(ref_journal)
        budget_s = 120.0 + 3 * ref_wall + 240.0 * n  # the whole interrupted run, restarts included
        controller = Controller(cluster, nodes, cpus, run, plan, budget_s, signals)
        rc_run, problems = controller.run()
    if signals is not None and signals.received is not None:
        return stopped_report(f"storm: {n} interruptions, seed {seed}", "storm", signals, "its interrupted run")
    return storm_report(ref, run, plan, 0, rc_run, problems, controller.removals)


@dataclass
class Removal:
    """A node the storm took away: at which interruption and attempt, the ranks it held, and when."""

    interruption: int
    attempt: int
    ranks: list[int]
    time: float


class Controller:
    """Runs the interrupted run in a thread and plays the cloud: removes nodes when their hold fires
    (or, for crash+node, when the next attempt starts) and brings replacements back."""

    POLL_S = 0.25

    def __init__(
        self,
        cluster: Cluster,
        nodes: list[ClusterNode],
        cpus: int,
        run: JobSpec,
        plan: StormPlan,
        budget_s: float,
        signals: DriverSignals | None = None,
    ) -> None:
        from syncpoint.workers.observation.events import EventLog
        from syncpoint.workers.storage import RunStorage

        self.cluster, self.nodes, self.cpus, self.run_spec, self.plan = cluster, nodes, cpus, run, plan
        self.storage = RunStorage(run.run_url)
        self.log = EventLog(self.storage)
        self.deadline = time.monotonic() + budget_s
        self.budget_s = budget_s
        self.pending_adds: list[float] = []  # monotonic times a replacement node is due
        self.removals: list[Removal] = []
        self.problems: list[str] = []
        self.result: dict[str, int] = {}
        # the command's signals: the run's notice; this (main) thread takes them back once the run's
        # ray.init (in its thread) put Ray's own SIGTERM handler in place
        self.signals, self.reinstalled = signals, signals is None

    def run(self) -> tuple[int, list[str]]:
        from syncpoint.orchestrator.ray_runner import run_reported

        def target() -> None:
            try:
                self.result["rc"] = run_reported(self.run_spec, self.cluster.address, signals=self.signals).code
            except Exception as e:  # noqa: BLE001 - reported as the run's failure, the storm still reports
                self.problems.append(f"the interrupted run raised {type(e).__name__}: {e}")
                self.result["rc"] = 1

        thread = threading.Thread(target=target, daemon=True, name="storm-run")
        thread.start()
        try:
            for entry in self.plan.interruptions:
                if entry.kind in NODE_KINDS and not self._strike(entry, thread):
                    break
            while self.pending_adds and thread.is_alive() and self._tick():
                time.sleep(self.POLL_S)
        finally:
            self._add_due(force=True)  # a fixed-size run waiting for capacity gets it, whatever happened
        # The run's own restarts are bounded by Ray Train's budgets; the wait for it by ours.
        thread.join(timeout=max(1.0, self.deadline - time.monotonic()))
        if thread.is_alive():
            self.problems.append(
                f"the interrupted run did not finish within the storm's bound ({self.budget_s:.0f} "
                "s: 120 s + 3 x the reference's wall time + 240 s per interruption); the cluster is "
                "shut down to end it"
            )
            return 1, self.problems
        return self.result.get("rc", 1), self.problems

    def _tick(self) -> bool:
        """Between polls: due replacements join; False (with a message) once the storm's bound is hit
        or the driver's signal came (no interruption strikes after the run's notice)."""
        self._add_due()
        if self.signals is not None:
            import ray

            if not self.reinstalled and ray.is_initialized():
                self.signals.install()
                self.reinstalled = True
            if self.signals.received is not None:
                self.problems.append(f"the storm stopped on {self.signals.name}")
                return False
        if time.monotonic() > self.deadline:
            self.problems.append(
                f"the storm's bound ({self.budget_s:g} s) was hit while waiting for the interrupted run; stopping"
            )
            return False
        return True

    def _add_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for due in [d for d in self.pending_adds if force or d <= now]:
            self.pending_adds.remove(due)
            self.nodes.append(self.cluster.add_node(num_cpus=self.cpus))

    def _wait(self, what: str, thread: threading.Thread, found: Callable[[Journal], T | None]) -> T | None:
        while True:
            hit = found(self.log.journal())
            if hit is not None:
                return hit
            if not thread.is_alive():
                self.problems.append(f"the run ended before {what}")
                return None
            if not self._tick():
                self.problems[-1] += f" (waiting for {what})"
                return None
            time.sleep(self.POLL_S)

    def _attempt_struck(self, entry: Interruption, thread: threading.Thread) -> AttemptStarted | None:
        """The attempt whose node this interruption removes, once its point is reached (None: the run
        ended first, or the wait's bound: a problem is recorded). ``crash+node``: the attempt after
        the crash's, released from its hold (the hold stops it one step after the crash point; the
        next attempt must not hold)."""
        if entry.kind != CRASH_THEN_NODE:
            hold = entry.hold.fault_id
            fired = self._wait(
                f"interruption {entry.index} ({entry.kind}) at micro-step {entry.point}",
                thread,
                lambda j: fired_fault(j, hold),
            )
            if fired is None:
                return None
            attempt = next((a for a in self.log.journal().attempts if a.attempt == fired.attempt), None)
            if attempt is None:
                self.problems.append(f"interruption {entry.index}: its attempt has no attempt_started event")
            return attempt
        crash = entry.faults[0].fault_id
        fired = self._wait(
            f"interruption {entry.index}'s crash at micro-step {entry.point}", thread, lambda j: fired_fault(j, crash)
        )
        if fired is None:
            return None
        crashed_in = fired.attempt
        started = self._wait(
            f"the attempt after interruption {entry.index}'s crash",
            thread,
            lambda j: next((a for a in j.attempts if a.attempt > crashed_in), None),
        )
        if started is not None:
            self.storage.write_json(
                {"fault": entry.hold.fault_id, "where": "done by the storm drill", "time": time.time()},
                "faults",
                entry.hold.fault_id + ".fired",
            )
        return started

    def _strike(self, entry: Interruption, thread: threading.Thread) -> bool:
        attempt = self._attempt_struck(entry, thread)
        if attempt is None:
            return False
        ranks = [entry.rank] + ([entry.other_rank] if entry.other_rank is not None else [])
        victims = [n for r in ranks for n in self.nodes if r < len(attempt.nodes) and n.node_id == attempt.nodes[r]]
        if len(victims) != len(ranks):
            self.problems.append(
                f"interruption {entry.index}: the node of rank(s) {ranks} in attempt "
                f"{attempt.attempt} is not one the drill started"
            )
            return False
        if entry.replacement_delay_s == 0:  # elastic: capacity first, so the restart keeps its world size
            for _ in victims:
                self.nodes.append(self.cluster.add_node(num_cpus=self.cpus))
        for v in victims:
            self.cluster.remove_node(v, allow_graceful=False)
            self.nodes.remove(v)
        if entry.replacement_delay_s:
            self.pending_adds += [time.monotonic() + entry.replacement_delay_s] * len(victims)
        self.removals.append(Removal(entry.index, attempt.attempt, ranks, time.time()))
        return True
