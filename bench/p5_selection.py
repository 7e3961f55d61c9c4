"""P5 selection: time and files read to choose the state to resume from among many states.

What it measures
    For 10, 10^3 and 10^4 state directories on local storage (a temp dir), the wall time and the
    filesystem calls needed to pick the newest resumable state:

    * full discover (baseline: read everything first): ``syncpoint.workers.state.discovery.discover(storage, exp)``
      (one listing of ``states/``, then for EVERY state a recursive listing plus reads of
      ``manifest.json`` and ``trainer.json``, classification), then
      ``syncpoint.policies.decisions.resume.NewestResumable().choose(...)``. O(n) listings and O(n) file reads.
    * lazy newest-first (what ``syncpoint run`` does): ``syncpoint.workers.state.discovery.discover_lazy`` lists
      ``states/`` once without stat-ing entries, orders names newest first, and reads/classifies a
      candidate only when ``NewestResumable().choose`` walks to it; it stops at the first
      resumable one. O(1) manifests read when the newest states are healthy.

    Files read and listings are counted by wrapping the ``RunStorage``'s backend, through which
    every read goes: each file read (``manifest.json`` reads separately) and each listing call.
    The script checks (and prints) that both approaches choose the same state.

    Planted layout per size: ``<root>/n<size>/run/states/<12-digit micro-step>/`` with a valid
    ``trainer.json`` (steps every 100 micro-steps, grad_accum 4, 1000 micro-batches per epoch: all
    sync boundaries; built from ``syncpoint.policies.contracts.state_format``'s models, so it is today's
    format), every other file its layout requires (2 ranks, ZeRO-2: the model file, the optimizer
    shards and RNG files; 64 bytes each) and a ``manifest.json`` listing them with size and
    xxh3_128. The newest ``--torn-newest`` (default 1) states are torn (no manifest: a save
    interrupted by preemption), so both approaches must skip them. Timings are medians over
    repeats on a warm page cache (everything was just written).

Baseline: the project's full ``discover`` + ``NewestResumable``, measured in the same run.
Goal (issue P5): <= 1 s to choose at 10^4 states, manifests read O(1). The goal lines name the
largest size run (10^3 with ``--quick``); O(1): the lazy path reads no more manifests at the
largest size than at the smallest; and both approaches choose the same state.

Command (from the repo root; about 1-2 minutes on 2 shared cores including planting ~11k state
directories; ``--quick`` stops at 10^3 states, ~10 s):

    cd /work/main && .venv/bin/python -m bench.p5_selection
    cd /work/main && .venv/bin/python -m bench.p5_selection --quick
    cd /work/main && .venv/bin/python -m bench.p5_selection --keep   # plant once in /tmp/syncpoint-bench-p5, reuse

No timed assertions: the script reports, it does not pass or fail on time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

from syncpoint.policies.contracts.state_format import (
    MANIFEST_FILE,
    STATES_DIR,
    TRAINER_FILE,
    TRAINER_SCHEMA_VERSION,
    DataRecord,
    Manifest,
    ManifestEntry,
    TrainState,
    json_bytes,
    local_path,
    state_name,
)
from syncpoint.policies.contracts.state_identity import SAMPLER_VERSION, DataIdentity, StateIdentity
from syncpoint.policies.decisions.boundaries import position_after
from syncpoint.policies.decisions.candidates import LiveJob
from syncpoint.policies.decisions.resume import Decision, NewestResumable
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.state.discovery import discover, discover_lazy
from syncpoint.workers.storage import RunStorage

EXP = LiveJob(
    StateIdentity(
        job_identity="bench-p5",
        world_size=2,
        micro_batch_size=4,
        grad_accum=4,
        micro_batches_per_epoch=1000,
        zero_stage=2,
        model_fingerprint="bench-fingerprint",
        seed=1234,
        elastic=False,
        data=DataIdentity(
            sampler=SAMPLER_VERSION,
            global_batch=4 * 4 * 2,  # grad_accum x micro_batch_size x world_size
            samples_per_epoch=1000 * 4 * 2,  # micro_batches_per_epoch x micro_batch_size x world_size
        ),
    )
)
SAVE_EVERY = 100
PLANT_VERSION = 2  # raise it when the planted layout changes: --keep reuses a directory of the same version
CHECKSUM = "xxh3_128"  # checkpoint.checksum's default
GOAL_S = 1.0  # seconds to choose (issue P5)
PLACEHOLDER = bytes(range(64))  # the bytes of every file but trainer.json (selection reads none of them)


# ---------------------------------------------------------------- counting storage
class CountingBackend:
    """The run storage's backend, counting the reads and listings selection asks of it: every read
    goes through the backend (local reads never through fsspec: they open without following links),
    so this is where a count cannot miss one. The backend's own calls to itself are not recounted."""

    READS = ("read_bytes", "read_versioned")
    LISTINGS = ("list_dirs", "list_names", "list_files", "listing", "entry_kinds")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.READS + self.LISTINGS:
            return attr

        def counted(path: str, *args: Any, **kwargs: Any) -> Any:
            if name in self.READS:
                self.counts["files read"] += 1
                self.counts["manifests"] += str(path).endswith(f"/{MANIFEST_FILE}")
            else:
                self.counts["listings"] += 1
            return attr(path, *args, **kwargs)

        return counted


def counting_storage(run_dir: str) -> RunStorage:
    storage = RunStorage(run_dir)
    storage.backend = CountingBackend(storage.backend)
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
def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def trainer_record(step: int, loss: float) -> TrainState:
    """A boundary state's ``trainer.json`` at ``step``, built from the state format's own models and
    the identity selection compares (``StateIdentity``), as the loop writes it: a field the format
    adds or retypes reaches the bench here, instead of every planted state reading as corrupt."""
    job = EXP.identity
    p = position_after(step, job.grad_accum, job.micro_batches_per_epoch)
    per_micro = job.micro_batch_size * job.world_size
    return TrainState(
        schema_version=TRAINER_SCHEMA_VERSION,
        job_name="bench-p5",
        **{k: v for k, v in job if k != "data"},
        epoch=p.epoch,
        position_in_epoch=p.position_in_epoch,
        global_micro_step=step,
        optimizer_step=p.optimizer_step,
        data=DataRecord(
            **dict(job.data),
            global_samples=p.epoch * job.data.samples_per_epoch + p.position_in_epoch * per_micro,
            samples_in_epoch=p.position_in_epoch * per_micro,
        ),
        elastic_optimizer=job.zero_stage == 0,
        metrics={"loss": loss},
        save_reasons=["interval"],
    )


def plant_state(states: str, i: int, torn: bool) -> None:
    """One state directory: every file its layout requires (``TrainState.required_files``; 64 bytes
    each but ``trainer.json``), then, unless ``torn``, the manifest listing them with size and checksum."""
    step = (i + 1) * SAVE_EVERY
    name = state_name(step)
    trainer = trainer_record(step, 1.0 / (i + 1))
    trainer_bytes = json_bytes(trainer.record())
    entries: dict[str, dict[str, Any]] = {}
    for rel in trainer.required_files():
        if rel == TRAINER_FILE and torn:
            continue  # torn: preempted before trainer.json / manifest.json
        data = trainer_bytes if rel == TRAINER_FILE else PLACEHOLDER
        _write(local_path(os.path.join(states, name), rel), data)
        entries[rel] = ManifestEntry.of(len(data), CHECKSUM, checksum_bytes(data, CHECKSUM)).record()
    if torn:
        return
    manifest = Manifest.model_validate(
        {
            "state": name,
            "created_at": 1.7e9 + i,
            "world_size": EXP.identity.world_size,
            "checksum": CHECKSUM,
            "files": entries,
        }
    )
    _write(os.path.join(states, name, MANIFEST_FILE), json_bytes(manifest.record()))


def plant(run_dir: str, n: int, torn_newest: int) -> float:
    t0 = time.perf_counter()
    states = os.path.join(run_dir, STATES_DIR)
    for i in range(n):
        plant_state(states, i, torn=i >= n - torn_newest)
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
    times, decision, read = [], None, 0
    counts: Counter[str] = Counter()
    for _ in range(repeats):
        storage = counting_storage(run_dir)
        t0 = time.perf_counter()
        decision, read = fn(storage)
        times.append(time.perf_counter() - t0)
        assert isinstance(storage.backend, CountingBackend)
        counts = storage.backend.counts
    assert decision is not None, "repeats >= 1"
    return statistics.median(times), counts, decision, read


def parser() -> argparse.ArgumentParser:
    """The command line (``tests/integration/test_bench_contract.py`` checks every bench's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 1_000, 10_000])
    ap.add_argument("--torn-newest", type=int, default=1, help="newest states left torn (no manifest)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per cell (median); full discover at >=10^4 uses 3")
    ap.add_argument(
        "--root", default=None, help="where to plant (default: a temp dir, or /tmp/syncpoint-bench-p5 with --keep)"
    )
    ap.add_argument("--keep", action="store_true", help="keep planted states and reuse them on the next run")
    ap.add_argument("--quick", action="store_true", help="sizes 10 and 10^3 only, 3 repeats")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.quick:
        args.sizes, args.repeats = [s for s in args.sizes if s <= 1_000], 3
    root = args.root or ("/tmp/syncpoint-bench-p5" if args.keep else tempfile.mkdtemp(prefix="syncpoint-p5-"))
    os.makedirs(root, exist_ok=True)

    rows, notes, checks = [], [], []
    same_everywhere = True
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
            same_everywhere = same_everywhere and same
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
        "files read = files read from the storage (manifest.json + trainer.json); listings = listing calls "
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
    print()
    for line in goals(rows, same_everywhere):
        print(line)


def goals(rows: list[tuple[int, float, Counter, float, Counter]], same: bool) -> list[str]:
    """``goal <name>: <measured> vs <target>: met|not met``, at the largest size run."""
    n, _, _, t_lazy, c_lazy = rows[-1]
    first_manifests, manifests = rows[0][4]["manifests"], c_lazy["manifests"]
    met = {True: "met", False: "not met"}
    return [
        f"goal choose_at_{n}_states: {t_lazy:.4f} s vs <= {GOAL_S:g} s: {met[t_lazy <= GOAL_S]}",
        f"goal manifests_read_at_{n}_states: {manifests} vs <= {first_manifests} (as at {rows[0][0]} states): "
        f"{met[manifests <= first_manifests]}",
        f"goal same_decision: {'yes' if same else 'no'} vs yes: {met[same]}",
    ]


if __name__ == "__main__":
    main()
