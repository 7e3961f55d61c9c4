"""P12 cold start: where a fresh submission of the example job spends its time before it trains.

What it measures: ``syncpoint run examples/tiny_lm.yaml`` as a user starts it (a new process, an
embedded local Ray, 2 workers, ZeRO-2 on CPU), stopped after a few optimizer steps
(``train.max_steps``), in a new run directory, ``--rounds`` times. From the run's event log and the
command's own start time:

* **CLI**: the command's start to the driver's ``submitted`` event (Python and syncpoint imports,
  the spec and the task import check);
* **Ray**: ``submitted`` to rank 0's launch (``ray.init`` of a local instance, Ray Train's
  controller, the placement group, the worker processes and their runtime environment);
* **worker phases**: rank 0's start-up profile, which every attempt records in its
  ``attempt_started`` event (``AttemptStarted.setup``: imports, the task, the DeepSpeed engine and
  its ops, the lease, selection and the state load, the data source);
* **announce**: the end of that profile to the ``attempt_started`` event (every rank's node
  gathered, the event written);
* **first step**: ``attempt_started`` to the first optimizer step's record (the first batches, the
  first backward and optimizer step);
* the total, the command's start to the first optimizer step, and the whole command's wall time.

The median of each over the rounds is printed (DeepSpeed's CPU ops are built once per venv, by
``make example`` or the tests, and only loaded here). No goal line: this is a profile (issue 32 §3 asks to keep one),
not a claim; the restart's own cost is P4's and P8's.

Command (from the repo root; ``--quick``: one round, about a minute here):

    .venv/bin/python -m bench.p12_cold_start --quick
    .venv/bin/python -m bench.p12_cold_start
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def one_round(work: str, extra: list[str]) -> dict[str, float]:
    """One cold submission; its phases in seconds, in order."""
    from syncpoint.workers.events import EventLog
    from syncpoint.workers.storage import RunStorage

    storage = os.path.join(work, "runs")
    t0 = time.time()
    proc = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "syncpoint"),
            "run",
            str(ROOT / "examples" / "tiny_lm.yaml"),
            "--set",
            f"storage={storage}",
            "--set",
            f"train.max_steps={STEPS}",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.time() - t0
    if proc.returncode:
        raise RuntimeError(f"the example failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    events = EventLog(RunStorage(f"file://{storage}/tiny-lm")).read_all()
    submitted = next(e for e in events if e["kind"] == "submitted")
    started = next(e for e in events if e["kind"] == "attempt_started")
    first_step = min(r["time"] for e in events if e["kind"] == "progress" for r in e["records"])
    setup = dict(started.get("setup") or [])  # (phase, seconds) pairs, in order
    phases: dict[str, Any] = {"CLI: imports, spec, task import check": submitted["time"] - t0}
    phases["Ray: local instance, controller, worker group"] = started["launched_at"] - submitted["time"]
    phases.update({f"worker: {name}": seconds for name, seconds in setup.items()})
    phases["announce (every rank's node gathered)"] = started["time"] - started["launched_at"] - sum(setup.values())
    phases["first optimizer step (first batches included)"] = first_step - started["time"]
    phases["total: command start -> first optimizer step"] = first_step - t0
    phases[f"whole command ({STEPS} steps, the final save, Ray's shutdown)"] = wall
    return phases


# (label, extra CLI arguments): the same cold start with each worker starting its own fork server
# (what every start did before warm servers) and with the node's warm server, interleaved per round
VARIANTS = [
    ("own servers", ["--set", "failure.warm_nodes=false"]),
    ("warm servers", []),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    print(f"P12 cold start: examples/tiny_lm.yaml to {STEPS} optimizer steps, {rounds} round(s)", flush=True)
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in VARIANTS}
    for i in range(rounds):
        for label, extra in VARIANTS:
            work = tempfile.mkdtemp(prefix="p12-")
            try:
                results[label].append(one_round(work, extra))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            first = results[label][-1]["total: command start -> first optimizer step"]
            print(f"  round {i + 1}, {label}: {first:.1f} s to the first step", flush=True)
    totals = {
        label: statistics.median(r["total: command start -> first optimizer step"] for r in rs)
        for label, rs in results.items()
    }
    labels = [label for label, _ in VARIANTS]
    print(f"\n{'phase (median of the rounds)':56s}" + "".join(f" {label:>14s} {'share':>6s}" for label in labels))
    for name in results[labels[-1]][0]:
        row = f"{name:56s}"
        for label in labels:
            seconds = statistics.median(r.get(name, 0.0) for r in results[label])
            share = "" if name.startswith(("total", "whole")) else f"{100 * seconds / totals[label]:5.1f}%"
            row += f" {seconds:14.2f} {share:>6s}"
        print(row)
    own, warm = totals["own servers"], totals["warm servers"]
    print(
        f"goal start_up_warm_vs_own_servers: {warm / own:.2f}x vs <= 0.6x: {'met' if warm <= 0.6 * own else 'not met'} "
        f"({warm:.1f} s vs {own:.1f} s to the first step, side by side)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
