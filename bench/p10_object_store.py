"""P10 object store: save and restore bandwidth of a gigabyte state on S3, against raw s3fs transfers.

What it measures
    A local S3-protocol server (moto's, the one the tests use, on 127.0.0.1), started in its own
    process here (in the tests it shares the test's process; here it must not share a GIL with the
    client whose bandwidth is measured). Two ranks (spawned processes, gloo, ``syncpoint.workers.supervision.launch.
    run_spawned``), DeepSpeed ZeRO stage 2, fp32, AdamW, on CPU. The task is P2's MLP
    (``bench.p2_save_cost:build``): width 4096, depth 6 (~109M parameters, a state of ~1.75 GB:
    the module weights plus each rank's fp32 master partition and two Adam moments); ``--quick``:
    width 1536, depth 4 (~12.5M parameters, ~200 MB). Runs, all in this process's child ranks:

    * save: a run on ``s3://`` trains 2 optimizer steps and commits its final state with a
      synchronous save (each rank streams its shards into S3 as parallel multipart uploads through
      ``syncpoint.workers.storage.s3_backend.ParallelPartWriter``). Save seconds = the ``state_committed`` event's
      ``seconds`` (boundary to commit), bytes = its ``bytes``.
    * restore: a second submission of the same job (``max_steps`` 3) selects that state, fetches it
      (S3: parallel ranged GETs, s3fs ``get_file``, into a private temp dir; local: verified and
      loaded in place, no copy, ``syncpoint.workers.integrity.verified_files``; each rank loads the model file and its
      own ZeRO shard, and the model file is downloaded or read once for both ranks of the node,
      ``syncpoint.workers.state.node_share``), verifies, loads, and trains step 3. **Compared with the raw transfer:
      selection -> state loaded** (the ``resume_decision`` event to ``attempt_started``: fetch,
      verify, load; the engine and DeepSpeed were built before selection, so no fixed start-up cost
      is in it). Also printed, not compared: the issue's whole span, selection -> first resumed
      step, raw and less a fresh start's first step (the save run's ``attempt_started`` to its
      step 1), which adds a step's compute and its noise (seconds on a loaded machine) to a load of
      tenths of a second.
    * where the time goes: both runs' ranks are ``syncpoint.workers.supervision.launch``'s own child processes with the
      reader's, checkpoint engine's and S3 writer's functions wrapped in timers (instrumentation
      only, ``SECTIONS``); the per-rank seconds are printed under the table, so a goal that is not
      met shows what bounds it.
    * raw baselines, same client library (s3fs), same part size and concurrency (s3fs's
      ``default_block_size`` / ``max_concurrency``), same bytes, one process: ``fs.get`` of every
      file of the committed state to local disk (parallel ranged reads; printed, not compared: the
      restore read those objects already), ``fs.put`` of those files to another prefix (parallel
      multipart uploads: the upload baseline), and, once that upload settled as the state did
      before its restore, ``fs.get`` of it: the download baseline, objects never read before, as
      the restore's were (``raw_s3`` says why that matters on moto and this VM).
    * local disk: the same two runs on a local directory (/tmp), restore timed the same way,
      against a raw sequential read (8 MiB reads) of the state's files plus the xxh3_128 of every
      byte (the manifest's checksum: the verification every restore must do, so the baseline does
      the same work on the same bytes; best of 3, ``--quick`` 1, interleaved with a read alone, also printed).
      All of them read cold: a save writes with O_DIRECT (the state is not in the page cache when
      a restore reads it), and each raw read is the first read of a fresh copy of the state's
      files, written the same way (``fresh_copy``: this VM's host caches a file once it was read,
      below the guest's page cache, so re-reading the restored files would be a warm baseline;
      that re-read is printed too, not compared).

Goals (issue 20, part 2, and issue 32 §2): save and restore bandwidth >= 0.8x the raw parallel
upload/download; restore from local disk >= 0.8x a raw sequential read with the same checksum;
restore of an S3 run from this node's memory copy (``checkpoint.memory_copy``, the default on S3)
>= 5x faster than its restore from S3 (a third pair of runs: the first crashes right after its
save commits, as a crashed training process on a surviving node would, so the copy is still there).

Memory: moto keeps objects in memory up to ~5 MB each and spills larger ones to temp files; the raw
upload's copy is deleted before the restore run. Run the full size once, on a quiet machine.

Command (from the repo root; ``--quick`` ~4 min on 2 shared cores, the full size ~15 min):

    cd /work/main && .venv/bin/python -m bench.p10_object_store --quick
    cd /work/main && .venv/bin/python -m bench.p10_object_store

No timed assertions: the script reports, it does not pass or fail on time.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

BUCKET = "p10-bench"
KEY = SECRET = "testing"
GOAL = 0.8
MEMORY_GOAL = 5.0  # issue 32: restore from memory >= 5x faster than from the object store


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process on loopback; this process and spawned ranks point s3fs at it."""
    import fsspec

    from syncpoint.workers.supervision.free_ports import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
        "FSSPEC_S3_KEY": KEY,
        "FSSPEC_S3_SECRET": SECRET,
    }
    os.environ.update(env)
    fsspec.config.conf["s3"] = {
        **fsspec.config.conf.get("s3", {}),
        "client_kwargs": {"endpoint_url": endpoint},
        "key": KEY,
        "secret": SECRET,
    }
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY, aws_secret_access_key=SECRET
    ).create_bucket(Bucket=BUCKET)
    return proc, endpoint


def _spec(storage: str, width: int, depth: int, max_steps: int, *extra: str):
    from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage

    text = f"""
name: p10
task: {{path: "bench.p2_save_cost:build", config: {{width: {width}, depth: {depth}, num_samples: 100000}}}}
scaling: {{num_workers: 2, cpus_per_worker: 1}}
train: {{micro_batch_size: 8, grad_accum: 1, max_steps: {max_steps}, seed: 1, lr: 1.0e-4, log_every: 1000000}}
deepspeed: {{zero_stage: 2, precision: fp32}}
checkpoint: {{keep_last: 0, export_final: false, save_every: {{value: 1000, unit: optimizer_steps}}}}
"""
    return resolve_storage(parse_spec(text, "bench/p10", [f"storage={storage}", *extra]))


def _events(spec) -> list[dict[str, Any]]:
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    return EventLog(RunStorage(spec.run_url)).read_all()


# Where the time goes, per rank: each wrapped function's calls and wall seconds (nested sections
# overlap: "load into engine" contains "DeepSpeed reads files"). (module, attribute, section name)
SECTIONS = [
    ("syncpoint.workers.state.resume_negotiation", "fetch_state", "fetch: read/download + checksum + check"),
    ("syncpoint.workers.state.downloads", "download_verified", "  copy to a temp dir + checksum"),
    ("syncpoint.workers.state.downloads.SplitDownload", "head", "  download the head of the file it checksums"),
    ("syncpoint.workers.state.downloads.SplitDownload", "piece", "  download a range for the node's other rank"),
    ("syncpoint.workers.state.node_share.NodePeers", "hand_over", "  hand ranges over / wait for the other rank"),
    ("syncpoint.workers.state.downloads.SplitDownload", "join", "  complete from the other's range + checksum"),
    ("syncpoint.workers.integrity.verified_files", "read_ahead", "  read ahead for the node's other rank"),
    ("syncpoint.workers.state.reader", "open_verified", "  open in place + checksum (one read)"),
    ("syncpoint.workers.state.downloads", "_link_offered", "  linked from the rank of this node that downloaded it"),
    ("syncpoint.workers.state.node_share.NodePeers", "share", "  hand over to / wait for the node's other rank"),
    ("syncpoint.workers.state.reader", "check_state_file", "  weights-only check (mmap)"),
    ("syncpoint.workers.state.resume_negotiation", "load_into_engine", "load into engine (DeepSpeed)"),
    (
        "syncpoint.workers.state.checkpoint_engine.StreamingCheckpointEngine",
        "load",
        "  DeepSpeed reads files (torch.load, or takes its preload)",
    ),
    ("syncpoint.workers.state.preload", "load_state_file", "preload: unpickled on a second thread, beside the above"),
    ("syncpoint.workers.state.reader.FetchedState", "unchanged", "  unchanged since verified (fstat)"),
    ("syncpoint.workers.state.resume_negotiation", "_first_refusal", "agreement collectives (wait for the other rank)"),
    ("syncpoint.workers.state.reader.FetchedState", "cleanup", "cleanup (temp dir / descriptors)"),
    (
        "syncpoint.workers.state.checkpoint_engine.StreamingCheckpointEngine",
        "save",
        "save: torch.save of a shard into storage",
    ),
    ("syncpoint.workers.integrity.checksum.ChecksummingWriter", "write", "  checksum + hand to the writer"),
    (
        "syncpoint.workers.storage.s3_backend.ParallelPartWriter",
        "write",
        "    copy into parts (+ wait for a free slot)",
    ),
    ("syncpoint.workers.storage.s3_backend.ParallelPartWriter", "_collect_oldest", "      wait for a part in flight"),
    ("syncpoint.workers.storage.s3_backend.ParallelPartWriter", "close", "  close: last part + complete upload"),
]


def _instrument(times: dict[str, list[float]]) -> None:
    """Wrap each section's function (instrumentation only: the project's code runs unchanged)."""
    import functools
    import importlib

    for where, attr, name in SECTIONS:
        parts = where.split(".")
        owner: Any = None
        for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                owner = importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                continue
            for rest in parts[i:]:
                owner = getattr(owner, rest)
            break
        original = getattr(owner, attr)
        record = times.setdefault(name, [0, 0.0])

        def timed(*a: Any, _f: Any = original, _r: list = record, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                _r[0] += 1
                _r[1] += time.perf_counter() - t0

        setattr(owner, attr, functools.wraps(original)(timed))


def _profiled_child(out: str, *args: Any) -> None:
    """``syncpoint.workers.supervision.rank_process.rank_main`` with the sections timed; each rank writes them
    to ``out``."""
    import json

    import syncpoint.workers.training.loop
    from syncpoint.workers.supervision import rank_process

    times: dict[str, list[float]] = {}
    _instrument(times)
    run_worker = syncpoint.workers.training.loop.run_worker

    def run_and_dump(*a: Any, **k: Any) -> Any:
        try:
            return run_worker(*a, **k)
        finally:
            with open(os.path.join(out, f"rank{args[1]}.json"), "w") as f:
                json.dump(times, f)

    syncpoint.workers.training.loop.run_worker = run_and_dump
    rank_process.rank_main(*args)


def _run(spec, crashes: bool = False) -> list[dict[str, list[float]]]:
    """``syncpoint.workers.supervision.launch.run_spawned`` (2 ranks), each rank's sections timed; returns them per
    rank."""
    import json
    import uuid

    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.storage.lease import release_lease
    from syncpoint.workers.supervision import launch
    from syncpoint.workers.supervision.free_ports import free_port
    from syncpoint.workers.training import rng

    out = tempfile.mkdtemp(prefix="p10-profile-")
    port, submission = free_port(), uuid.uuid4().hex
    hash_seed = str(rng.hash_seed(spec.train.seed))  # as run_spawned starts its ranks
    ctx = launch._context(launch._start_method(spec), hash_seed)
    environ = {**os.environ, "PYTHONHASHSEED": hash_seed}
    procs = [
        ctx.Process(target=_profiled_child, args=(out, spec.model_dump_json(), r, 2, port, True, submission, environ))
        for r in range(2)
    ]
    with launch._environ(PYTHONHASHSEED=hash_seed):
        for p in procs:
            p.start()
    for p in procs:
        p.join(timeout=3600)
    release_lease(RunStorage(spec.run_url), submission)
    codes = [p.exitcode for p in procs]
    if any(codes) != crashes:
        raise RuntimeError(f"ranks exited with {codes}{' (a planned crash was expected)' if crashes else ''}")
    if crashes:
        return []
    profiles = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            profiles.append(json.load(f))
    shutil.rmtree(out, ignore_errors=True)
    return profiles


SAVE_SECTIONS = next(
    i for i, (_, _, name) in enumerate(SECTIONS) if name.startswith("save:")
)  # the rest are the save's


def print_profile(title: str, profiles: list[dict[str, list[float]]], save: bool) -> None:
    """The restore's (or the save's) sections that were entered, per rank: calls and seconds."""
    chosen = SECTIONS[SAVE_SECTIONS:] if save else SECTIONS[:SAVE_SECTIONS]
    names = [name for _, _, name in chosen if any(p.get(name, [0])[0] for p in profiles)]
    print(f"\n{title}")
    print(
        f"{'section (nested ones are part of the line above)':60s} "
        + " ".join(f"{'rank ' + str(r):>16s}" for r in range(len(profiles)))
    )
    for name in names:
        cells = [p.get(name, [0, 0.0]) for p in profiles]
        print(f"{name:60s} " + " ".join(f"{int(c):4d}x {s:8.3f} s" for c, s in cells))


def _step_times(events: list[dict[str, Any]]) -> dict[int, float]:
    return {r["optimizer_step"]: r["time"] for e in events if e["kind"] == "progress" for r in e["records"]}


def save_and_restore(storage: str, width: int, depth: int, crash_after_save: bool = False) -> dict[str, Any]:
    """Run 1 (2 steps, one sync save at the end), run 2 (resume, 1 step): the save's and restore's seconds.
    ``crash_after_save``: run 1's ranks crash right after that save commits (before the run finishes,
    which would remove the node's memory copy), so run 2 restores from this node's memory copy."""
    crash = (
        ("faults=[{at_micro_step: 2, mode: raise}, {rank: 1, at_micro_step: 2, mode: raise}]",)
        if crash_after_save
        else ()
    )
    first = _spec(storage, width, depth, 2, *crash)
    save_profile = _run(first, crashes=crash_after_save)
    events = _events(first)
    committed = [e for e in events if e["kind"] == "state_committed"]
    started = [e for e in events if e["kind"] == "attempt_started"][-1]
    first_step_s = _step_times(events)[1] - started["time"]  # a fresh start's first step, warm-up included
    second = _spec(storage, width, depth, 3)
    settle_disk()  # the restore reads settled bytes, as the raw transfer it is compared with does
    if "://" not in storage:
        from syncpoint.workers.storage import RunStorage

        drop_page_cache(RunStorage(first.run_url).local_path("states") or "")
    restore_profile = _run(second)
    events = _events(second)
    decision = [e for e in events if e["kind"] == "resume_decision"][-1]
    assert decision["chosen"] == committed[-1]["state"], decision
    loaded = [e for e in events if e["kind"] == "attempt_started"][-1]
    to_first_step = _step_times(events)[3] - decision["time"]
    return {
        "spec": first,
        "state": committed[-1]["state"],
        "bytes": committed[-1]["bytes"],
        "save_s": committed[-1]["seconds"],
        "blocked_s": committed[-1]["blocked_seconds"],
        "step_s": first_step_s,
        "load_s": loaded["time"] - decision["time"],
        "to_first_step_s": to_first_step,
        "restore_s": to_first_step - first_step_s,  # <= 0: the restore was shorter than a fresh first step
        "save_profile": save_profile,
        "restore_profile": restore_profile,
    }


def raw_s3(state_url: str, workdir: str) -> tuple[float, float, float, int]:
    """(download s, upload s, download of objects read before s, bytes): s3fs ``get`` and ``put`` of
    every file of the state, without botocore's response CRC (as syncpoint's verified downloads
    read: the fastest raw download).

    The compared download reads objects nobody has read yet, as the restore did: the state's own
    objects are fetched first (the warm download, printed, not compared), uploaded again by the
    timed ``put``, settled as the state was (``settle_disk``), and that fresh upload is downloaded.
    Why: moto keeps a large object in a temp file and reads all of it for every ranged GET, and on
    this VM a file's first read comes from the disk and later ones from the host's cache
    (``fresh_copy``); a download after the restore would read what the restore already warmed."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(state_url)
    options = {**fs.storage_options, "config_kwargs": {"response_checksum_validation": "when_required"}}
    fs = type(fs)(**options, skip_instance_cache=True)
    fs.invalidate_cache()
    found = fs.find(root, detail=True)
    rpaths = sorted(found)
    size = sum(int(found[p]["size"]) for p in rpaths)
    lpaths = [os.path.join(workdir, p[len(root) :].lstrip("/")) for p in rpaths]
    for lp in lpaths:
        os.makedirs(os.path.dirname(lp), exist_ok=True)
    kw = {"chunksize": fs.default_block_size, "max_concurrency": fs.max_concurrency}
    t0 = time.perf_counter()
    fs.get(rpaths, lpaths, **kw)
    warm = time.perf_counter() - t0
    dest = f"{BUCKET}/raw-upload"
    uploaded = [f"{dest}/{i}" for i in range(len(lpaths))]
    t0 = time.perf_counter()
    fs.put(lpaths, uploaded, **kw)
    up = time.perf_counter() - t0
    shutil.rmtree(workdir, ignore_errors=True)
    for lp in lpaths:
        os.makedirs(os.path.dirname(lp), exist_ok=True)
    settle_disk()
    t0 = time.perf_counter()
    fs.get(uploaded, lpaths, **kw)
    down = time.perf_counter() - t0
    fs.rm(dest, recursive=True)
    shutil.rmtree(workdir, ignore_errors=True)
    return down, up, warm, size


SETTLE_S = 15.0


def settle_disk() -> None:
    """``sync``, then wait ``SETTLE_S``. Why: a save writes with O_DIRECT and fsyncs, yet the
    virtual disk keeps flushing it below the guest for seconds; measured here, two 0.87 GB files
    read and hashed right after such a write took 2.9 s, and 1.2-1.8 s later on. The raw reads it
    is compared with come minutes after the save, so the restore waits for the same quiet disk."""
    os.sync()
    time.sleep(SETTLE_S)


def drop_page_cache(directory: str) -> None:
    """Evict every file below ``directory`` from the page cache (``posix_fadvise(DONTNEED)``: clean
    pages only, no privileges needed). Why: a save writes with O_DIRECT, so a restore reads from the
    disk; a raw read right after it would find the pages the restore brought in, and compare a cold
    read with a warm one."""
    for d, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fresh_copy(src: str, dst: str) -> str:
    """A copy of every file below ``src``, written the way a save writes (O_DIRECT, then fsync),
    then settled (``settle_disk``). Why: on this VM a file's first read after it was written comes
    from the disk (0.33 GB/s, measured), and every later read from the host's cache (1.4-1.8 GB/s),
    which ``posix_fadvise`` in the guest does not evict; the restore reads its state for the first
    time, so the baseline must read bytes it has never read either."""
    from syncpoint.workers.storage.direct_io import DirectFileWriter

    for d, _, files in os.walk(src):
        out = os.path.join(dst, os.path.relpath(d, src))
        os.makedirs(out, exist_ok=True)
        for f in files:
            with open(os.path.join(d, f), "rb", buffering=0) as source, DirectFileWriter(os.path.join(out, f)) as w:
                w.fill_from(source)
    settle_disk()
    return dst


def raw_read(directory: str, checksum: bool = False) -> tuple[float, int]:
    """A sequential read (8 MiB reads) of every file below a directory: (seconds, bytes). With
    ``checksum``: each file also hashed as it is read, with the manifest's algorithm (xxh3_128),
    the verification every restore must do, so the baseline does the same work on the same bytes."""
    from syncpoint.workers.integrity.checksum import DEFAULT, new_hasher

    drop_page_cache(directory)
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs)
    size, t0 = 0, time.perf_counter()
    for p in paths:
        h = new_hasher(DEFAULT) if checksum else None
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                size += len(chunk)
                if h is not None:
                    h.update(chunk)
        if h is not None:
            h.hexdigest()
    return time.perf_counter() - t0, size


def parser() -> argparse.ArgumentParser:
    """The command line (``tests/integration/test_bench_contract.py`` checks every bench's)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="~200 MB state instead of ~1.75 GB; one raw local read of each kind, not three",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    width, depth = (1536, 4) if args.quick else (4096, 6)
    from bench.p2_save_cost import param_count

    n = param_count({"width": width, "depth": depth})
    print(
        f"P10 object store: ZeRO-2, 2 ranks, fp32 MLP width {width} depth {depth} ({n / 1e6:.1f}M parameters, "
        f"~{16 * n / 1e9:.2f} GB state)",
        flush=True,
    )
    server, endpoint = start_moto()
    work = tempfile.mkdtemp(prefix="p10-")
    try:
        import fsspec

        fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}/x")
        print(
            f"moto server {endpoint} (own process); s3fs part size {fs.default_block_size >> 20} MiB, "
            f"max_concurrency {fs.max_concurrency}",
            flush=True,
        )
        s3 = save_and_restore(f"s3://{BUCKET}/runs", width, depth)
        down, up, warm_down, size = raw_s3(f"{s3['spec'].run_url}/states/{s3['state']}", os.path.join(work, "raw"))
        memory = save_and_restore(f"s3://{BUCKET}/runs-memory", width, depth, crash_after_save=True)
        local = save_and_restore(os.path.join(work, "local"), width, depth)
        from syncpoint.workers.storage import RunStorage

        local_dir = RunStorage(local["spec"].run_url).local_path("states", local["state"])
        assert local_dir is not None
        reads = []
        for i in range(1 if args.quick else 3):  # interleaved; each the first read of a fresh copy (``fresh_copy``)
            pair = []
            for checksum in (False, True):
                copy = fresh_copy(local_dir, os.path.join(work, f"copy-{i}-{checksum}"))
                pair.append(raw_read(copy, checksum=checksum))
                shutil.rmtree(copy, ignore_errors=True)
            reads.append(pair)
        read_s, read_bytes = min(r[0] for r in reads)
        verified_s, _ = min(r[1] for r in reads)
        reread_s, _ = raw_read(local_dir, checksum=True)  # the restore's own files, read once already
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)

    def mbps(b: int, s: float) -> float:
        return b / s / 1e6

    def span_ratio(run: dict[str, Any], raw_bytes: int, raw_s: float) -> str:
        if run["restore_s"] <= 0:
            return "n/a (shorter than a fresh first step)"
        return f"{mbps(run['bytes'], run['restore_s']) / mbps(raw_bytes, raw_s):.2f}x"

    rows = [
        ("S3 save (boundary -> commit)", s3["bytes"], s3["save_s"]),
        ("raw s3fs parallel upload (put)", size, up),
        ("S3 restore: selection -> state loaded (fetch, verify, load)", s3["bytes"], s3["load_s"]),
        ("  whole span: selection -> first step, less a first step", s3["bytes"], s3["restore_s"]),
        ("  whole span: selection -> first step, unadjusted", s3["bytes"], s3["to_first_step_s"]),
        ("raw s3fs parallel download (get; objects never read before)", size, down),
        ("  the same, of the state's objects (read before: host-cached)", size, warm_down),
        ("S3 run, restore from this node's memory copy: selection -> loaded", memory["bytes"], memory["load_s"]),
        ("  whole span: selection -> first step, less a first step", memory["bytes"], memory["restore_s"]),
        ("local restore: selection -> state loaded (read, verify, load)", local["bytes"], local["load_s"]),
        ("  whole span: selection -> first step, less a first step", local["bytes"], local["restore_s"]),
        ("  whole span: selection -> first step, unadjusted", local["bytes"], local["to_first_step_s"]),
        ("raw sequential read (8 MiB reads, first read of a fresh copy)", read_bytes, read_s),
        ("raw sequential read + xxh3_128 of every byte (the baseline)", read_bytes, verified_s),
        ("  the same, of the restored state's files (read before: host-cached)", read_bytes, reread_s),
    ]
    print(f"\n{'what':62s} {'bytes':>14s} {'seconds':>9s} {'MB/s':>8s}")
    for name, b, s in rows:
        if s <= 0:  # a difference of two noisy spans, the restore's part lost in a first step's noise
            print(f"{name:62s} {b:14,d} {'n/a':>9s} {'n/a':>8s}  (the span was shorter than a fresh first step)")
            continue
        print(f"{name:62s} {b:14,d} {s:9.2f} {mbps(b, s):8.0f}")
    print(
        f"a fresh start's first step (subtracted): S3 run {s3['step_s']:.2f} s, local run {local['step_s']:.2f} s; "
        f"S3 save blocked the loop {s3['blocked_s']:.2f} s"
    )
    save_ratio = mbps(s3["bytes"], s3["save_s"]) / mbps(size, up)
    restore_ratio = mbps(s3["bytes"], s3["load_s"]) / mbps(size, down)
    local_ratio = mbps(local["bytes"], local["load_s"]) / mbps(read_bytes, verified_s)
    local_unverified_ratio = mbps(local["bytes"], local["load_s"]) / mbps(read_bytes, read_s)
    print(
        "restore goals compare 'selection -> state loaded' (the restore's reads and loads; the engine was built "
        "before selection) with the raw transfer; whole span (the issue's selection -> first resumed step, less "
        f"a fresh first step): S3 {span_ratio(s3, size, down)} the raw download, "
        f"local {span_ratio(local, read_bytes, verified_s)} the raw read + "
        f"checksum; local restore vs the raw read alone (no verification, the old baseline): "
        f"{local_unverified_ratio:.2f}x"
    )
    print_profile("S3 save, where the time goes (the save run; seconds summed over calls)", s3["save_profile"], True)
    print_profile("S3 restore, where the time goes", s3["restore_profile"], False)
    print_profile("local restore, where the time goes", local["restore_profile"], False)
    print_profile("S3 run, restore from the memory copy, where the time goes", memory["restore_profile"], False)
    print()
    memory_ratio = s3["load_s"] / memory["load_s"]
    print(
        f"goal memory_restore_vs_s3_restore: {memory_ratio:.2f}x vs >= {MEMORY_GOAL:.2f}x: "
        f"{'met' if memory_ratio >= MEMORY_GOAL else 'not met'}"
    )
    for name, ratio in (
        ("s3_save_vs_raw_upload", save_ratio),
        ("s3_restore_vs_raw_download", restore_ratio),
        ("local_restore_vs_raw_read_and_checksum", local_ratio),
    ):
        print(f"goal {name}: {ratio:.2f}x vs >= {GOAL:.2f}x: {'met' if ratio >= GOAL else 'not met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
