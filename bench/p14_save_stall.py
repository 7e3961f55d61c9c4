"""P14 save stall: how long the loop is blocked per save, and how long until the state is durable,
syncpoint's asynchronous save against DCP's ``async_save`` (staged as torchtitan stages it) and DLRover's flash
checkpoint, side by side.

What it measures
    The same training on 2 ranks (gloo, CPU, 1 thread a rank): a stack of ``--layers`` square
    ``Linear`` layers (width ``WIDTH``, no bias) under DeepSpeed ZeRO 0, fp32, torch's AdamW, micro-batch
    8, no accumulation, a save every ``SAVE_EVERY`` optimizer steps to local disk (``--s3``: every
    ``SAVE_EVERY_S3`` to a moto S3 server on loopback, the one the tests use); the state a save
    holds is the weights and both Adam moments, 12 bytes a parameter (``--state-mb`` picks the layers:
    0.5 GB and 2 GB by default, 128 MB with ``--quick``). Rank 0 reads the clocks.

    * **syncpoint**: the job spec below (``checkpoint.async: true``, ``save_every`` in optimizer steps),
      its ranks started by the launcher without Ray (``run_spawned``, what every Ray Train worker runs);
      per save, from its ``state_committed`` events: ``blocked_seconds`` (all the loop waited for,
      from the boundary that serviced the request: its trainer record and per-rank parts, the claim,
      the snapshot, the wait for its copies before the next optimizer step, the commit; the check
      that the state is finite runs on the copies in the upload thread) and ``seconds`` (from there to
      the manifest's commit: durable). Not counted: rank 0's retention after a commit (``keep_last``
      deleting the state that falls out, in a thread of its own), which the peers' loops, keeping
      every save, do not do. The run's final save is
      not counted (it is synchronous by design: the run ends there), nor an interval save still uploading
      when the run ends (the end commits it, its blocked time then the wait for that upload, which no
      peer's count includes).
    * **DCP**: a DeepSpeed loop written the usual way over the same model, optimizer and data, saving
      ``{"model": ..., "optimizer": ...}`` with ``torch.distributed.checkpoint.async_save`` configured as
      torchtitan's ``async_mode: async_with_pinned_mem`` configures it: a process checkpointer
      (``AsyncCheckpointerType.PROCESS``) and the ``DefaultStager`` with pinned and shared memory and
      asynchronous staging. Blocked = the ``async_save`` call, the wait for its staging to complete
      before the next optimizer step changes the weights, and any wait for the previous save's upload
      before this one starts (torchtitan waits at both places too: one save in flight); durable = the
      call's start to its upload's completion. Pinned memory needs an accelerator: on a CPU-only
      machine the stager is asked for it and the line says whether it had it.

    Each side runs ``--rounds`` times per size, interleaved (syncpoint, DCP, syncpoint, ...); the
    medians over the saves of a side are compared in the same run, each run's first save left out on
    both sides (DCP's first starts its checkpoint process and its process group, tens of seconds on two
    loaded cores, which a job pays once; the per-run lines show it).

    * **DLRover** (installed with ``pip install -e '.[bench]'``; left out, and said so, without it): the
      same loop saving through DLRover's flash checkpoint (``DeepSpeedCheckpointer.save_checkpoint``
      with ``StorageType.DISK``: the state into shared memory, then DLRover's saver process writes it;
      without ``dlrover-run`` the checkpointer starts that saver on local rank 0 itself). Blocked = the
      call; durable = its start to DLRover's tracer file naming the step. Its flash checkpoint writes to
      a disk only: with ``--s3`` it is left out, and DCP writes through its ``FsspecWriter`` (s3fs).

Goals (issue 51, P14): blocked time per save <= the better of DCP's and DLRover's at each size; time
to durable storage <= 1.0x DCP's.

Command (from the repo root; ``--quick``: one size of 128 MB, one round, about 2 minutes here):

    .venv/bin/python -m bench.p14_save_stall --quick
    .venv/bin/python -m bench.p14_save_stall                # 0.5 GB and 2 GB, 2 rounds
    .venv/bin/python -m bench.p14_save_stall --s3 --state-mb 512   # to the moto S3 server

No timed assertions: the script reports, it does not pass or fail on time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

WORLD, MBS, SEED, LR = 2, 8, 1234, 1e-4
WIDTH = 1024  # one layer: WIDTH x WIDTH parameters, 12 bytes each in a state (weights + two Adam moments)
SAVE_EVERY = 2  # optimizer steps between saves
# to the S3 server: an upload there takes longer than two steps, so a save every two would measure
# waiting for the last upload (DCP's one save in flight) or fewer saves (syncpoint's next waits), not a save
SAVE_EVERY_S3 = 8
EVERY_ENV = "P14_SAVE_EVERY"  # the cadence of this run, for every side's ranks


def save_every() -> int:
    """Optimizer steps between saves in this run (``--s3`` sets a longer cadence)."""
    return int(os.environ.get(EVERY_ENV, SAVE_EVERY))


BYTES_PER_PARAM = 12

SPEC = """
name: p14-stall
task:
  path: bench.p14_save_stall:task
  config: {{layers: {layers}, num_samples: {num_samples}}}
scaling: {{num_workers: {world}, cpus_per_worker: 1}}
train: {{micro_batch_size: {mbs}, grad_accum: 1, epochs: 1, seed: {seed}, lr: {lr}, log_every: 1000,
        optimizer: {{type: adamw, weight_decay: 0.0}}}}
deepspeed: {{zero_stage: 0, precision: fp32}}
checkpoint: {{save_every: {{value: {save_every}, unit: optimizer_steps}}, async: true, keep_last: 2,
             export_final: false}}
failure: {{max_failures: 0}}
"""


def layers_for(state_mb: int) -> int:
    """Layers whose state (weights and both Adam moments) holds about ``state_mb`` MB."""
    return max(1, round(state_mb * 2**20 / (BYTES_PER_PARAM * WIDTH * WIDTH)))


def model(layers: int) -> Any:
    import torch

    torch.manual_seed(SEED)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


class Rows:
    """Random inputs and targets of the model's width (fixed by ``SEED``)."""

    def __init__(self, n: int) -> None:
        import torch

        g = torch.Generator().manual_seed(SEED)
        self.x = torch.randn(n, WIDTH, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.x[i]


def loss(m: Any, batch: Any) -> Any:
    import torch

    x, y = batch
    return torch.nn.functional.mse_loss(m(x), y)


def task(config: dict[str, Any]) -> Any:
    """``task.path`` of the syncpoint side."""
    from syncpoint.workers.task import Task

    return Task(model=model(int(config["layers"])), dataset=Rows(int(config["num_samples"])), loss=loss)


def num_samples(steps: int) -> int:
    return steps * MBS * WORLD


# --- syncpoint ------------------------------------------------------------------------------------


def run_syncpoint(work: str, layers: int, steps: int, store: str | None = None) -> list[tuple[float, float]]:
    """(blocked, durable) seconds of each interval save of one run (``store``: its storage URL,
    default a directory of ``work``)."""
    from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.supervision.launch import run_spawned

    text = SPEC.format(
        layers=layers,
        num_samples=num_samples(steps),
        world=WORLD,
        mbs=MBS,
        seed=SEED,
        lr=LR,
        save_every=save_every(),
    )
    spec = resolve_storage(parse_spec(text, "p14", [f"storage={store or os.path.join(work, 'runs')}"]))
    codes = run_spawned(spec, world_size=WORLD, timeout=1800)
    if any(codes):
        raise RuntimeError(f"syncpoint's ranks exited {codes}")
    events = EventLog(RunStorage(spec.run_url)).read_all()
    committed = [e for e in events if e["kind"] == "state_committed"]
    end = max((int(e.get("committed_at_micro_step") or 0) for e in committed), default=0)
    # an interval save still uploading when the run ends is committed at its end, its blocked time then
    # the wait for that upload: the peers' end-of-run waits are not counted either, so neither is it
    saves = [e for e in committed if "final" not in e["reasons"] and int(e.get("committed_at_micro_step") or 0) < end]
    return [(float(e["blocked_seconds"]), float(e["seconds"])) for e in saves]


# --- DCP --------------------------------------------------------------------------------------------


def _peer_rank(side: str, rank: int, port: int, layers: int, steps: int, work: str, out: str) -> None:
    code = 0
    try:
        (_dcp_train if side == DCP else _dlrover_train)(rank, port, layers, steps, work, out)
    except BaseException:  # noqa: BLE001 - a spawned rank: its traceback and a non-zero exit
        traceback.print_exc()
        code = 1
    _end_children()
    os._exit(code)


def _end_children() -> None:
    """End what the peer started in this rank (DCP's checkpoint process, DLRover's saver and its
    helpers): a rank leaving with ``os._exit`` runs no finalizer, and DLRover's saver, left running at
    its fixed socket paths (``<tmp>/ckpt_sock``), would serve the next run's engine."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=30)


def _stager() -> tuple[Any, bool]:
    """torchtitan's ``async_with_pinned_mem`` stager; whether it got pinned memory."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    pinned = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=pinned, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=pinned
    )
    return DefaultStager(options), pinned


def _plain_engine(rank: int, port: int, layers: int, steps: int) -> tuple[Any, Any, Any]:
    """A DeepSpeed loop's set-up written the usual way: the process group, the engine over the same
    model and AdamW, a DistributedSampler's DataLoader; (engine, optimizer, loader)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    m = model(layers)
    optimizer = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0)
    config = {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(model=m, optimizer=optimizer, config=config, dist_init_required=False)
    dataset = Rows(num_samples(steps))
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED
    )
    return engine, optimizer, DataLoader(dataset, batch_size=MBS, sampler=sampler, drop_last=True)


def _dcp_train(rank: int, port: int, layers: int, steps: int, work: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    store = os.environ.get(STORE_ENV)  # an object store's URL (``--s3``), written through fsspec

    engine, optimizer, loader = _plain_engine(rank, port, layers, steps)
    stager, pinned = _stager()
    saves: list[dict[str, Any]] = []  # each: started, blocked (so far), staged, done (upload completed at)
    for step, batch in enumerate(loader, start=1):
        engine.backward(loss(engine, batch))
        _wait_for_staging(saves)  # before the optimizer step changes what the last save is staging
        engine.step()
        if step % save_every() == 0 and step < steps:
            t0 = time.perf_counter()
            if saves:  # one save in flight at a time: torchtitan waits for the last one's upload here too
                saves[-1]["response"].upload_completion.result()
            state = {"model": engine.module.state_dict(), "optimizer": optimizer.state_dict()}
            where = f"{store}/step-{step}" if store else os.path.join(work, f"step-{step}")
            response = dcp.async_save(
                state,
                checkpoint_id=where,
                storage_writer=FsspecWriter(where) if store else None,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=stager,
            )
            save = {"started": t0, "blocked": time.perf_counter() - t0, "staged": False, "response": response}
            response.upload_completion.add_done_callback(lambda _f, save=save: save.update(done=time.perf_counter()))
            saves.append(save)
    _wait_for_staging(saves)
    for save in saves:
        save["response"].upload_completion.result()
    results = [(save["blocked"], save.get("done", time.perf_counter()) - save["started"]) for save in saves]
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"saves": results, "pinned": pinned}, f)
    dist.barrier()
    stager.close()
    _end_checkpoint_process()
    engine.destroy()
    dist.destroy_process_group()


def _end_checkpoint_process() -> None:
    """End DCP's checkpoint process as its own finalizer does (a rank leaving with ``os._exit`` runs none,
    and the process would print its lost pipe's traceback)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process = executor._CHECKPOINT_PROCESS
    if process is not None:
        process.__del__()
        executor._CHECKPOINT_PROCESS = None


def _wait_for_staging(saves: list[dict[str, Any]]) -> None:
    """The loop waits for the last save's staging (torchtitan's ``maybe_wait_for_staging``): blocked time."""
    if saves and not saves[-1]["staged"]:
        t = time.perf_counter()
        saves[-1]["response"].staging_completion.result()
        saves[-1]["blocked"] += time.perf_counter() - t
        saves[-1]["staged"] = True


def _dlrover_train(rank: int, port: int, layers: int, steps: int, work: str, out: str) -> None:
    """DLRover's flash checkpoint as its docs use it with DeepSpeed: ``DeepSpeedCheckpointer`` over the
    engine, ``save_checkpoint(..., storage_type=StorageType.DISK)`` (into shared memory, then its saver
    process writes to disk; started on local rank 0 here, as without ``dlrover-run``). Blocked = the
    call; durable = the call's start to its tracer file naming the step (the saver writes it last)."""
    import threading

    import torch.distributed as dist
    from dlrover.trainer.torch.flash_checkpoint.deepspeed import DeepSpeedCheckpointer, StorageType

    engine, _, loader = _plain_engine(rank, port, layers, steps)
    directory = os.path.join(work, "dlrover")
    checkpointer = DeepSpeedCheckpointer(engine, directory)
    # DLRover 0.6 stands in for torch.save while DeepSpeed saves, with save(obj, path) only; DeepSpeed 0.19
    # passes torch.save's _use_new_zipfile_serialization too: the keyword is dropped, nothing else changes
    agent_save = checkpointer._ckpt_agent.save
    checkpointer._ckpt_agent.save = lambda obj, path, *args, **kwargs: agent_save(obj, path)
    tracer = os.path.join(directory, "dlrover_latest.txt")  # DLRover's CheckpointConstant.TRACER_FILE_NAME
    seen: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:  # when each step's tracer line appears
        while not done.is_set():
            try:
                with open(tracer) as f:
                    seen.setdefault(f.read().strip(), time.perf_counter())
            except OSError:
                pass
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    saves: list[tuple[int, float, float]] = []  # (step, started, blocked)
    for step, batch in enumerate(loader, start=1):
        engine.backward(loss(engine, batch))
        engine.step()
        if step % save_every() == 0 and step < steps:
            t0 = time.perf_counter()
            checkpointer.save_checkpoint(directory, tag=step, storage_type=StorageType.DISK)
            saves.append((step, t0, time.perf_counter() - t0))
    if saves and rank == 0:
        deadline = time.monotonic() + 1800
        while str(saves[-1][0]) not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
    done.set()
    if rank == 0:
        results = [(blocked, seen.get(str(step), float("nan")) - t0) for step, t0, blocked in saves]
        with open(out, "w") as f:
            json.dump({"saves": results, "pinned": False}, f)
    dist.barrier()
    # the saver process local rank 0 started: a daemon, which a rank leaving with os._exit would leave
    # running at DLRover's fixed socket paths (<tmp>/ckpt_sock), where the next run's engine would find it
    dist.destroy_process_group()


def run_peer(side: str, work: str, layers: int, steps: int) -> tuple[list[tuple[float, float]], bool]:
    """(blocked, durable) seconds of each save of one run of a peer (DCP or DLRover); whether DCP's
    stager had pinned memory."""
    from syncpoint.workers.supervision.launch import free_port

    out = os.path.join(work, "peer.json")
    ctx = mp.get_context("spawn")
    port = free_port()
    before = _dlrover_segments()
    procs = [ctx.Process(target=_peer_rank, args=(side, r, port, layers, steps, work, out)) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    finally:
        for name in _dlrover_segments() - before:  # its saver's shared memory outlives its processes
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM, name))
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"the {side} loop's ranks exited {[p.exitcode for p in procs]}")
    with open(out) as f:
        data = json.load(f)
    return [tuple(s) for s in data["saves"]], bool(data["pinned"])


SHM = "/dev/shm"


def _dlrover_segments() -> set[str]:
    """DLRover's flash-checkpoint segments in shared memory (``ckpt_shm_<local rank>``): its saver
    leaves them behind (a state's size each) when its processes end, so the bench removes those its
    own run created."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("ckpt_shm_")}
    except OSError:
        return set()


# --- comparison -----------------------------------------------------------------------------------

DCP, DLROVER = "DCP", "DLRover"
STORE_ENV = "P14_STORE"  # the peers' ranks read the object store's URL from their environment


def dlrover_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("dlrover") is not None


def parser() -> argparse.ArgumentParser:
    """The command line (``tests/integration/test_bench_contract.py`` checks every bench's)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one size of 128 MB, one round")
    p.add_argument("--state-mb", type=int, nargs="+", default=None, help="state sizes (default 512 2048)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps a run (a save every 2; --quick 8)")
    p.add_argument(
        "--s3", action="store_true", help="save to a moto S3 server on loopback (DLRover: disk only, left out)"
    )
    return p


def _start_s3() -> Any:
    """moto's S3 server (bench P10's), its endpoint in this process's environment and fsspec's, so the
    spawned ranks of every side write to it."""
    from bench.p10_object_store import start_moto

    proc, _endpoint = start_moto()
    return proc


def _rounds(
    sizes: list[int], rounds: int, sides: list[str], steps: int, *, s3: bool
) -> tuple[dict[tuple[int, str], list[tuple[float, float]]], bool]:
    """Every side ``rounds`` times per size, interleaved: (the saves of each size and side, each run's
    first left out; whether DCP's stager had pinned memory)."""
    from bench.p10_object_store import BUCKET

    table: dict[tuple[int, str], list[tuple[float, float]]] = {}
    pinned = False
    for size in sizes:
        layers = layers_for(size)
        for r in range(rounds):
            for side in sides:
                store = f"s3://{BUCKET}/p14-{size}-{r}-{side.lower()}" if s3 else None
                os.environ.pop(STORE_ENV, None)
                if store and side != "syncpoint":
                    os.environ[STORE_ENV] = store
                with tempfile.TemporaryDirectory(prefix="p14-", dir=os.environ.get("P14_DIR")) as work:
                    t0 = time.perf_counter()
                    if side == "syncpoint":
                        saves = run_syncpoint(work, layers, steps, store)
                    else:
                        saves, got_pinned = run_peer(side, work, layers, steps)
                        pinned = pinned or got_pinned
                table.setdefault((size, side), []).extend(saves[1:])  # steady state: the first left out
                print(
                    f"  {size} MB ({layers} layers), round {r + 1}, {side:9s}: {len(saves)} saves, blocked "
                    f"{', '.join(f'{b:.2f}' for b, _ in saves)} s; durable {', '.join(f'{d:.2f}' for _, d in saves)} s "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return table, pinned


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sizes = args.state_mb or ([128] if args.quick else [512, 2048])
    rounds = 1 if args.quick else args.rounds
    if args.quick:
        args.steps = 8
    if args.s3:  # four interval saves at the longer cadence (the first and one the run's end commits not counted)
        os.environ[EVERY_ENV] = str(SAVE_EVERY_S3)
        args.steps = max(args.steps, 4 * SAVE_EVERY_S3 + 2)
    print(
        f"P14 save stall: {WORLD} ranks (gloo, 1 thread each), Linear {WIDTH}x{WIDTH} layers, ZeRO 0 fp32, AdamW; "
        f"{args.steps} optimizer steps a run, a save every {save_every()} to "
        f"{'a moto S3 server on loopback' if args.s3 else 'local disk'}; sizes {sizes} MB; {rounds} round(s)",
        flush=True,
    )
    sides = ["syncpoint", DCP] + ([DLROVER] if dlrover_installed() and not args.s3 else [])
    if DLROVER not in sides:
        why = (
            "its flash checkpoint writes to a disk only"
            if args.s3
            else "not installed here (pip install -e '.[bench]')"
        )
        print(f"DLRover: {why}: its side is left out", flush=True)
    moto = _start_s3() if args.s3 else None
    try:
        table, pinned = _rounds(sizes, rounds, sides, args.steps, s3=moto is not None)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait()
    print(f"\n{'state':>8} | {'side':9s} | {'saves':>5} | {'blocked s (median)':>18} | {'durable s (median)':>18}")
    medians: dict[tuple[int, str], tuple[float, float]] = {}
    for (size, side), saves in table.items():
        medians[(size, side)] = (statistics.median(b for b, _ in saves), statistics.median(d for _, d in saves))
        b, d = medians[(size, side)]
        print(f"{size:>6}MB | {side:9s} | {len(saves):>5} | {b:18.3f} | {d:18.3f}")
    print(
        f"\nDCP staged as torchtitan's async_with_pinned_mem: a process checkpointer, shared memory, asynchronous "
        f"staging, pinned memory {'on' if pinned else 'off (no accelerator here: pinned memory needs one)'}"
    )
    where = "_s3" if args.s3 else ""
    for size in sizes:
        (ours_b, ours_d), dcp_d = medians[(size, "syncpoint")], medians[(size, DCP)][1]
        best, best_b = min(((side, medians[(size, side)][0]) for side in sides[1:]), key=lambda x: x[1])
        print(
            f"goal save_blocked_vs_best_peer_{size}mb{where}: {ours_b / best_b:.2f}x vs <= 1.0x: "
            f"{'met' if ours_b <= best_b else 'not met'} ({ours_b:.3f} s vs {best_b:.3f} s blocked per save, "
            f"{best} the better of {', '.join(sides[1:])}; side by side)"
        )
        print(
            f"goal save_durable_vs_dcp_{size}mb{where}: {ours_d / dcp_d:.2f}x vs <= 1.0x: "
            f"{'met' if ours_d <= dcp_d else 'not met'} ({ours_d:.2f} s vs {dcp_d:.2f} s from the save to durable "
            "storage, side by side)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
