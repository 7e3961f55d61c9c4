"""P7 ZeRO memory: what each stage (and offload) saves a rank, for the same model at 2 ranks.

What it measures
    One run of this script builds the same model (an MLP, AdamW, fp32) under DeepSpeed at 2 ranks
    (spawned processes, gloo) with ZeRO 0, 1, 2, 3 and 3 + offload (optimizer and parameters to
    the CPU), trains a few optimizer steps through syncpoint's own engine builder
    (``syncpoint.workers.training.engine.build_engine``: the config syncpoint runs with), and reports per rank:

    * parameters, gradients and optimizer state (fp32 master partitions and Adam moments): the
      bytes of every distinct tensor storage the engine holds (module parameters and their ZeRO-3
      partitions, ``.grad``, DeepSpeed's flat buffers and partitions, the optimizer's state),
      measured at the two peaks of a step (after the boundary's backward, after ``step``), the
      larger kept; storages shared by views are counted once;
    * ``device``: what of that an accelerator would hold. This machine has no GPU, so DeepSpeed's
      "device" is the CPU and offload moves nothing physically; the offloaded categories
      (optimizer state with ``offload_optimizer``, parameter partitions with ``offload_params``)
      are counted as host-resident, the rest as device-resident (gradients always: they are
      reduced on the device before the offloaded step copies them out);
    * the process's peak RSS (``ru_maxrss``) and its growth over the RSS before the engine was built
      (imports, the model built on every rank).

Goals (checked in the last lines), from the arithmetic of fp32 AdamW on N = 2 ranks (Psi parameters)
    ZeRO-0 holds 4 Psi parameters + 4 Psi gradients + 8 Psi moments = 16 Psi per rank; ZeRO 1-3 add
    an fp32 master copy (4 Psi) even in fp32, and ZeRO-3 divides all of it: 20 Psi / N = 0.625 x
    ZeRO-0 at N = 2. Goal: ZeRO-3 model state per rank <= 0.65 x ZeRO-0's (0.625 plus 4 % for
    padding and buffers). With both offloads only the gradient partition (4 Psi / N) stays on the
    device: 0.2 x ZeRO-3's. Goal: ZeRO-3 + offload device-resident bytes <= 0.25 x ZeRO-3's.

Command (~3 min here; ``--quick`` uses a ~1M-parameter model and 2 steps, and only the three configs
the goals compare, ZeRO 0, 3 and 3 + offload (``QUICK_CONFIGS``), ~1 min):
    cd /work/main && .venv/bin/python -m bench.p7_zero_memory --quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import traceback
from typing import Any

CONFIGS = [
    ("ZeRO-0", 0, "none", "none"),
    ("ZeRO-1", 1, "none", "none"),
    ("ZeRO-2", 2, "none", "none"),
    ("ZeRO-3", 3, "none", "none"),
    ("ZeRO-3 + offload", 3, "cpu", "cpu"),
]
# --quick's configs: those its goals compare (ZeRO-1 and ZeRO-2 are rows of the table only)
QUICK_CONFIGS = [c for c in CONFIGS if c[0] in ("ZeRO-0", "ZeRO-3", "ZeRO-3 + offload")]
WORLD = 2
CATEGORIES = ("params", "grads", "optim")


def _spec(stage: int, offload_optimizer: str, offload_params: str, width: int, depth: int):
    from syncpoint.orchestrator.spec_file import parse_spec

    text = f"""
name: p7
task: {{path: bench.p7_zero_memory:build, config: {{width: {width}, depth: {depth}}}}}
train: {{micro_batch_size: 4, grad_accum: 1, max_steps: 100, lr: 1.0e-3, optimizer: adamw}}
deepspeed: {{zero_stage: {stage}, offload_optimizer: {offload_optimizer}, offload_params: {offload_params}}}
"""
    return parse_spec(text, "bench/p7", [f"scaling.num_workers={WORLD}"])


def model(width: int, depth: int):
    import torch

    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def build(config: dict[str, Any]):
    """The task form (``task.path``) only so the spec validates; the bench drives the engine itself."""
    raise NotImplementedError


class Ledger:
    """Bytes per category over distinct tensor storages (views of one flat buffer count once)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = dict.fromkeys(CATEGORIES, 0)

    def add(self, category: str, obj: Any, depth: int = 0) -> None:
        import torch

        if torch.is_tensor(obj):
            storage = obj.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.bytes[category] += storage.nbytes()
        elif depth < 3 and isinstance(obj, (list, tuple)):
            for v in obj:
                self.add(category, v, depth + 1)
        elif depth < 3 and isinstance(obj, dict):
            for v in obj.values():
                self.add(category, v, depth + 1)


def _category(attribute: str) -> str:
    """DeepSpeed's optimizer attributes by name: gradient buffers and partitions, fp32 master
    partitions (optimizer state), the rest (bit16 flat groups, partitions) parameters."""
    name = attribute.lower()
    if "grad" in name or "ipg" in name:
        return "grads"
    if "fp32" in name:
        return "optim"
    return "params"


def measure(engine) -> dict[str, int]:
    ledger = Ledger()
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    for st in base.state.values():  # Adam moments (and step) first: they are optimizer state wherever they live
        ledger.add("optim", st)
    for name, value in vars(opt).items():
        if value is not base and not name.startswith("param_names"):
            ledger.add(_category(name), value)
    for p in engine.module.parameters():
        ledger.add("params", getattr(p, "ds_tensor", None))
        ledger.add("params", p.data)
        ledger.add("grads", p.grad)
    return ledger.bytes


def _rank(
    rank: int, port: int, stage: int, off_opt: str, off_par: str, width: int, depth: int, steps: int, out: str
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        from syncpoint.workers.training.engine import build_engine

        torch.manual_seed(0)
        net = model(width, depth)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        engine = build_engine(_spec(stage, off_opt, off_par, width, depth), net)
        peak = dict.fromkeys(CATEGORIES, 0)
        for step in range(steps):
            x = torch.randn(4, width, generator=torch.Generator().manual_seed(step * WORLD + rank))
            engine.set_gradient_accumulation_boundary(True)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            after_backward = measure(engine)
            engine.step()
            after_step = measure(engine)
            peak = {k: max(peak[k], after_backward[k], after_step[k]) for k in CATEGORIES}
        numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump({"bytes": peak, "rss": rss, "rss_before": rss_before, "numel": numel}, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - a spawned rank: any failure prints its traceback and exits non-zero
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def run_config(stage: int, off_opt: str, off_par: str, width: int, depth: int, steps: int) -> list[dict[str, Any]]:
    import multiprocessing as mp

    from syncpoint.workers.supervision.launch import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    with tempfile.TemporaryDirectory(prefix="syncpoint-p7-") as d:
        out = os.path.join(d, "rank")
        procs = [
            ctx.Process(target=_rank, args=(r, port, stage, off_opt, off_par, width, depth, steps, out))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(
                f"ZeRO-{stage} (offload {off_opt}/{off_par}) failed: exit codes {[p.exitcode for p in procs]}"
            )
        ranks = []
        for r in range(WORLD):
            with open(f"{out}.{r}.json") as f:
                ranks.append(json.load(f))
    return ranks


def device_bytes(b: dict[str, int], off_opt: str, off_par: str) -> int:
    """What an accelerator would hold: offloaded categories live in host memory instead."""
    held = b["grads"] + (b["params"] if off_par == "none" else 0)
    if off_opt == "none":
        held += b["optim"]
    return held


def parser() -> argparse.ArgumentParser:
    """The command line (``tests/integration/test_bench_contract.py`` checks every bench's)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~1M-parameter model, 2 steps, ZeRO 0, 3 and 3 + offload")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    width, depth, steps = (256, 15, 2) if args.quick else (1024, 8, 3)
    rows = []
    for label, stage, off_opt, off_par in QUICK_CONFIGS if args.quick else CONFIGS:
        ranks = run_config(stage, off_opt, off_par, width, depth, steps)
        worst = max(ranks, key=lambda r: sum(r["bytes"].values()))
        rows.append(
            (
                label,
                off_opt,
                off_par,
                worst,
                max(r["rss"] for r in ranks),
                max(r["rss"] - r["rss_before"] for r in ranks),
            )
        )
    mb = 1e6
    numel = rows[0][3]["numel"]
    print(
        f"P7 ZeRO memory: MLP {depth}x{width} ({numel / 1e6:.2f}M parameters), AdamW, fp32, "
        f"{WORLD} ranks (gloo, CPU); "
        "per rank, the larger rank"
    )
    head = (
        f"{'config':<17} | {'params MB':>9} | {'grads MB':>8} | {'optim MB':>8} | {'model state MB':>14} | "
        f"{'vs ZeRO-0':>9} | {'device MB':>9} | {'peak RSS MB':>11} | {'RSS growth MB':>13}"
    )
    print(head)
    print("-" * len(head))
    base = sum(rows[0][3]["bytes"].values())
    totals = {}
    for label, off_opt, off_par, r, rss, growth in rows:
        b = r["bytes"]
        total = sum(b.values())
        totals[label] = (total, device_bytes(b, off_opt, off_par))
        print(
            f"{label:<17} | {b['params'] / mb:>9.2f} | {b['grads'] / mb:>8.2f} | {b['optim'] / mb:>8.2f} | "
            f"{total / mb:>14.2f} | {total / base:>8.2f}x | {totals[label][1] / mb:>9.2f} | {rss / mb:>11.0f} | "
            f"{growth / mb:>13.0f}"
        )
    print(
        "model state = parameters + gradients + optimizer state (fp32 master partitions, Adam moments), measured "
        "after the boundary's backward and after step (transient peaks inside backward are not seen); device = "
        "what a GPU would hold (this CPU machine's offload moves nothing physically); "
        "RSS includes torch and DeepSpeed"
    )
    z3_ratio = totals["ZeRO-3"][0] / base
    off_ratio = totals["ZeRO-3 + offload"][1] / max(totals["ZeRO-3"][1], 1)
    print(
        f"goal zero3 model state per rank vs ZeRO-0: {z3_ratio:.2f}x vs target <= 0.65x: "
        f"{'met' if z3_ratio <= 0.65 else 'not met'}"
    )
    print(
        f"goal zero3+offload device-resident vs ZeRO-3: {off_ratio:.2f}x vs target <= 0.25x: "
        f"{'met' if off_ratio <= 0.25 else 'not met'}"
    )


if __name__ == "__main__":
    main()
