"""P3 lost work per preemption, read from the event log of real drills (embedded local Ray).

What it measures
    Two drills (``syncpoint.orchestrator.drill.run_drill``: the uninterrupted reference run, then the
    interrupted run of the same spec, both through ``syncpoint.orchestrator.ray_runner.run_on_ray`` on an
    embedded local Ray) of the example job ``examples/tiny_lm.yaml`` (2 workers, ZeRO-2, fp32,
    grad_accum 4, 64 micro-batches per epoch), shortened to 2 epochs (128 micro-steps,
    32 optimizer steps), ``checkpoint.save_every`` 8 optimizer steps (= 32 micro-steps: states at
    32, 64, 96 and the final 128), ``export_final: false``, storage in a temp dir:

    * with notice: ``hows=["sigterm"]`` at micro-steps 13 and 46 (the rank gets SIGTERM, the
      ranks agree at the next sync boundary, save there, then the rank's process dies);
    * without notice: ``hows=["crash"]`` at micro-steps 21 and 62 (the rank dies with
      ``os._exit`` after the micro-step; the restart resumes from the last periodic state).

    For each preemption, from the interrupted run's events (``<storage>/<name>-drill/events``) and
    ``syncpoint.orchestrator.timeline.restarts``: kind, the micro-step it was injected at, how the controller
    classified it, the state resumed from, lost micro-steps (computed by the failed attempt beyond
    that state), lost optimizer steps (progress records of the failed attempt past that state, i.e.
    completed optimizer steps that are recomputed; plus the leftover micro-steps of a partial
    accumulation cycle), lost seconds (from the resumed state's commit to the failed attempt's last
    recorded progress), and for notices the time from the notice to its committed state. The
    baseline each loss is compared with is one save interval (32 micro-steps, 8 optimizer steps,
    and the median seconds between periodic commits in the reference run of the same drill).
    The drills' own reports (per-step losses and learning rates, final digest) are printed too.

Baseline: one periodic save interval, measured on the reference run of the same drill.
Goal (issue P3): with notice, 0 optimizer steps lost; without notice, <= one save interval.

Command (from the repo root; about 2-2.5 minutes on 2 shared cores: each drill is two Ray runs, and
every run and restart starts Ray workers and DeepSpeed; ``--quick`` runs one preemption of each kind, 13
with notice and 62 without, in one drill: one reference run and one interrupted run, about half the time):

    cd /work/main && .venv/bin/python -m bench.p3_lost_work
    cd /work/main && .venv/bin/python -m bench.p3_lost_work --quick

No timed assertions: the script reports, it does not pass or fail on time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_lm.yaml"


def example_overrides(storage: str, name: str, save_every: int, epochs: int) -> list[str]:
    """The example job as the drill benches run it (P3, P4): quiet, a state every ``save_every``
    optimizer steps, every state kept, no final export."""
    return [
        f"storage={storage}",
        f"name={name}",
        f"train.epochs={epochs}",
        "train.log_every=1000",
        f"checkpoint.save_every={{value: {save_every}, unit: optimizer_steps}}",
        "checkpoint.keep_last=0",
        "checkpoint.export_final=false",
    ]


def drill_spec(storage: str, name: str, save_every: int, epochs: int):
    from syncpoint.orchestrator.spec_file import load_spec, resolve_storage

    return resolve_storage(load_spec(EXAMPLE, example_overrides(storage, name, save_every, epochs)))


# --quick's one drill: the preemption with notice, then the one without, in the same interrupted run
BOTH = "with and without notice"
KINDS = (("with notice", "sigterm"), ("without notice", "crash"))


def micro_batches_per_epoch(spec) -> int:
    return int(spec.task.config.get("num_samples", 1024)) // (spec.train.micro_batch_size * spec.scaling.max_workers)


def analyse(
    spec, run_events: list[dict[str, Any]], ref_events: list[dict[str, Any]], points: list[int], hows: list[str]
) -> tuple[list[dict[str, Any]], float]:
    from syncpoint.orchestrator.timeline import restarts
    from syncpoint.policies.contracts.journal import Journal
    from syncpoint.policies.decisions.boundaries import is_boundary, position_after

    accum, mbpe = spec.train.grad_accum, micro_batches_per_epoch(spec)

    def last_boundary(g: int) -> int:
        while g > 0 and not is_boundary((g - 1) % mbpe + 1, accum, mbpe):
            g -= 1
        return g

    starts = [e for e in run_events if e["kind"] == "attempt_started"]
    rows = []
    # the last attempt has no restart after it: the shorter list ends the pairing
    for i, (prev, r) in enumerate(zip(starts, restarts(Journal.parse(run_events)), strict=False)):
        a = prev.get("attempt")
        recs = [rec for e in run_events if e["kind"] == "progress" and e.get("attempt") == a for rec in e["records"]]
        recorded = len({rec["optimizer_step"] for rec in recs if rec["global_micro_step"] > r.resumed_micro_step})
        reached, resumed = r.previous_max_micro_step, r.resumed_micro_step
        lost_opt = max(
            0, position_after(reached, accum, mbpe).optimizer_step - position_after(resumed, accum, mbpe).optimizer_step
        )
        partial = reached - max(last_boundary(reached), resumed)
        notices = [e for e in run_events if e["kind"] == "preemption_notice" and e.get("attempt") == a]
        notice_commit = None
        if notices:
            commit = next(
                (
                    e
                    for e in run_events
                    if e["kind"] == "state_committed"
                    and e.get("attempt") == a
                    and "preemption" in e.get("reasons", [])
                    and e["time"] >= notices[0]["time"]
                ),
                None,
            )
            if commit:
                notice_commit = (notices[0]["global_micro_step"], commit["state"], commit["time"] - notices[0]["time"])
        rows.append(
            {
                "n": i + 1,
                "how": hows[i] if i < len(hows) else "?",
                "at": points[i] if i < len(points) else None,
                "cause": r.cause,
                "resumed_from": r.resumed_from or "scratch",
                "resumed_micro_step": r.resumed_micro_step,
                "reached": reached,
                "lost_micro": r.lost_micro_steps,
                "lost_opt": lost_opt,
                "recorded": recorded,
                "partial": max(0, partial),
                "lost_s": r.lost_seconds,
                "notice": notice_commit,
            }
        )
    # one save interval in seconds: median time between periodic commits of the reference run
    commits = [e for e in ref_events if e["kind"] == "state_committed" and "interval" in e.get("reasons", [])]
    gaps = [b["time"] - a["time"] for a, b in pairwise(commits)]
    starts_ref = [e for e in ref_events if e["kind"] == "attempt_started"]
    if commits and starts_ref and not gaps:
        gaps = [commits[0]["time"] - starts_ref[0]["time"]]
    return rows, statistics.median(gaps) if gaps else float("nan")


def parser() -> argparse.ArgumentParser:
    """The command line (``tests/integration/test_bench_contract.py`` checks every bench's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notice-at", type=int, nargs="+", default=[13, 46], help="sigterm (with notice) micro-steps")
    ap.add_argument("--crash-at", type=int, nargs="+", default=[21, 62], help="crash (no notice) micro-steps")
    ap.add_argument("--save-every", type=int, default=8, help="checkpoint.save_every in optimizer steps")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one drill: 13 with notice, then 62 without")
    ap.add_argument("--verbose", action="store_true", help="show Ray's and the workers' output")
    return ap


def plan_drills(args: argparse.Namespace) -> list[tuple[str, str, list[int], list[str]]]:
    """(label, run name, micro-steps, kinds) of each drill: one per kind; --quick: one of both kinds
    (one reference run and one interrupted run instead of two of each)."""
    if args.quick:  # the first notice and the last crash
        return [(BOTH, "p3-both", [args.notice_at[0], args.crash_at[-1]], ["sigterm", "crash"])]
    return [
        ("with notice", "p3-notice", args.notice_at, ["sigterm"]),
        ("without notice", "p3-crash", args.crash_at, ["crash"]),
    ]


def by_kind(label: str, rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """A drill's preemptions under their kind's label: --quick's drill of both kinds split by kind."""
    if label == BOTH:
        return [(kind, [r for r in rows if r["how"] == how]) for kind, how in KINDS]
    return [(label, rows)]


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    from syncpoint.orchestrator.drill import run_drill
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    storage = tempfile.mkdtemp(prefix="syncpoint-p3-", dir="/tmp")
    drills = plan_drills(args)
    results = []
    t_all = time.perf_counter()
    try:
        for label, name, points, hows in drills:
            spec = drill_spec(storage, name, args.save_every, args.epochs)
            t0 = time.perf_counter()
            quiet = contextlib.nullcontext() if args.verbose else contextlib.redirect_stdout(io.StringIO())
            with quiet:
                report = run_drill(spec, points, hows)
            secs = time.perf_counter() - t0
            run_events = EventLog(RunStorage(f"{spec.run_url}-drill")).read_all()
            ref_events = EventLog(RunStorage(f"{spec.run_url}-drill-ref")).read_all()
            rows, interval_s = analyse(
                spec, run_events, ref_events, points, hows * len(points) if len(hows) == 1 else hows
            )
            results.append((label, spec, points, report, rows, interval_s, secs))
            print(f"  [p3] drill {label}: {secs:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    total = time.perf_counter() - t_all

    spec = results[0][1]
    accum = spec.train.grad_accum
    mbpe = micro_batches_per_epoch(spec)
    interval_micro = args.save_every * accum
    print(
        f"P3 lost work per preemption: examples/tiny_lm.yaml, {spec.scaling.max_workers} workers, ZeRO-"
        f"{spec.deepspeed.zero_stage}, grad_accum {accum}, {mbpe} micro-batches/epoch, {args.epochs} epochs; "
        f"save_every {args.save_every} optimizer steps (= {interval_micro} micro-steps); embedded local Ray; "
        f"total {total:.0f} s"
    )
    print()
    hdr = (
        f"{'#':>2} | {'kind':<8} | {'at micro-step':>13} | {'classified':<11} | {'resumed from':<13} | "
        f"{'reached':>7} | {'lost micro-steps':>16} | {'lost opt steps (+partial)':>25} | {'in event log':>12} | "
        f"{'lost s':>6} | {'lost / interval (steps)':>23} | {'lost / interval (s)':>19} | "
        f"{'notice -> committed state':>25}"
    )
    summary = []
    for label, _spec, points, report, rows, interval_s, secs in results:
        print(
            f"{label} (drill {secs:.0f} s; one save interval = {interval_micro} micro-steps = {args.save_every} "
            f"optimizer steps = {interval_s:.2f} s in the reference run)"
        )
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            notice = "-"
            if r["notice"]:
                at, state, dt = r["notice"]
                notice = f"{at} -> {int(state)} in {dt:.2f} s"
            opt = f"{r['lost_opt']}" + (f" (+{r['partial']} micro)" if r["partial"] else "")
            print(
                f"{r['n']:>2} | {r['how']:<8} | {str(r['at']):>13} | {r['cause']:<11} | {r['resumed_from']:<13} | "
                f"{r['reached']:>7} | {r['lost_micro']:>16} | {opt:>25} | {r['recorded']:>12} | "
                f"{r['lost_s']:>6.2f} | "
                f"{r['lost_micro'] / interval_micro:>22.2f}x | {r['lost_s'] / interval_s:>18.2f}x | {notice:>25}"
            )
        if len(rows) != len(points):
            print(f"   expected {len(points)} restart(s), the event log shows {len(rows)}")
        print("drill report:")
        for line in report.table.splitlines():
            print(f"   {line}")
        print()
        summary += by_kind(label, rows)

    print("summary per kind")
    hdr = (
        f"{'kind':<15} | {'preemptions':>11} | {'lost micro-steps (mean / max)':>29} | "
        f"{'lost opt steps (max)':>20} | {'lost s (mean / max)':>19} | {'max lost / save interval':>24} | "
        f"{'goal':<30} | {'met':<3}"
    )
    print(hdr)
    print("-" * len(hdr))
    goals = []
    for label, rows in summary:
        goals.append(goal_line(label, rows, interval_micro))
        if not rows:
            print(f"{label:<15} | {0:>11} | (no restart in the event log)")
            continue
        lm = [r["lost_micro"] for r in rows]
        lo = [r["lost_opt"] for r in rows]
        ls = [r["lost_s"] for r in rows]
        if label == "with notice":
            goal, met = "0 optimizer steps lost", max(lo) == 0
        else:
            goal, met = f"<= 1 save interval ({interval_micro} micro)", max(lm) <= interval_micro
        print(
            f"{label:<15} | {len(rows):>11} | {f'{statistics.mean(lm):.1f} / {max(lm)}':>29} | {max(lo):>20} | "
            f"{f'{statistics.mean(ls):.2f} / {max(ls):.2f}':>19} | {max(lm) / interval_micro:>23.2f}x | {goal:<30} | "
            f"{'yes' if met else 'NO'}"
        )
    print()
    print(
        "lost micro-steps = micro-steps the failed attempt computed beyond the state the next attempt resumed from "
        "(syncpoint.orchestrator.timeline.restarts; 'reached' is the furthest micro-step in its progress records or "
        "its fault_fired event); lost opt steps = optimizer steps between that state and 'reached' (boundary "
        "arithmetic, syncpoint.policies.decisions.boundaries), '+partial' = micro-steps of an unfinished "
        "accumulation cycle; 'in event log' = those "
        "steps whose progress records reached the event log (records are flushed at commits and every 2 s, so a "
        "hard crash loses the unflushed tail: the lost-work figures rely on the fault_fired event here); lost s = "
        "from that state's commit (or the attempt's start) to the failed attempt's last recorded progress or fault."
    )
    print("Goal (issue P3): with notice 0 optimizer steps lost; without notice <= one save interval.")
    print()
    for line in goals:
        print(line)


def goal_line(label: str, rows: list[dict[str, Any]], interval_micro: int) -> str:
    """``goal <name>: <measured> vs <target>: met|not met`` for one drill: the worst preemption of
    the kind; a drill whose event log shows no restart has measured nothing and meets no goal."""
    if label == "with notice":
        name, target = "lost_optimizer_steps_with_notice", "0"
        worst = max((r["lost_opt"] for r in rows), default=None)
        met = worst == 0
    else:
        name, target = "lost_micro_steps_without_notice", f"<= {interval_micro} (one save interval)"
        worst = max((r["lost_micro"] for r in rows), default=None)
        met = worst is not None and worst <= interval_micro
    measured = "no restart in the event log" if worst is None else str(worst)
    return f"goal {name}: {measured} vs {target}: {'met' if met else 'not met'}"


if __name__ == "__main__":
    main()
