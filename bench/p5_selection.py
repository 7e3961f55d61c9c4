"""P5 selection: time and files read to choose the state to resume from among many states.

What it measures
    For 10, 10^3 and 10^4 state directories on local storage (a temp dir), the wall time and the
    filesystem calls needed to pick the newest resumable state:

    * full discover (baseline: read everything first): ``syncpoint.workers.state.discovery.discover(storage, exp)``
      (one listing of ``states/``, then for EVERY state a recursive listing plus reads of
      ``manifest.json`` and ``trainer.json``, classification), then
      ``syncpoint.policies.resume.NewestResumable().choose(...)``. O(n) listings and O(n) file reads.
    * lazy newest-first (what ``syncpoint run`` does): ``syncpoint.workers.state.discovery.discover_lazy`` lists
      ``states/`` once without stat-ing entries, orders names newest first, and reads/classifies a
      candidate only when ``NewestResumable().choose`` walks to it; it stops at the first
      resumable one. O(1) manifests read when the newest states are healthy.

    Files read and listings are counted by swapping the ``RunStorage``'s filesystem for a
    counting ``LocalFileSystem`` subclass: every file opened for reading (``cat_file`` goes
    through ``_open``), ``manifest.json`` opens separately, and top-level ``ls``/``find`` calls.
    The script checks (and prints) that both approaches choose the same state.

    Planted layout per size: ``<root>/n<size>/run/states/<12-digit micro-step>/`` with a valid
    ``trainer.json`` (schema 1, steps every 100 micro-steps, grad_accum 4, 1000 micro-batches per
    epoch: all sync boundaries), a 64-byte ``engine/x.pt`` and a ``manifest.json`` in the state
    writer's format (files with size and sha256). The newest ``--torn-newest`` (default 1) states
    are torn (no manifest: a save interrupted by preemption), so both approaches must skip them.
    Timings are medians over repeats on a warm page cache (everything was just written).

Baseline: the project's full ``discover`` + ``NewestResumable``, measured in the same run.
Goal (issue P5): <= 1 s to choose at 10^4 states, manifests read O(1).

Command (from the repo root; about 1-2 minutes on 2 shared cores including planting ~11k state
directories; ``--quick`` stops at 10^3 states, ~10 s):

    cd /work/main && .venv/bin/python -m bench.p5_selection
    cd /work/main && .venv/bin/python -m bench.p5_selection --quick
    cd /work/main && .venv/bin/python -m bench.p5_selection --keep   # plant once in /tmp/syncpoint-bench-p5, reuse

No timed assertions: the script reports, it does not pass or fail on time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from syncpoint.policies.boundaries import position_after
from syncpoint.policies.candidates import Expectation
from syncpoint.policies.resume import Decision, NewestResumable
from syncpoint.workers.state.discovery import discover, discover_lazy
from syncpoint.workers.storage import RunStorage

EXP = Expectation(
    job_identity="bench-p5",
    world_size=2,
    micro_batch_size=4,
    grad_accum=4,
    micro_batches_per_epoch=1000,
    zero_stage=2,
    model_fingerprint="bench-fingerprint",
    seed=1234,
)
SAVE_EVERY = 100
PLANT_VERSION = 1


# ---------------------------------------------------------------- counting filesystem
class CountingFS(LocalFileSystem):
    """LocalFileSystem that counts reads and listings (nested calls inside a counted call are not recounted)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: Counter[str] = Counter()
        self._depth = 0

    @contextmanager
    def _outer(self, what: str):
        if self._depth == 0:
            self.counts[what] += 1
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any):
        if "r" in mode:
            self.counts["files read"] += 1
            if str(path).endswith("/manifest.json"):
                self.counts["manifests"] += 1
        return super()._open(path, mode, *args, **kwargs)

    def ls(self, path: str, detail: bool = False, **kwargs: Any):
        with self._outer("listings"):
            return super().ls(path, detail=detail, **kwargs)

    def find(self, path: str, *args: Any, **kwargs: Any):
        with self._outer("listings"):
            return super().find(path, *args, **kwargs)


def counting_storage(run_dir: str) -> RunStorage:
    storage = RunStorage(run_dir)
    storage.backend.fs = CountingFS(skip_instance_cache=True)  # the backend keeps its fsspec filesystem
    return storage


# ---------------------------------------------------------------- the two selectors
def full_discover(storage: RunStorage) -> tuple[Decision, int]:
    cands = discover(storage, EXP)
    return NewestResumable().choose(cands, {}), len(cands)


def lazy_newest_first(storage: RunStorage) -> tuple[Decision, int]:
    """The project's resume path: ``discover_lazy`` (one cheap listing of states/, candidates read
    newest first as the policy walks them) + ``NewestResumable``."""
    cands = discover_lazy(storage, EXP)
    decision = NewestResumable().choose(cands, {})
    return decision, len(cands.inspected())


# ---------------------------------------------------------------- planting
def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def plant(run_dir: str, n: int, torn_newest: int) -> float:
    t0 = time.perf_counter()
    states = os.path.join(run_dir, "states")
    engine = bytes(range(64))
    engine_sha = hashlib.sha256(engine).hexdigest()
    for i in range(n):
        step = (i + 1) * SAVE_EVERY
        p = position_after(step, EXP.grad_accum, EXP.micro_batches_per_epoch)
        name = f"{step:012d}"
        d = os.path.join(states, name)
        os.makedirs(os.path.join(d, "engine"))
        _write(os.path.join(d, "engine", "x.pt"), engine)
        if i >= n - torn_newest:
            continue  # torn: preempted before trainer.json / manifest.json
        trainer = {
            "schema_version": 1,
            "job_identity": EXP.job_identity,
            "world_size": EXP.world_size,
            "micro_batch_size": EXP.micro_batch_size,
            "grad_accum": EXP.grad_accum,
            "micro_batches_per_epoch": EXP.micro_batches_per_epoch,
            "zero_stage": EXP.zero_stage,
            "model_fingerprint": EXP.model_fingerprint,
            "seed": EXP.seed,
            "epoch": p.epoch,
            "position_in_epoch": p.position_in_epoch,
            "global_micro_step": step,
            "optimizer_step": p.optimizer_step,
            "metrics": {"loss": 1.0 / (i + 1)},
        }
        tb = _json_bytes(trainer)
        _write(os.path.join(d, "trainer.json"), tb)
        manifest = {
            "format": "syncpoint-state/1",
            "state": name,
            "created_at": 1.7e9 + i,
            "world_size": EXP.world_size,
            "files": {
                "engine/x.pt": {"size": len(engine), "sha256": engine_sha},
                "trainer.json": {"size": len(tb), "sha256": hashlib.sha256(tb).hexdigest()},
            },
        }
        _write(os.path.join(d, "manifest.json"), _json_bytes(manifest))
    return time.perf_counter() - t0


def ensure_planted(root: str, n: int, torn_newest: int) -> tuple[str, str]:
    base = os.path.join(root, f"n{n}")
    run_dir = os.path.join(base, "run")
    marker = os.path.join(base, "PLANTED")
    want = f"{PLANT_VERSION} {n} {torn_newest}"
    if os.path.exists(marker) and open(marker).read() == want:
        return run_dir, "reused"
    shutil.rmtree(base, ignore_errors=True)
    secs = plant(run_dir, n, torn_newest)
    _write(marker, want.encode())
    return run_dir, f"planted in {secs:.1f} s"


# ---------------------------------------------------------------- measuring
def measure(fn, run_dir: str, repeats: int) -> tuple[float, Counter, Decision, int]:
    times, counts, decision, read = [], Counter(), None, 0
    for _ in range(repeats):
        storage = counting_storage(run_dir)
        t0 = time.perf_counter()
        decision, read = fn(storage)
        times.append(time.perf_counter() - t0)
        counts = storage.backend.fs.counts
    return statistics.median(times), counts, decision, read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 1_000, 10_000])
    ap.add_argument("--torn-newest", type=int, default=1, help="newest states left torn (no manifest)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per cell (median); full discover at >=10^4 uses 3")
    ap.add_argument(
        "--root", default=None, help="where to plant (default: a temp dir, or /tmp/syncpoint-bench-p5 with --keep)"
    )
    ap.add_argument("--keep", action="store_true", help="keep planted states and reuse them on the next run")
    ap.add_argument("--quick", action="store_true", help="sizes 10 and 10^3 only, 3 repeats")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeats = [s for s in args.sizes if s <= 1_000], 3
    root = args.root or ("/tmp/syncpoint-bench-p5" if args.keep else tempfile.mkdtemp(prefix="syncpoint-p5-"))
    os.makedirs(root, exist_ok=True)

    rows, notes, checks = [], [], []
    try:
        for n in sorted(args.sizes):
            run_dir, how = ensure_planted(root, n, args.torn_newest)
            notes.append(f"  {n:>6} states: {how} ({run_dir})")
            full_reps = 3 if n >= 10_000 else args.repeats
            full_discover(RunStorage(run_dir)), lazy_newest_first(RunStorage(run_dir))  # warm-up
            t_full, c_full, d_full, n_full = measure(full_discover, run_dir, full_reps)
            t_lazy, c_lazy, d_lazy, n_lazy = measure(lazy_newest_first, run_dir, args.repeats)
            rows.append((n, t_full, c_full, t_lazy, c_lazy))
            same = d_full.state == d_lazy.state
            checks.append(
                f"  {n:>6} states: full -> {d_full.state} ({n_full} candidates read), lazy -> {d_lazy.state} "
                f"({n_lazy} candidates read): {'SAME' if same else 'DIFFERENT'}"
            )
    finally:
        if not args.keep and args.root is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"P5 selection: newest {args.torn_newest} state(s) torn, the rest resumable; local storage, warm page cache")
    print()
    hdr = (
        f"{'states':>7} | {'full discover (s)':>17} | {'files read':>10} | {'manifests':>9} | {'listings':>8} || "
        f"{'lazy newest-first (s)':>21} | {'files read':>10} | {'manifests':>9} | {'listings':>8} || {'ratio':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for n, t_full, c_full, t_lazy, c_lazy in rows:
        print(
            f"{n:>7,} | {t_full:>17.4f} | {c_full['files read']:>10,} | {c_full['manifests']:>9,} | "
            f"{c_full['listings']:>8,} || "
            f"{t_lazy:>21.4f} | {c_lazy['files read']:>10,} | {c_lazy['manifests']:>9,} | "
            f"{c_lazy['listings']:>8,} || "
            f"{t_full / t_lazy:>7,.0f}x"
        )
    print()
    print("ratio = full discover time / lazy newest-first time (medians, same run, same planted directory).")
    print(
        "files read = files opened for reading (manifest.json + trainer.json); listings = top-level ls/find calls "
        "(discover lists every state recursively to check sizes)."
    )
    print("Goal (issue P5): <= 1 s to choose at 10^4 states, manifests read O(1).")
    print()
    print("same decision check:")
    for line in checks:
        print(line)
    print("planting:")
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
