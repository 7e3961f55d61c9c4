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
Goal: the gathered state adds the fp32 master weights and the two Adam moments, nothing more:
12 bytes a parameter (within 2%: the files' headers). The blocked-time ratio is reported, with no
target (it is the price of loading at another world size).

Command (``--quick``: a 4.2M-parameter model, 20 steps, one periodic save each, ~40 s here):

    cd /work/main && .venv/bin/python -m bench.p6_elastic_state           # ~1.5 min here
    cd /work/main && .venv/bin/python -m bench.p6_elastic_state --quick

No timed assertions: the script reports, it does not pass or fail on time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import tempfile
from typing import Any

QUICK_MODEL = {"width": 1024, "depth": 2}  # P2's MLP, narrower and shallower
FULL_MODEL: dict[str, Any] = {}  # P2's MLP as P2 runs it (25.1M parameters)
BYTES_PER_PARAMETER = 12  # fp32 master weight + Adam's exp_avg and exp_avg_sq
TOLERANCE = 0.02


def run(root: str, elastic: bool, steps: int, model: dict[str, Any]) -> list[dict]:
    from bench.p2_save_cost import SPEC
    from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.supervision.launch import run_in_process

    overrides = [
        f"storage={root}",
        f"name=p6-{'elastic' if elastic else 'plain'}",
        f"train.max_steps={steps}",
        "checkpoint.save_every={value: 10, unit: optimizer_steps}",
        "checkpoint.keep_last=1",
    ]
    if model:
        overrides.append(f"task.config={json.dumps(model)}")
    if elastic:
        overrides.append("scaling.num_workers={min: 1, max: 1}")
    spec = resolve_storage(parse_spec(SPEC, "bench/p6", overrides))
    with contextlib.redirect_stdout(io.StringIO()):
        run_in_process(spec, print_progress=False)
    commits = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "state_committed"]
    RunStorage(spec.run_url).delete_tree()
    return commits


def parser() -> argparse.ArgumentParser:
    """The command line (``tests/integration/test_bench_contract.py`` checks every bench's)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of each run (default 30, quick 20)")
    ap.add_argument("--quick", action="store_true", help="a 4.2M-parameter model, 20 steps")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from bench.p2_save_cost import param_count

    model = QUICK_MODEL if args.quick else FULL_MODEL
    steps = args.steps or (20 if args.quick else 30)
    n_params = param_count(model)
    root = tempfile.mkdtemp(prefix="syncpoint-p6-")
    rows = {}
    try:
        for elastic in (False, True):
            commits = run(root, elastic, steps, model)
            periodic = [c for c in commits if "final" not in c["reasons"]] or commits
            rows[elastic] = (
                statistics.median(c["blocked_seconds"] for c in periodic),
                statistics.median(c["bytes"] for c in periodic),
                len(periodic),
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    (b0, n0, k0), (b1, n1, k1) = rows[False], rows[True]
    print(
        f"P6 elastic optimizer state{' (--quick)' if args.quick else ''}: {n_params / 1e6:.1f}M-parameter MLP, "
        f"ZeRO-2, fp32, AdamW, 1 rank, sync saves to local disk, {steps} steps"
    )
    print(f"{'save':<36} | {'saves':>5} | {'MB':>7} | {'blocked s (median)':>18} | {'vs plain':>8}")
    print("-" * 86)
    print(f"{'plain (DeepSpeed shards only)':<36} | {k0:>5} | {n0 / 1e6:>7.0f} | {b0:>18.3f} | {1.0:>7.2f}x")
    print(f"{'elastic (+ gathered full state)':<36} | {k1:>5} | {n1 / 1e6:>7.0f} | {b1:>18.3f} | {b1 / b0:>7.2f}x")
    print("bytes ratio elastic/plain: %.2fx (the gathered fp32 weights + two Adam moments)" % (n1 / n0))
    print()
    per_param = (n1 - n0) / n_params
    met = abs(per_param / BYTES_PER_PARAMETER - 1) <= TOLERANCE
    print(
        f"goal gathered_bytes_per_parameter: {per_param:.2f} vs {BYTES_PER_PARAMETER} "
        f"(+-{TOLERANCE:.0%}, weights and two moments in fp32): {'met' if met else 'not met'}"
    )


if __name__ == "__main__":
    main()
