"""``syncpoint drill``: prove a job survives preemption before paying for spot capacity.

Runs the uninterrupted reference and the interrupted run on the same spec (as ``<name>-drill-ref``
and ``<name>-drill`` under the spec's storage), then compares per-step losses and the final
digest, and reports each preemption with the work it lost. Kinds of interruption:

* ``crash``   — the rank is killed hard (``os._exit``) after the micro-step: charged as a failure;
* ``sigterm`` — the rank gets a preemption notice, saves at the next boundary, then dies;
* ``node``    — a local multi-node Ray cluster (``ray.cluster_utils.Cluster``) loses the node
  hosting the rank without notice, and a replacement node joins (the autoscaler's part).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from syncpoint.orchestrator.interruptions import InterruptionKind
from syncpoint.orchestrator.timeline import format_goodput, restarts
from syncpoint.policies.contracts.journal import Evaluated, Journal, Step
from syncpoint.policies.contracts.spec import CrashFault, JobSpec
from syncpoint.policies.contracts.state_format import MODEL_FILE, STATES_DIR
from syncpoint.policies.decisions.goodput import goodput

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

    from syncpoint.orchestrator.driver_signals import DriverSignals
    from syncpoint.orchestrator.ray_internals import ClusterNode
    from syncpoint.orchestrator.ray_runner import JobOutcome


@dataclass
class DrillReport:
    """A drill's printed comparison and its verdict (``ok``: bitwise equal where the rules say it must be);
    ``exit_code``: a drill the driver's signal stopped (128 + its number), else None (0 if ok, else 1)."""

    table: str
    ok: bool
    exit_code: int | None = None

    @property
    def code(self) -> int:
        """The process's exit code for this drill."""
        return self.exit_code if self.exit_code is not None else int(not self.ok)


CRASH, SIGTERM, NODE = InterruptionKind.CRASH, InterruptionKind.SIGTERM, InterruptionKind.NODE


def _variant(spec: JobSpec, suffix: str, faults: list[CrashFault], extra_failures: int) -> JobSpec:
    failure = spec.failure.model_copy(update={"max_failures": spec.failure.max_failures + extra_failures})
    return spec.model_copy(update={"name": f"{spec.name}-{suffix}", "faults": faults, "failure": failure})


def run_drill(
    spec: JobSpec,
    points: list[int],
    hows: list[InterruptionKind],
    address: str | None = None,
    replacement: bool = True,
    signals: DriverSignals | None = None,
) -> DrillReport:
    """``hows[i]`` interrupts at ``points[i]`` (one kind may be given for all points). With
    ``replacement=False`` a lost node is not replaced: an elastic job continues on fewer workers.
    A reference run that fails ends the drill there, its last line in the report: there is nothing
    to compare an interrupted run with. ``signals``: the drill command's own (``driver_signals``): a
    signal is the notice of the run in progress, which saves at its next boundary and stops, and the
    drill stops there, comparing nothing."""
    from syncpoint.orchestrator.ray_runner import run_reported
    from syncpoint.workers.storage import RunStorage

    if len(hows) == 1:
        hows = hows * len(points)
    world = spec.scaling.max_workers
    faults = [
        CrashFault(rank=i % world, at_micro_step=p, mode="exit" if how == CRASH else "sigterm")
        for i, (p, how) in enumerate(zip(points, hows, strict=False))
        if how in (CRASH, SIGTERM)
    ]
    if spec.scaling.elastic:  # a world-size change is compared by samples per step, so record them
        spec = spec.model_copy(update={"train": spec.train.model_copy(update={"record_samples": True})})
    ref = _variant(spec, "drill-ref", [], 0)
    run = _variant(spec, "drill", faults, hows.count(CRASH))
    for s in (ref, run):
        RunStorage(s.run_url).delete_tree()  # a drill owns its two run directories

    node_points = [(i, p) for i, (p, how) in enumerate(zip(points, hows, strict=False)) if how == NODE]
    if node_points:
        ref_end, run_end = _node_drill(ref, run, node_points, replacement, signals)
    else:
        ref_end = run_reported(ref, address, signals=signals)
        go_on = not ref_end.failed and not (signals and signals.received)
        run_end = run_reported(run, address, signals=signals) if go_on else None
    if signals is not None and signals.received is not None:
        return drill_stopped(points, hows, signals, "its interrupted run" if run_end else "its reference run")
    if run_end is None:
        return reference_failed(points, hows, ref_end.line)
    return compare(ref, run, 0, 1 if run_end.failed else 0, points, hows, run_line=run_end.line)


@contextlib.contextmanager
def local_cluster(spec: JobSpec) -> Iterator[tuple[Cluster, list[ClusterNode], int]]:
    """A local multi-node Ray cluster for a node drill: a head with no CPUs (driver and Ray Train
    controller) and one node per worker, with fast GCS health checks so a removed node is declared
    dead within seconds. Yields (cluster, worker nodes, CPUs per node); shuts both down after."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
        },
    )
    try:
        cpus = max(1, int(spec.scaling.cpus_per_worker))
        nodes = [cluster.add_node(num_cpus=cpus) for _ in range(spec.scaling.max_workers)]
        cluster.wait_for_nodes()
        yield cluster, nodes, cpus
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_drill(
    ref: JobSpec, run: JobSpec, points: list[tuple[int, int]], replacement: bool, signals: DriverSignals | None
) -> tuple[JobOutcome, JobOutcome | None]:
    """How the reference and the interrupted run ended (None: not started, the reference failed or
    the driver's signal stopped it). The interrupted run's driver runs in a thread, so this (main)
    thread takes the signals back once its ``ray.init`` put Ray's own SIGTERM handler in place."""
    import ray

    from syncpoint.orchestrator.ray_runner import JobOutcome, run_reported
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    with local_cluster(run) as (cluster, nodes, cpus):
        ref_end = run_reported(ref, cluster.address, signals=signals)
        if ref_end.failed or (signals is not None and signals.received is not None):
            return ref_end, None
        result: dict[str, JobOutcome] = {}
        thread = threading.Thread(
            target=lambda: result.update(end=run_reported(run, cluster.address, signals=signals)), daemon=True
        )
        thread.start()
        log = EventLog(RunStorage(run.run_url))
        reinstalled = signals is None
        for i, point in points:
            while thread.is_alive():
                if not reinstalled and ray.is_initialized():
                    signals.install()  # type: ignore[union-attr]
                    reinstalled = True
                if signals is not None and signals.received is not None:
                    break  # the run saves and stops on the notice: no node is taken away now
                journal = log.journal()
                attempt = journal.last_attempt
                if attempt is not None and journal.furthest_micro_step() >= point:
                    rank_nodes = attempt.nodes
                    victim = next(n for n in nodes if n.node_id == rank_nodes[i % len(rank_nodes)])
                    cluster.remove_node(victim, allow_graceful=False)
                    nodes.remove(victim)
                    if replacement:
                        nodes.append(cluster.add_node(num_cpus=cpus))
                    break
                time.sleep(0.05)
        thread.join()
        lost = JobOutcome(
            line="the interrupted run's driver ended without an outcome (its error is above)", failed=True
        )
        return ref_end, result.get("end", lost)


def _params_close(
    ref: JobSpec, run: JobSpec, run_journal: Journal, finals: tuple[str, str], steps: dict[int, Step]
) -> tuple[bool, float, float]:
    """Adam moves a weight by ~lr per step whatever its gradient's size, and where a gradient is at
    rounding-noise level its sign is noise: 2 x the summed learning rate since the change bounds it."""
    from syncpoint.workers.integrity.digest import load_deepspeed_file
    from syncpoint.workers.storage import RunStorage

    changed_at = world_size_change(run_journal)
    bound = 2 * sum(r.lr for k, r in steps.items() if k > changed_at)

    def params(spec: JobSpec, name: str) -> dict:
        store = RunStorage(spec.run_url)
        if not store.exists(STATES_DIR, name, MODEL_FILE):  # ZeRO-3: rebuilt from partitions
            from syncpoint.workers.state.export import zero3_state_from_storage

            return zero3_state_from_storage(store, name)
        from syncpoint.workers.state.reader import read_listed, read_manifest

        entry = read_manifest(store, (STATES_DIR, name)).files[MODEL_FILE]
        return load_deepspeed_file(read_listed(store, (STATES_DIR, name), MODEL_FILE, entry))["module"]

    pa, pb = params(ref, finals[0]), params(run, finals[1])
    worst = max((pa[k] - pb[k]).abs().max().item() for k in pa)
    return worst <= bound, worst, bound


def compare_evaluations(ref: Journal, run: Journal) -> tuple[bool, str | None]:
    """The interrupted run's evaluations against the reference's, step by step (None: neither evaluated).

    Exact: the same steps evaluated, the same metric names, bitwise the same values (a resumed attempt
    that evaluates a step again must report what the uninterrupted run reported there). Across a
    world-size change the eval set is split otherwise and summed in another order: within 1e-3 relative."""
    a, b = ref.evaluations(), run.evaluations()
    if not a and not b:
        return True, None
    resized = len(run.world_sizes) > 1

    def same(x: dict[str, float], y: dict[str, float]) -> bool:
        if x.keys() != y.keys():
            return False
        return all(x[k] == y[k] or (resized and abs(x[k] - y[k]) <= 1e-3 * abs(x[k])) for k in x)

    differ = {k for k in a.keys() | b.keys() if k not in a or k not in b or not same(a[k].metrics, b[k].metrics)}
    # every evaluation of a step counts, also one a crash made the resumed attempt repeat
    differ |= {
        e.optimizer_step
        for e in run.of_kind(Evaluated)
        if e.optimizer_step in a and not same(a[e.optimizer_step].metrics, e.metrics)
    }
    mismatched = sorted(differ)
    ok = not mismatched
    verdict = ("within 1e-3 relative" if resized else "match") if ok else "MISMATCH"
    detail = f"; first mismatch at step {mismatched[0]}" if mismatched else ""
    if mismatched and mismatched[0] in a and mismatched[0] in b:
        detail += f" ({b[mismatched[0]].metrics} vs reference {a[mismatched[0]].metrics})"
    elif mismatched:
        detail += f" (evaluated in {'the reference only' if mismatched[0] in a else 'the interrupted run only'})"
    return ok, f"evaluation metrics: {verdict} ({len(a)} evaluations{detail})"


def world_size_change(journal: Journal) -> int:
    """The optimizer step the first world-size change resumed from (0: none, or from scratch)."""
    starts = journal.attempts
    return next((s.optimizer_step for p, s in zip(starts, starts[1:], strict=False) if s.world_size != p.world_size), 0)


def judge_resized(a: dict[int, Step], b: dict[int, Step], changed_at: int, worlds: list[int]) -> tuple[bool, list[str]]:
    """The documented rules of an elastic resume (docs/concepts/elastic.md), as the drill's verdict.

    Before the change both runs ran on the same world size: their steps must match bit for bit.
    From the change on, the rules that hold for every model decide: the same samples and learning
    rate at every optimizer step (and, in ``compare``, every weight within the parameter bound).
    The losses after the change are reported, not judged: the ranks' model-side RNG is re-seeded
    for the new world size, so with dropout (or any sampling in the forward) the masks, and so the
    losses, differ from the uninterrupted run's by design; without such randomness they agree to
    1e-3 relative (another summation order), and the line says which case it saw.
    """
    lines: list[str] = []
    same_keys = bool(a) and a.keys() == b.keys()
    before = [k for k in a if k <= changed_at]
    before_ok = same_keys and all(a[k].loss == b[k].loss and a[k].lr == b[k].lr for k in before)
    lines.append(
        f"per-step losses and learning rates before the world-size change (steps 1-{changed_at}): "
        f"{'match' if before_ok else 'MISMATCH'}"
    )
    same_samples = same_keys and all(a[k].samples == b[k].samples and a[k].lr == b[k].lr for k in a)
    lines.append(
        f"world sizes {worlds}: samples and learning rate of every optimizer step: "
        f"{'match' if same_samples else 'MISMATCH'}"
    )
    after = [k for k in a if k > changed_at and k in b]
    rel = max((abs(a[k].loss - b[k].loss) / max(abs(a[k].loss), 1e-12) for k in after), default=0.0)
    if rel <= 1e-3:
        lines.append(f"per-step losses after the change: within 1e-3 relative ({len(after)} steps)")
    else:
        lines.append(
            f"per-step losses after the change: differ (largest relative difference {rel:.1e}; expected "
            "when the model draws randomness, e.g. dropout: each rank's RNG is re-seeded for the new world "
            "size, so the masks differ; not part of the verdict, which follows the elastic rules)"
        )
    return before_ok and same_samples, lines


def _plan_line(points: list[int], hows: list[InterruptionKind]) -> str:
    # a node is removed once the flushed progress passes its point: it goes down later, where training really was
    return "drill: " + ", ".join(
        f"{h} at micro-step {p}" if h != NODE else f"node lost after micro-step {p}"
        for p, h in zip(points, hows, strict=False)
    )


def drill_stopped(points: list[int], hows: list[InterruptionKind], signals: DriverSignals, during: str) -> DrillReport:
    """The report of a drill the driver's signal stopped: the run in progress saved at its next
    boundary and stopped (its own line above says what it kept); nothing is compared."""
    return stopped_report(_plan_line(points, hows), "drill", signals, during)


def stopped_report(first: str, what: str, signals: DriverSignals, during: str) -> DrillReport:
    """A drill's or a storm's (``what``) report when the driver's signal stopped it, under its plan's line."""
    return DrillReport(
        "\n".join(
            [
                first,
                f"the {what} stopped on {signals.name} during {during}: nothing compared",
                f"RESULT: STOPPED (`{signals.rerun}` starts the {what} over)",
            ]
        ),
        False,
        exit_code=signals.exit_code(),
    )


def reference_failed(points: list[int], hows: list[InterruptionKind], last_line: str) -> DrillReport:
    """The report of a drill whose uninterrupted reference run failed: that failure, with the run's
    last line, rather than a comparison with a run that has no steps ("MISMATCH (0 optimizer steps)"
    sends the user hunting for a resume bug that is a job that never ran)."""
    return DrillReport(
        "\n".join(
            [
                _plan_line(points, hows),
                "the reference run (uninterrupted) failed, so there is nothing to compare the interrupted run "
                "with; its last line:",
                f"  {last_line or '(none: its error is above)'}",
                "RESULT: FAILED (the reference run failed)",
            ]
        ),
        False,
    )


def compare(
    ref: JobSpec,
    run: JobSpec,
    rc_ref: int,
    rc_run: int,
    points: list[int],
    hows: list[InterruptionKind],
    *,
    ref_line: str = "",
    run_line: str = "",
) -> DrillReport:
    """Compare the uninterrupted run with the interrupted one from their run directories.

    Args:
        ref, run: the two runs' specs (their run directories hold what is compared).
        rc_ref, rc_run: their exit codes (a failed run fails the drill, whatever its states say; a
            failed reference is the whole report: ``reference_failed``).
        points: the micro-steps the interruptions were planned at.
        hows: what struck at each point, in order.
        ref_line, run_line: their last lines, named in the report when they failed.
    """
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    if rc_ref != 0:
        return reference_failed(points, hows, ref_line)
    lines = [_plan_line(points, hows)]
    ref_journal = EventLog(RunStorage(ref.run_url)).journal()
    run_journal = EventLog(RunStorage(run.run_url)).journal()
    rs = restarts(run_journal)
    lines.append("preemption  kind     at micro-step  classified   resumed from   lost micro-steps  lost seconds")
    for i in range(max(len(rs), len(points))):  # every interruption the drill caused, and every restart seen
        at, how = (points[i], hows[i]) if i < len(points) else ("?", "?")
        if i >= len(rs):
            lines.append(f"{i + 1:>10}  {how:<7}  {str(at):>13}  {'no restart seen (the run did not stop there)'}")
            continue
        r = rs[i]
        if how in (NODE, "?"):  # where it really stopped: measured by the heartbeat, else at least the point
            at = r.previous_max_micro_step if r.measured else (f">={at}" if how == NODE else at)
        lines.append(
            f"{i + 1:>10}  {how:<7}  {str(at):>13}  {r.cause:<11}  {r.resumed_from or 'scratch':<13}  "
            f"{r.lost_micro_steps:>16}  {r.lost_seconds:>12.2f}"
        )
    ok = rc_run == 0 and len(rs) == len(points)
    if len(rs) != len(points):
        lines.append(f"expected {len(points)} restart(s), saw {len(rs)}")
    if rc_run != 0:
        lines.append(f"the interrupted run failed: {run_line or '(its error is above)'}")
    judged, verdict_lines, verdict = judge(ref, run, ref_journal, run_journal)
    lines.extend(verdict_lines)
    ok = ok and judged
    lines.append("RESULT: " + (verdict if ok else "FAILED"))
    return DrillReport("\n".join(lines), ok)


def judge(ref: JobSpec, run: JobSpec, ref_journal: Journal, run_journal: Journal) -> tuple[bool, list[str], str]:
    """The verdict on the interrupted run against the reference: (ok, lines, what ok means).

    Same world size throughout: per-step losses and learning rates, evaluations and the final digest
    bit for bit. After a world-size change (elastic): the documented elastic rules (``judge_resized``
    and the parameter bound), stated as such."""
    from syncpoint.workers.integrity.digest import state_digest

    lines: list[str] = []
    a, b = ref_journal.steps(), run_journal.steps()
    worlds = run_journal.world_sizes
    resized = len(worlds) > 1
    changed_at = world_size_change(run_journal) if resized else 0
    if resized:  # elastic: judged by the documented rules, not by bitwise losses (judge_resized says why)
        losses_ok, elastic_lines = judge_resized(a, b, changed_at, worlds)
        lines.extend(elastic_lines)
    else:
        mismatched = [k for k in a if k not in b or a[k].loss != b[k].loss or a[k].lr != b[k].lr]
        losses_ok = bool(a) and not mismatched and a.keys() == b.keys()
        lines.append(
            f"per-step losses and learning rates: {'match' if losses_ok else 'MISMATCH'} ({len(a)} "
            "optimizer steps" + (f"; first mismatch at step {min(mismatched)}" if mismatched else "") + ")"
        )
    evaluations_ok, evaluation_line = compare_evaluations(ref_journal, run_journal)
    if evaluation_line:
        lines.append(evaluation_line)
    if resized and not evaluations_ok:
        # after the change an evaluation measures weights the elastic rules bound but do not pin
        ea, eb = ref_journal.evaluations(), run_journal.evaluations()
        evaluations_ok = all(k in eb and ea[k].metrics == eb[k].metrics for k in ea if k <= changed_at)
        lines.append(
            f"  evaluations before the world-size change: {'match' if evaluations_ok else 'MISMATCH'}; "
            "after it they follow the re-seeded dropout: reported, not part of the verdict"
        )
    finals = [j.last_finish.state if j.last_finish else None for j in (ref_journal, run_journal)]
    ref_final, run_final = finals
    digest_ok = False
    if resized:
        close, worst, bound = (
            _params_close(ref, run, run_journal, (ref_final, run_final), b)
            if ref_final and run_final
            else (False, float("nan"), 0.0)
        )
        lines.append(
            f"final parameters: {'within' if close else 'OUTSIDE'} the elastic bound "
            f"(max |diff| {worst:.2e} <= 2 x sum of learning rates since the change = {bound:.2e})"
        )
        digest_ok = close
    elif all(finals) and finals[0] == finals[1]:
        da = state_digest(f"{ref.run_url}/states/{finals[0]}")["digest"]
        db = state_digest(f"{run.run_url}/states/{finals[1]}")["digest"]
        digest_ok = da == db
        lines.append(f"final digest: {'match' if digest_ok else 'MISMATCH'} ({db[:16]}… vs reference {da[:16]}…)")
    else:
        lines.append(f"final digest: MISMATCH (final states {finals[1]} vs reference {finals[0]})")
    g = goodput(run_journal)
    if g is not None:
        lines.append("interrupted run's " + format_goodput(g))
    ok = losses_ok and digest_ok and evaluations_ok
    verdict = (
        "the interrupted run matched bit for bit until the world-size change, then consumed the same samples at "
        "the same learning rates and stayed within the elastic bound (docs/concepts/elastic.md)"
        if resized
        else "the interrupted run is bitwise the uninterrupted one"
    )
    return ok, lines, verdict
