"""P9 exact resume against the peer: Hugging Face ``Trainer`` and syncpoint on the same GPT-2 task.

What it measures
    The same small task under both, each against its own uninterrupted run: HF's ``GPT2LMHeadModel``
    from ``examples.hf_gpt2`` (2 blocks, 32-wide, dropout 0.1 on embeddings, residuals and
    attention), the example's ``CorpusWindows`` (with ``--augment``: a random crop offset and token
    noise drawn in ``__getitem__``), micro-batch 2, accumulation 4, 22 micro-batches an epoch (so
    each epoch ends with a short cycle of 2), AdamW (lr 2e-3, weight decay 0.1, betas 0.9/0.95),
    warmup + cosine to 0.1x, clipping 1.0, one process, seed 1234, fp32 on CPU, 0 or 1
    DataLoader worker processes.

    Each interrupted run is a chain of processes, each killed with SIGKILL (the process sends it
    to itself from the loss call, so the point is exact) after micro-batches 10, 21 and 32 of the
    run: mid-cycle of optimizer step 3, inside epoch 1's short last cycle, and mid-cycle in epoch
    2. Both sides save after every optimizer step, so each resumes from the step before the kill.

    * HF Trainer (transformers, one process, ``save_steps=1``): a process per attempt, the
      first with ``trainer.train()``, the next ones with ``trainer.train(resume_from_checkpoint=True)``.
    * syncpoint: a process per attempt running the bare-process-group loop
      (``syncpoint.workers.supervision.launch.run_in_process``, what ``syncpoint run`` runs on each rank), the same
      storage every time, ``checkpoint.save_every`` 1 optimizer step, ZeRO-0; every attempt is
      the same submission restarted (as Ray Train restarts a failed worker group), so it takes
      back the run directory's lease the killed process still holds.

    Both record the same thing from inside the loss call of every micro-batch: the sample ids of
    the batch (the dataset puts each sample's index in it) and the loss, in float32 bits. The
    micro-batches that made the final model are, for each attempt, those from where it resumed
    up to where the next attempt resumed. Against the uninterrupted run:

    * losses after resume: every micro-batch's loss bitwise equal (first differing micro-batch);
    * final parameters: bitwise equal, or the largest absolute difference;
    * samples: skipped (in the uninterrupted run's epoch, missing after resume) and repeated
      (trained more often than in the uninterrupted epoch), and micro-batches whose sample ids
      differ from the uninterrupted run's at the same position.

Expected (measured outside the project with transformers 5.24): HF resumes bitwise when
``__getitem__`` draws no randomness and diverges with augmentation (it restores the RNG only after
the resumed epoch's first accumulation cycle has been fetched, and it saves no DataLoader-worker
RNG); syncpoint resumes bitwise in all four cells.

Command (from the repo root; ~15 minutes on 2 shared cores with ``--jobs 3``, 16 process chains;
``--quick`` runs only the two cells with augmentation and a DataLoader worker, where the two differ,
side by side, each interrupted once (``QUICK_KILLS``: at micro-batch 10, the first resume at 8)
instead of three times: under a minute on a quiet machine):

    .venv/bin/python -m bench.p9_hf_trainer
    .venv/bin/python -m bench.p9_hf_trainer --quick

No timed assertions: the script reports, it does not pass or fail on time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# The task (both sides). 44 samples / micro-batch 2 = 22 micro-batches an epoch: cycles 4,4,4,4,4,2.
SEED, MBS, ACCUM, NUM_SAMPLES, EPOCHS, SEQ_LEN = 1234, 2, 4, 44, 2, 16
MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": SEQ_LEN, "dropout": 0.1, "checkpointing": False}
LR, WEIGHT_DECAY, BETAS, WARMUP, MIN_LR_RATIO, CLIP = 2e-3, 0.1, (0.9, 0.95), 4, 0.1, 1.0
KILLS = (10, 21, 32)  # kill after this many micro-batches of the run (0-based index of the next one)
QUICK_KILLS = KILLS[:1]  # --quick: the first only (an interrupted chain of 2 processes, not 4)


@dataclass(frozen=True)
class Layout:
    per_epoch: int = NUM_SAMPLES // MBS
    accum: int = ACCUM

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.per_epoch // self.accum)

    def micro_index(self, step: int, j: int) -> int:
        """The run's 0-based micro-batch index of micro-batch ``j`` of optimizer step ``step`` (0-based)."""
        epoch, t = divmod(step, self.steps_per_epoch)
        return epoch * self.per_epoch + t * self.accum + j

    def epoch_of(self, g: int) -> int:
        return g // self.per_epoch


# --- the dataset and the recorder (shared) --------------------------------------------------------


class Indexed(torch.utils.data.Dataset):
    """The example's training windows, each sample carrying its index (so the loss call can record
    which samples it trained on) and its labels (HF's causal-LM loss shifts them inside the model)."""

    def __init__(self, augment: bool, num_samples: int = NUM_SAMPLES) -> None:
        from examples.hf_gpt2 import splits

        self.windows, _ = splits(num_samples, 1, SEQ_LEN, 0.05 if augment else 0.0)
        self.windows.augment = augment

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        x = self.windows[i]
        return {"input_ids": x, "labels": x, "idx": int(i)}


class Recorder:
    """Appends one JSON line per micro-batch (attempt, HF's step counter when there is one, sample
    ids, loss) and kills this process with SIGKILL before the run's micro-batch ``g`` in ``kills``
    (once per run: a marker file remembers it). ``start`` is where this attempt resumed (micro-batches
    already in the model), ``g`` = start + micro-batches this attempt has computed."""

    def __init__(self, path: str, attempt: int, start: int, kills: tuple[int, ...]) -> None:
        self.path, self.attempt, self.start, self.kills, self.count = path, attempt, start, kills, 0

    def before(self, g: int) -> None:
        marker = f"{self.path}.killed-{g}"
        if g in self.kills and not os.path.exists(marker):
            Path(marker).write_text("")
            os.kill(os.getpid(), signal.SIGKILL)

    def record(self, idx: torch.Tensor, loss: torch.Tensor, step: int | None = None) -> None:
        with open(self.path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "a": self.attempt,
                        "step": step,
                        "idx": [int(i) for i in idx],
                        "loss": float(loss.detach().float()),
                    }
                )
                + "\n"
            )
        self.count += 1


def _recorder() -> Recorder:
    return Recorder(
        os.environ["P9_RECORD"],
        int(os.environ["P9_ATTEMPT"]),
        int(os.environ["P9_START"]),
        tuple(int(k) for k in os.environ.get("P9_KILLS", "").split(",") if k),
    )


# --- syncpoint ------------------------------------------------------------------------------------


def syncpoint_task(config: dict) -> Any:
    """``task.path`` of the syncpoint side: the example's GPT-2, the indexed windows, a loss that records."""
    from examples.hf_gpt2 import gpt2
    from syncpoint.workers.task import Task

    rec = _recorder()

    def loss(model, batch):
        rec.before(rec.start + rec.count)
        out = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        rec.record(batch["idx"], out)
        return out

    return Task(
        model=gpt2({**MODEL, **config.get("model", {})}),
        dataset=Indexed(bool(config["augment"]), int(config["num_samples"])),
        loss=loss,
    )


SYNCPOINT_SPEC = """
name: p9-gpt2
task: {{path: bench.p9_hf_trainer:syncpoint_task, config: {{augment: {augment}, num_samples: {n}}}}}
train:
  micro_batch_size: {mbs}
  grad_accum: {accum}
  epochs: {epochs}
  seed: {seed}
  lr: {lr}
  optimizer: {{type: adamw, weight_decay: {wd}, betas: [{b1}, {b2}]}}
  scheduler: {{type: cosine, warmup: {warmup}, unit: optimizer_steps, min_lr_ratio: {minr}}}
  gradient_clipping: {clip}
  dataloader_workers: {workers}
  log_every: 1000
deepspeed: {{zero_stage: 0, precision: fp32}}
checkpoint: {{save_every: {{value: 1, unit: optimizer_steps}}, keep_last: 0, export_final: true}}
failure: {{max_failures: 0}}
"""


def _syncpoint_attempt(storage: str, augment: bool, workers: int, epochs: int) -> None:
    """One attempt in this process (the ``sp-attempt`` subcommand)."""
    from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
    from syncpoint.workers.supervision.launch import run_in_process

    torch.set_num_threads(1)
    text = SYNCPOINT_SPEC.format(
        augment=str(augment).lower(),
        n=NUM_SAMPLES,
        mbs=MBS,
        accum=ACCUM,
        epochs=epochs,
        seed=SEED,
        lr=LR,
        wd=WEIGHT_DECAY,
        b1=BETAS[0],
        b2=BETAS[1],
        warmup=WARMUP,
        minr=MIN_LR_RATIO,
        clip=CLIP,
        workers=workers,
    )
    spec = resolve_storage(parse_spec(text, "p9", [f"storage={storage}", "scaling.num_workers=1"]))
    # Every attempt of a chain is the same submission restarted (what Ray Train's restart is): it takes
    # back the run directory's lease its killed predecessor still holds, as a restart does.
    run_in_process(spec, print_progress=False, submission_id=os.environ["P9_SUBMISSION"])


def _newest_committed(storage: str) -> int:
    """Micro-batches in the newest committed state (its name is its global micro-step), 0 if none."""
    root = Path(storage, "p9-gpt2", "states")
    names = [int(p.name) for p in root.iterdir() if (p / "manifest.json").exists()] if root.exists() else []
    return max(names, default=0)


# Set by whatever ran in the caller's process before (an in-process syncpoint run sets LOCAL_RANK): an attempt
# that inherits them makes accelerate think it is one rank of a multi-process job and wait for MASTER_ADDR.
_DISTRIBUTED_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_SIZE",
)


def _attempt_env(**extra: str) -> dict[str, str]:
    """The environment of one attempt: the caller's, without any distributed-launch variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    env.update(extra)
    return env


def _attempt_finished(cmd: list[str], env: dict[str, str], label: str, codes: list[int], timeout: float) -> bool:
    """Run one attempt of a chain; True when it finished, False when it was killed at its kill point
    (SIGKILL, as planned); any other exit is the bench's failure, raised with the attempt's output."""
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    codes.append(r.returncode)
    if r.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"{label} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return r.returncode == 0


def run_syncpoint(
    workdir: str, augment: bool, workers: int, kills: tuple[int, ...], epochs: int = EPOCHS, timeout: float = 600
) -> dict[str, Any]:
    """A chain of syncpoint processes on one storage until the run finishes; what it trained and its final model."""
    storage = os.path.join(workdir, "runs")
    record = os.path.join(workdir, "records.jsonl")
    starts, codes, submission = [], [], uuid.uuid4().hex
    for attempt in range(1, len(kills) + 3):
        start = _newest_committed(storage)
        starts.append(start)
        env = _attempt_env(
            P9_RECORD=record,
            P9_ATTEMPT=str(attempt),
            P9_START=str(start),
            P9_KILLS=",".join(map(str, kills)),
            CUDA_VISIBLE_DEVICES="",
            DS_ACCELERATOR="cpu",
            P9_SUBMISSION=submission,
        )
        cmd = [
            sys.executable,
            "-m",
            "bench.p9_hf_trainer",
            "sp-attempt",
            "--storage",
            storage,
            "--augment",
            str(int(augment)),
            "--workers",
            str(workers),
            "--epochs",
            str(epochs),
        ]
        if _attempt_finished(cmd, env, f"syncpoint attempt {attempt}", codes, timeout):
            break
    from safetensors.torch import load_file

    final = load_file(os.path.join(storage, "p9-gpt2", "final", "model.safetensors"))
    return {"records": _read(record), "starts": starts, "codes": codes, "params": final}


# --- Hugging Face Trainer -------------------------------------------------------------------------


def _hf_attempt(out: str, augment: bool, workers: int, epochs: int, resume: bool) -> None:
    """One attempt of HF Trainer in this process (the ``hf-attempt`` subcommand)."""
    from transformers import Trainer, TrainingArguments, set_seed

    from examples.hf_gpt2 import gpt2

    torch.set_num_threads(1)
    layout = Layout()
    rec = _recorder()
    seen: Counter[int] = Counter()

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            idx = inputs.pop("idx")
            step = self.state.global_step
            rec.before(layout.micro_index(step, seen[step]))
            seen[step] += 1
            loss = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            rec.record(idx, loss[0] if return_outputs else loss, step)
            return loss

    set_seed(SEED)
    model = gpt2(MODEL)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=MBS,
        gradient_accumulation_steps=ACCUM,
        num_train_epochs=epochs,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},
        warmup_steps=WARMUP,
        max_grad_norm=CLIP,
        optim="adamw_torch",
        seed=SEED,
        dataloader_num_workers=workers,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1000,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        remove_unused_columns=False,
    )
    trainer = Recording(model=model, args=args, train_dataset=Indexed(augment))
    trainer.train(resume_from_checkpoint=True if resume else None)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, os.path.join(out, "final.pt"))


def run_hf(
    workdir: str, augment: bool, workers: int, kills: tuple[int, ...], epochs: int = EPOCHS, timeout: float = 600
) -> dict[str, Any]:
    """A chain of HF Trainer processes, each killed with SIGKILL at the next kill point, the later ones
    with ``resume_from_checkpoint=True``, until training finishes."""
    out = os.path.join(workdir, "hf")
    record = os.path.join(workdir, "records.jsonl")
    layout = Layout()
    starts, codes = [], []
    for attempt in range(1, len(kills) + 3):
        ckpts = [int(p.name.split("-")[1]) for p in Path(out).glob("checkpoint-*")] if os.path.isdir(out) else []
        # where HF resumes: the newest checkpoint's step, as a micro-batch index of the run
        starts.append(layout.micro_index(max(ckpts), 0) if ckpts else 0)
        env = _attempt_env(
            P9_RECORD=record,
            P9_ATTEMPT=str(attempt),
            P9_START=str(starts[-1]),
            P9_KILLS=",".join(map(str, kills)),
            CUDA_VISIBLE_DEVICES="",
            TOKENIZERS_PARALLELISM="false",
        )
        cmd = [
            sys.executable,
            "-m",
            "bench.p9_hf_trainer",
            "hf-attempt",
            "--out",
            out,
            "--augment",
            str(int(augment)),
            "--workers",
            str(workers),
            "--epochs",
            str(epochs),
        ]
        if ckpts:
            cmd.append("--resume")
        if _attempt_finished(cmd, env, f"HF attempt {attempt}", codes, timeout):
            break
    params = torch.load(os.path.join(out, "final.pt"), weights_only=True)
    return {"records": _read(record), "starts": starts, "codes": codes, "params": params}


# --- comparison -----------------------------------------------------------------------------------


def _read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def kept(run: dict[str, Any]) -> dict[int, tuple[tuple[int, ...], float]]:
    """The micro-batches that made the final model, by the run's micro-batch index: attempt ``a``'s
    ``i``-th micro-batch is index ``start_a + i``; it counts unless a later attempt resumed at or
    before it (that work was lost with the process and redone)."""
    starts = run["starts"]
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for r in run["records"]:
        by_attempt.setdefault(r["a"], []).append(r)
    out: dict[int, tuple[tuple[int, ...], float]] = {}
    for a, recs in by_attempt.items():
        begin = starts[a - 1]
        end = min(starts[a:], default=None)  # a later attempt redid everything from its start on
        for i, r in enumerate(recs):
            g = begin + i
            if end is None or g < end:
                out[g] = (tuple(r["idx"]), r["loss"])
    return out


def compare(ref: dict[str, Any], run: dict[str, Any], layout: Layout = Layout()) -> dict[str, Any]:
    """The interrupted run against its uninterrupted reference (both from ``run_hf``/``run_syncpoint``)."""
    a, b = kept(ref), kept(run)
    first_resume = min((s for s in run["starts"] if s > 0), default=None)
    keys = sorted(set(a) | set(b))
    loss_diff = [g for g in keys if g not in a or g not in b or a[g][1] != b[g][1]]
    ids_diff = [g for g in keys if g not in a or g not in b or a[g][0] != b[g][0]]
    skipped = repeated = 0
    for epoch in {layout.epoch_of(g) for g in keys}:
        ca = Counter(i for g, (ids, _) in a.items() if layout.epoch_of(g) == epoch for i in ids)
        cb = Counter(i for g, (ids, _) in b.items() if layout.epoch_of(g) == epoch for i in ids)
        skipped += sum((ca - cb).values())
        repeated += sum((cb - ca).values())
    pa, pb = ref["params"], run["params"]
    bitwise = pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    max_diff = max((float((pa[k].float() - pb[k].float()).abs().max()) for k in pa if k in pb), default=float("nan"))
    return {
        "micro_batches": len(b),
        "reference_micro_batches": len(a),
        "first_resume": first_resume,
        "losses_identical": not loss_diff,
        "first_loss_diff": loss_diff[0] if loss_diff else None,
        "max_loss_diff": max((abs(a[g][1] - b[g][1]) for g in keys if g in a and g in b), default=0.0),
        "bitwise": bitwise,
        "max_param_diff": max_diff,
        "skipped": skipped,
        "repeated": repeated,
        "ids_differ": len(ids_diff),
        "kills": sum(1 for c in run["codes"] if c == -signal.SIGKILL),
        "attempts": len(run["codes"]),
    }


def cell(framework: str, augment: bool, workers: int, kills: tuple[int, ...], epochs: int, base: str) -> dict[str, Any]:
    """One framework on one variant: the uninterrupted reference and the interrupted chain, compared."""
    runner = run_hf if framework == "hf" else run_syncpoint
    tag = f"{framework}-aug{int(augment)}-w{workers}"
    ref = runner(os.path.join(base, tag + "-ref"), augment, workers, (), epochs)
    run = runner(os.path.join(base, tag + "-int"), augment, workers, kills, epochs)
    return compare(ref, run)


def parser() -> argparse.ArgumentParser:
    """The command line, with the attempts' own subcommands (``tests/integration/test_bench_contract.py``
    checks every bench's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    for name in ("hf-attempt", "sp-attempt"):
        p = sub.add_parser(name)
        p.add_argument("--out")
        p.add_argument("--storage")
        p.add_argument("--augment", type=int, required=True)
        p.add_argument("--workers", type=int, required=True)
        p.add_argument("--epochs", type=int, required=True)
        p.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="only the cells with augmentation and a worker (where HF and syncpoint differ), one kill each",
    )
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--jobs", type=int, default=2, help="cells run side by side (each a chain of processes)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.cmd == "hf-attempt":
        _hf_attempt(args.out, bool(args.augment), args.workers, args.epochs, args.resume)
        return
    if args.cmd == "sp-attempt":
        _syncpoint_attempt(args.storage, bool(args.augment), args.workers, args.epochs)
        return

    import transformers

    started = time.perf_counter()
    variants = [(True, 1)] if args.quick else [(aug, w) for aug in (False, True) for w in (0, 1)]
    kills = QUICK_KILLS if args.quick else KILLS
    jobs = [(fw, aug, w) for aug, w in variants for fw in ("hf", "syncpoint")]
    with tempfile.TemporaryDirectory(prefix="p9-") as base, ThreadPoolExecutor(args.jobs) as pool:

        def one(job: tuple[str, bool, int]) -> tuple[str, bool, int, dict[str, Any]]:
            c = cell(*job, kills, args.epochs, base)
            print(
                f"  done: {job[0]} augment={job[1]} workers={job[2]} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            return (*job, c)

        rows = list(pool.map(one, jobs))
    layout = Layout()
    print()
    print(
        f"P9 exact resume vs HF Trainer: GPT-2 (2 blocks, 32 wide, dropout 0.1), {NUM_SAMPLES} samples, micro-batch "
        f"{MBS}, accumulation {ACCUM} ({layout.per_epoch} micro-batches an epoch: a short last cycle of "
        f"{layout.per_epoch % ACCUM or ACCUM}), {args.epochs} epochs, 1 process; transformers "
        f"{transformers.__version__}, torch {torch.__version__}"
    )
    print(
        f"interrupted: SIGKILL before micro-batches {', '.join(map(str, kills))} of the run; a state after "
        "every optimizer step; each side against its own uninterrupted run"
    )
    print()
    hdr = (
        f"{'framework':<10} | {'augment':>7} | {'workers':>7} | {'kills':>5} | {'losses after resume':>22} | "
        f"{'final parameters':>22} | {'skipped':>7} | {'repeated':>8} | {'ids differ':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for fw, aug, w, c in rows:
        losses = "identical" if c["losses_identical"] else f"differ from mb {c['first_loss_diff']}"
        params = "bitwise equal" if c["bitwise"] else f"max diff {c['max_param_diff']:.2e}"
        print(
            f"{fw:<10} | {'yes' if aug else 'no':>7} | {w:>7} | {c['kills']:>5} | {losses:>22} | {params:>22} | "
            f"{c['skipped']:>7} | {c['repeated']:>8} | {c['ids_differ']:>10}"
        )
    print()
    print(
        "losses: every micro-batch's loss (float32) equal to the uninterrupted run's; 'differ from mb N': the "
        "first differing micro-batch of the run (the first resume is at mb 8). skipped/repeated: samples of an "
        "epoch missing / trained more often than in the uninterrupted epoch; ids differ: micro-batches whose "
        "sample ids differ from the uninterrupted run's at the same position."
    )
    print(f"wall time of this run: {time.perf_counter() - started:.0f} s")
    print()

    def exact(c: dict[str, Any]) -> bool:
        return c["losses_identical"] and c["bitwise"] and c["skipped"] == c["repeated"] == c["ids_differ"] == 0

    sp = [c for fw, _, _, c in rows if fw == "syncpoint"]
    sp_aug_workers = [c for fw, aug, w, c in rows if fw == "syncpoint" and aug and w > 0]
    ok = all(exact(c) for c in sp_aug_workers)
    print(
        f"goal syncpoint bitwise under augmentation + workers: {'yes' if ok else 'no'} vs target yes: "
        f"{'met' if ok else 'not met'}"
    )
    ok = all(exact(c) for c in sp)
    print(
        f"goal syncpoint bitwise in every cell ({len(sp)}): {'yes' if ok else 'no'} vs target yes: "
        f"{'met' if ok else 'not met'}"
    )
    hf_plain = [c for fw, aug, _, c in rows if fw == "hf" and not aug]
    hf_aug = [c for fw, aug, _, c in rows if fw == "hf" and aug]
    if hf_plain:
        ok = all(exact(c) for c in hf_plain)
        print(
            f"goal HF bitwise without augmentation (the expected peer result): {'yes' if ok else 'no'} vs target "
            f"yes: {'met' if ok else 'not met'}"
        )
    diverges = any(not exact(c) for c in hf_aug)
    print(
        f"goal HF diverges with augmentation (the expected peer result): {'yes' if diverges else 'no'} vs target "
        f"yes: {'met' if diverges else 'not met'}"
    )


if __name__ == "__main__":
    main()
