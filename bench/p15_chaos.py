"""P15 chaos: syncpoint under a failure every T seconds, against TorchFT on the same work and schedule.

What it runs (one machine, 2 ranks on gloo, 1 thread each; the example's tiny LM widened: d_model
128, 2 layers, sequence 64, dropout 0.1, random crop and token noise per sample; micro-batch 8 a
rank and no accumulation, so an optimizer step is one batch a rank, as a TorchFT DDP step is; AdamW
lr 3e-3; ``--steps`` optimizer steps), each side first without failures, then with a failure every
``T`` seconds (``--every``, default 60 and 15; ``--quick``: 15 only):

* **syncpoint** (``syncpoint run``'s path on an embedded Ray: ZeRO 0, ``save_every: auto`` with
  ``checkpoint.async`` and ``expected_preemptions_per_hour`` the schedule's rate; in-place recovery,
  its default): alternately a crash (``os._exit`` of a random rank) and a preemption notice (SIGTERM
  to a random rank: it saves at its next boundary and stops), as the job spec's ``faults``. Its
  goodput is read from the interrupted run's event log (``syncpoint.policies.decisions.goodput``:
  productive step time over the run's wall time) and its end state is compared bitwise with the
  failure-free run's (the drill's comparison, every parameter, optimizer moment and RNG).
* **syncpoint, Ray Train restart** (``failure.in_place: false``): the same schedule, each failure
  restarting the worker group through Ray Train.
* **TorchFT** 0.2: 2 replica groups of 1 rank (its ``DistributedDataParallel`` and
  ``OptimizerWrapper``, ``ProcessGroupGloo``, its lighthouse in this process with
  ``min_replicas`` 1, its HTTP checkpoint transport), the same model, data (its
  ``DistributedSampler``), batch and optimizer. A failure kills a random replica (SIGKILL for a
  crash; SIGTERM for a notice, which TorchFT does not handle: the process dies) and restarts it at
  once, as torchx would; it rejoins the quorum and heals from the live replica while that one goes
  on alone. Its efficiency, as TorchFT reports it: steps per wall time against its own failure-free
  run; also samples per wall time (a step one replica missed trained on half the batch).

The schedule is in each side's own progress: the k-th failure strikes at the step its failure-free
run had reached k*T seconds into training, so each side meets as many failures at the same points of
its work; each report gives the wall-clock rate that came of it. Goals (issue 51): syncpoint's
goodput >= 95% at a failure per 60 s and >= 85% at one per 15 s, each above TorchFT's efficiency on
the same schedule, with its end state bitwise equal to the failure-free run's (TorchFT's is not
expected to be: it drops the failed steps and does not restore the data position).

Command (``--quick``: 1,000 steps, about 40 s of training a run, a failure every 15 s, without
the Ray Train restart runs: under 5 minutes on 2 cores; 4,500 steps are about 3 minutes of training
a run, 15,000 the issue's 10):

    .venv/bin/python -m bench.p15_chaos --quick
    .venv/bin/python -m bench.p15_chaos --steps 4500 --every 60 15
    .venv/bin/python -m bench.p15_chaos --steps 15000 --every 60 15

TorchFT is the bench extra's (``pip install -e .[bench]``; the Makefile installs it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_lm.yaml"
MODEL = {"num_samples": 4096, "seq_len": 64, "d_model": 128, "n_layers": 2, "eval_samples": 0}
WORLD, MBS, LR, SEED = 2, 8, 3.0e-3, 1234
QUICK_STEPS = 1000  # 40-50 s of training a run here: 2-3 failures (a crash, a notice, ...) at one per 15 s
MARKER = "SYNCPOINT_BENCH_P15"  # every process the bench starts carries it (and only those)


# ---------------------------------------------------------------- the failure schedule


@dataclass
class Failure:
    """One failure: at which step of the side's work, which rank or replica, crash or notice."""

    step: int
    rank: int
    kind: str  # "crash" or "notice"


def schedule(times: list[tuple[int, float]], every_s: float, seed: int) -> list[Failure]:
    """A failure every ``every_s`` seconds of a failure-free run's training (``times``: (step, time)
    of its steps, in order): the k-th at the first step reached k*every_s seconds after its first
    step, alternately a crash and a notice, each on a random rank; none in the last two steps (the
    run must go on past its failure)."""
    rnd = random.Random(seed)
    if len(times) < 4:
        return []
    t0, last = times[0][1], times[-1][0]
    out: list[Failure] = []
    k = 1
    for step, t in times:
        if step >= last - 1:
            break
        if t - t0 >= k * every_s and (not out or step >= out[-1].step + 2):
            out.append(Failure(step, rnd.randrange(WORLD), "crash" if len(out) % 2 == 0 else "notice"))
            k += 1
    return out


# ---------------------------------------------------------------- syncpoint


@dataclass
class SideResult:
    """One run of one side: its wall time, its figures and what it says of itself."""

    label: str
    wall_s: float
    failures: int
    efficiency: float = float("nan")  # failure-free wall over this wall (steps per wall time, relative)
    goodput: float = float("nan")  # syncpoint: productive / total from the event log
    samples_efficiency: float = float("nan")  # TorchFT: samples per wall time, relative
    exact: bool | None = None  # end state bitwise equal to the failure-free run's
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def syncpoint_spec(storage: str, name: str, steps: int, rate_per_hour: float, in_place: bool) -> Any:
    from syncpoint.orchestrator.spec_file import load_spec, resolve_storage

    config = json.dumps(MODEL)
    overrides = [
        f"storage={storage}",
        f"name={name}",
        f"scaling.num_workers={WORLD}",
        "scaling.cpus_per_worker=1",
        f"task.config={config}",
        f"train.micro_batch_size={MBS}",
        "train.grad_accum=1",
        "train.epochs=1000",
        f"train.max_steps={steps}",
        f"train.lr={LR}",
        "train.scheduler={type: constant}",
        "train.log_every=100000",
        "train.eval_every=0",
        "train.dataloader_workers=0",
        "deepspeed.zero_stage=0",
        "checkpoint.save_every=auto",
        "checkpoint.async=true",
        f"checkpoint.expected_preemptions_per_hour={rate_per_hour}",
        "checkpoint.keep_last=2",
        "checkpoint.export_final=false",
        f"failure.in_place={str(in_place).lower()}",
        "failure.max_failures=0",
    ]
    return resolve_storage(load_spec(EXAMPLE, overrides))


def step_times(run_url: str) -> list[tuple[int, float]]:
    """(global micro-step, time) of every optimizer step of a finished run, in order."""
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    steps = EventLog(RunStorage(run_url)).journal().steps()
    return sorted((s.global_micro_step, s.time) for s in steps.values())


def run_syncpoint(spec: Any, quiet: bool = True) -> tuple[int, float, str]:
    """One ``syncpoint run`` on an embedded Ray: (exit code, wall seconds, its last line)."""
    from syncpoint.orchestrator.ray_runner import run_reported

    t0 = time.perf_counter()
    sink = open(os.devnull, "w") if quiet else None
    try:
        with contextlib.redirect_stdout(sink) if sink else contextlib.nullcontext():
            outcome = run_reported(spec)
    finally:
        if sink:
            sink.close()
    return (1 if outcome.failed else 0), time.perf_counter() - t0, outcome.line


def syncpoint_chaos(ref: Any, failures: list[Failure], label: str, ref_wall: float) -> SideResult:
    """The reference's job with ``failures`` as its faults: wall, goodput, and the drill's verdict."""
    from syncpoint.orchestrator.drill import _variant, compare
    from syncpoint.orchestrator.interruptions import InterruptionKind
    from syncpoint.policies.contracts.spec import CrashFault
    from syncpoint.policies.decisions.goodput import goodput
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    faults = [
        CrashFault(rank=f.rank, at_micro_step=f.step, mode="exit" if f.kind == "crash" else "sigterm") for f in failures
    ]
    crashes = sum(f.kind == "crash" for f in failures)
    run = _variant(ref, label, faults, crashes)
    run = run.model_copy(
        update={"failure": run.failure.model_copy(update={"max_preemptions": len(failures) - crashes + 1})}
    )
    RunStorage(run.run_url).delete_tree()
    rc, wall, line = run_syncpoint(run)
    hows = [InterruptionKind.CRASH if f.kind == "crash" else InterruptionKind.SIGTERM for f in failures]
    report = compare(ref, run, 0, rc, [f.step for f in failures], hows, run_line=line)
    g = goodput(EventLog(RunStorage(run.run_url)).journal())
    result = SideResult(label, wall, len(failures), efficiency=ref_wall / wall, exact=report.ok)
    if g is not None:
        result.goodput = g.ratio
        result.extra["parts"] = (
            f"productive {g.productive_s:.1f} s, start-up {g.startup_s:.1f} s, restart gaps {g.restart_gap_s:.1f} s, "
            f"recomputed {g.recomputed_s:.1f} s, saves blocked {g.save_blocked_s:.1f} s of {g.total_s:.1f} s"
        )
    result.note = report.table.splitlines()[-1]
    result.extra["drill"] = report.table
    return result


# ---------------------------------------------------------------- TorchFT


def torchft_replica(group: int, lighthouse: str, steps: int, log: str, final: str) -> None:
    """One TorchFT replica group of one rank: the same task, data and optimizer; a line per step
    (``step participants time``) into ``log``; the parameters at the end into ``final``."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed import ReduceOp, TCPStore
    from torchft import DistributedSampler, Manager, Optimizer, ProcessGroupGloo

    from examples.tiny_lm import build

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    task = build(MODEL)
    store = TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    model = task.model
    optimizer: Any = None

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"p15_{group}",
        timeout=timedelta(seconds=10),
    )
    optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01))
    params = list(model.parameters())
    sampler = DistributedSampler(
        task.dataset,
        replica_rank=group,
        num_replica_groups=WORLD,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=SEED,
    )
    dataset = cast("torch.utils.data.Dataset[Any]", task.dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=MBS, sampler=sampler, num_workers=0)
    with open(log, "a", buffering=1) as out:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for batch in loader:
                optimizer.zero_grad()  # starts the step's quorum
                loss = task.loss(model, batch)
                loss.backward()
                average_gradients(manager, params, ReduceOp.SUM)
                optimizer.step()  # commits only if every replica's allreduce went through
                step = manager.current_step()
                out.write(f"{step} {manager.num_participants()} {time.time():.4f}\n")
                if step >= steps:
                    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{final}_{group}.st")
                    out.write("done\n")
                    manager.shutdown(wait=False)
                    os._exit(0)
            epoch += 1


def average_gradients(manager: Any, params: list[Any], op: Any) -> None:
    """The gradients summed over the quorum in one flat allreduce (``Manager.allreduce``: an error
    is reported to the manager, which then skips the step) and divided by its size. Why not
    TorchFT's ``DistributedDataParallel``: in 0.2 its communication hook fails an assertion when an
    allreduce fails (``assert fut._fut``, meta-pytorch/torchft#304), so the replica that survives a
    failure dies with it, and the bench would measure that bug, not TorchFT's recovery."""
    import torch

    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat, reduce_op=op).wait()
    flat /= max(manager.num_participants(), 1)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@dataclass
class Replica:
    group: int
    proc: subprocess.Popen[bytes]
    log: Path
    offset: int = 0


def read_progress(r: Replica, per_step: dict[int, int]) -> bool:
    """The replica's new complete log lines into ``per_step`` (step -> participants); whether it is done."""
    if not r.log.exists():
        return False
    with open(r.log) as f:
        f.seek(r.offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind("\n") + 1]
    r.offset += len(complete.encode())
    done = False
    for line in complete.splitlines():
        if line == "done":
            done = True
            continue
        step, participants, _ = line.split()
        per_step[int(step)] = max(per_step.get(int(step), 0), int(participants))
    return done


def torchft_run(workdir: Path, steps: int, failures: list[Failure], timeout_s: float) -> SideResult:
    """TorchFT's lighthouse here and its 2 replicas as processes, killed and restarted per ``failures``."""
    from torchft.coordination import LighthouseServer

    workdir.mkdir(parents=True, exist_ok=True)
    # as TorchFT's quick start runs it (min_replicas 1, a quorum tick of 100 ms), joins waited for 100 ms
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, quorum_tick_ms=100)
    env = {**os.environ, MARKER: str(workdir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def start(group: int) -> Replica:
        log = workdir / f"replica_{group}.log"
        cmd = [sys.executable, "-m", "bench.p15_chaos", "--torchft-replica", str(group), "--lighthouse"]
        cmd += [lighthouse.address(), "--steps", str(steps), "--log", str(log), "--final", str(workdir / "final")]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(workdir / f"err_{group}", "ab")
        )
        return Replica(group, proc, log, log.stat().st_size if log.exists() else 0)

    t0 = time.perf_counter()
    replicas = {g: start(g) for g in range(WORLD)}
    per_step: dict[int, int] = {}  # step -> participants
    pending, restarts, unplanned = list(failures), 0, 0
    done = False
    try:
        while not done:
            if time.perf_counter() - t0 > timeout_s:
                raise SystemExit(f"p15: TorchFT did not reach step {steps} in {timeout_s:.0f} s (see {workdir})")
            time.sleep(0.02)
            done = any([read_progress(r, per_step) for r in replicas.values()])
            reached = max(per_step, default=0)
            while pending and reached >= pending[0].step and not done:
                failure = pending.pop(0)
                victim = replicas[failure.rank]
                victim.proc.send_signal(signal.SIGKILL if failure.kind == "crash" else signal.SIGTERM)
                victim.proc.wait(timeout=30)
                replicas[failure.rank] = start(failure.rank)
                restarts += 1
            for g, r in list(replicas.items()):
                if r.proc.poll() not in (None, 0) and not done:  # died on its own: restarted as torchx would
                    unplanned += 1
                    replicas[g] = start(g)
        wall = time.perf_counter() - t0
    finally:
        for r in replicas.values():
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait(timeout=30)
        lighthouse.shutdown()
    samples = sum(per_step.get(s, 0) for s in range(1, steps + 1)) / (WORLD * steps)
    note = f"{restarts} replica restart(s)" + (f", {unplanned} unplanned" if unplanned else "")
    return SideResult("TorchFT", wall, len(failures), samples_efficiency=samples, note=note)


def torchft_times(workdir: Path) -> list[tuple[int, float]]:
    """(step, time) of a TorchFT run's steps (replica 0's log), for its failure schedule."""
    out: dict[int, float] = {}
    for log in sorted(workdir.glob("replica_*.log")):
        for line in log.read_text().splitlines():
            if line != "done":
                step, _, t = line.split()
                out.setdefault(int(step), float(t))
    return sorted(out.items())


def median_step_ms(times: list[tuple[int, float]]) -> float:
    """The median time between consecutive steps, in ms."""
    gaps = [b[1] - a[1] for a, b in zip(times, times[1:], strict=False) if b[0] > a[0]]
    return 1000 * statistics.median(gaps) if gaps else float("nan")


def same_params(a: Path, b: Path) -> bool:
    """Whether two TorchFT runs ended with the same parameters (a replica's at the last step)."""
    from safetensors.torch import load_file

    x, y = (load_file(str(next(iter(sorted(d.glob("final_*.st")))))) for d in (a, b))
    return x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x)


# ---------------------------------------------------------------- report


def goal(name: str, measured: float, op: str, target: float, how: str) -> str:
    met = measured >= target if op == ">=" else measured > target
    return f"goal {name}: {measured:.3f} vs {op} {target:.3f}: {'met' if met else 'not met'} ({how})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.p15_chaos", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_STEPS} steps, a failure every 15 s, no Ray Train restart runs (under 5 minutes)",
    )
    p.add_argument("--steps", type=int, default=15000, help="optimizer steps of every run (default 15000)")
    p.add_argument("--every", type=float, nargs="+", default=[60.0, 15.0], help="seconds between failures")
    p.add_argument("--seed", type=int, default=7, help="draws the ranks that fail")
    p.add_argument("--no-ray-restart", action="store_true", help="leave out syncpoint's Ray Train restart runs")
    p.add_argument("--torchft-replica", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    p.add_argument("--log", default="", help=argparse.SUPPRESS)
    p.add_argument("--final", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.torchft_replica is not None:
        torchft_replica(args.torchft_replica, args.lighthouse, args.steps, args.log, args.final)
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if importlib.util.find_spec("torchft") is None:
        raise SystemExit(
            "p15: TorchFT is not installed: `make venv` installs the bench extra (pip install -e '.[bench]')"
        )
    steps, everies = (QUICK_STEPS, [15.0]) if args.quick else (args.steps, args.every)
    ray_restart = not (args.quick or args.no_ray_restart)
    print(
        f"P15 chaos: tiny LM d_model {MODEL['d_model']}, {MODEL['n_layers']} layers, seq {MODEL['seq_len']}; "
        f"{WORLD} ranks / replicas (gloo, 1 thread each), batch {MBS} a rank, {steps} optimizer steps a run; "
        f"a failure every {everies} s of each side's own failure-free progress; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results: dict[float, list[SideResult]] = {}
    with tempfile.TemporaryDirectory(prefix="p15-") as tmp:
        storage = f"file://{tmp}/runs"
        ref = syncpoint_spec(storage, "p15-ref", steps, 3600.0 / min(everies), in_place=True)
        rc, ref_wall, line = run_syncpoint(ref)
        if rc:
            raise SystemExit(f"p15: syncpoint's failure-free run failed: {line}")
        sp_times = step_times(ref.run_url)
        print(
            f"  syncpoint failure-free: {ref_wall:.1f} s wall, {len(sp_times)} steps, median step "
            f"{median_step_ms(sp_times):.1f} ms",
            flush=True,
        )
        ft_ref_dir = Path(tmp) / "torchft-ref"
        ft_ref = torchft_run(ft_ref_dir, steps, [], timeout_s=20 * ref_wall + 300)
        ft_times = torchft_times(ft_ref_dir)
        print(
            f"  TorchFT failure-free: {ft_ref.wall_s:.1f} s wall, {len(ft_times)} steps, median step "
            f"{median_step_ms(ft_times):.1f} ms",
            flush=True,
        )
        for every in everies:
            rows = results.setdefault(every, [])
            plan = schedule(sp_times, every, args.seed)
            for in_place in (True, False) if ray_restart else (True,):
                label = f"chaos-{int(every)}s-{'inplace' if in_place else 'ray'}"
                spec = syncpoint_spec(storage, "p15-ref", steps, 3600.0 / every, in_place=in_place)
                r = syncpoint_chaos(spec, plan, label, ref_wall)
                r.label = "syncpoint" + ("" if in_place else " (Ray Train restart)")
                rows.append(r)
                print(f"  {every:.0f} s: {r.label}: {r.failures} failures, {r.wall_s:.1f} s wall, {r.note}", flush=True)
                print(f"    its event log: {r.extra.get('parts', 'no goodput (no attempt started)')}", flush=True)
            ft_plan = schedule(ft_times, every, args.seed)
            ft_dir = Path(tmp) / f"torchft-{int(every)}"
            ft = torchft_run(ft_dir, steps, ft_plan, timeout_s=20 * ft_ref.wall_s + 300)
            ft.efficiency = ft_ref.wall_s / ft.wall_s
            ft.samples_efficiency *= ft.efficiency
            ft.exact = same_params(ft_ref_dir, ft_dir)
            rows.append(ft)
            print(f"  {every:.0f} s: TorchFT: {ft.failures} failures, {ft.wall_s:.1f} s wall, {ft.note}", flush=True)
    print()
    print(
        "  every | side                          | failures | wall s | wall s a failure | goodput | efficiency", end=""
    )
    print(" | samples eff. | bitwise")
    for every, rows in results.items():
        for r in rows:
            print(
                f"  {every:>5.0f} | {r.label:<29} | {r.failures:>8} | {r.wall_s:>6.1f} | "
                f"{r.wall_s / max(r.failures, 1):>16.1f} | {r.goodput:>7.3f} | {r.efficiency:>10.3f} | "
                f"{r.samples_efficiency:>12.3f} | {r.exact}"
            )
    for every, rows in results.items():
        sp, ft = rows[0], rows[-1]
        target = 0.95 if every >= 60 else 0.85
        print(
            goal(f"goodput_{every:.0f}s", sp.goodput, ">=", target, "syncpoint's productive / wall time, its event log")
        )
        print(
            goal(
                f"goodput_vs_torchft_{every:.0f}s",
                sp.goodput,
                ">",
                ft.efficiency,
                "TorchFT's steps per wall time vs its failure-free run",
            )
        )
        print(
            goal(
                f"efficiency_vs_torchft_{every:.0f}s",
                sp.efficiency,
                ">",
                ft.efficiency,
                "both as failure-free wall / wall, like for like",
            )
        )
        print(
            f"goal exact_{every:.0f}s: {sp.exact} vs True: {'met' if sp.exact else 'not met'} (end state bitwise, "
            f"the drill's comparison; TorchFT's: {ft.exact})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
