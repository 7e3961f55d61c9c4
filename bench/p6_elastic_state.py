"""P6 elastic optimizer state: what "gather on save" costs a save.

What it measures
    Elastic ZeRO-1/2 runs (``scaling.num_workers: {min, max}``) also gather the full fp32 master
    weights and Adam moments at every save and write them as ``optim/full.safetensors``, so the
    state loads at another world size (``workers/state/elastic_state.py``). On the P2 model (25M
    parameters, ZeRO-2, AdamW, a ~400 MB state) this script runs the same short job twice in one
    process — plain, and elastic ({min: 1, max: 1}: same world size, elastic bookkeeping on) —
    each saving every 10 optimizer steps, and compares the loop-blocked seconds and bytes per
    save from the ``state_committed`` events.

Baseline: the same save without the gathered state, measured in the same run.
Command: ``cd /work/main && .venv/bin/python -m bench.p6_elastic_state`` (~1.5 min here).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile


def run(root: str, elastic: bool, steps: int) -> list[dict]:
    from bench.p2_save_cost import SPEC
    from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
    from syncpoint.workers.events import EventLog
    from syncpoint.workers.launch import run_in_process
    from syncpoint.workers.storage import RunStorage

    overrides = [
        f"storage={root}",
        f"name=p6-{'elastic' if elastic else 'plain'}",
        f"train.max_steps={steps}",
        "checkpoint.save_every={value: 10, unit: optimizer_steps}",
        "checkpoint.keep_last=1",
    ]
    if elastic:
        overrides.append("scaling.num_workers={min: 1, max: 1}")
    spec = resolve_storage(parse_spec(SPEC, "bench/p6", overrides))
    with contextlib.redirect_stdout(io.StringIO()):
        run_in_process(spec, print_progress=False)
    commits = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "state_committed"]
    RunStorage(spec.run_url).delete_tree()
    return commits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="syncpoint-p6-")
    rows = {}
    for elastic in (False, True):
        commits = run(root, elastic, args.steps)
        periodic = [c for c in commits if "final" not in c["reasons"]] or commits
        rows[elastic] = (
            statistics.median(c["blocked_seconds"] for c in periodic),
            statistics.median(c["bytes"] for c in periodic),
            len(periodic),
        )
    (b0, n0, k0), (b1, n1, k1) = rows[False], rows[True]
    print("P6 elastic optimizer state: 25.1M-parameter MLP, ZeRO-2, fp32, AdamW, 1 rank, sync saves to local disk")
    print(f"{'save':<36} | {'saves':>5} | {'MB':>7} | {'blocked s (median)':>18} | {'vs plain':>8}")
    print("-" * 86)
    print(f"{'plain (DeepSpeed shards only)':<36} | {k0:>5} | {n0 / 1e6:>7.0f} | {b0:>18.3f} | {1.0:>7.2f}x")
    print(f"{'elastic (+ gathered full state)':<36} | {k1:>5} | {n1 / 1e6:>7.0f} | {b1:>18.3f} | {b1 / b0:>7.2f}x")
    print("bytes ratio elastic/plain: %.2fx (the gathered fp32 weights + two Adam moments)" % (n1 / n0))


if __name__ == "__main__":
    main()
