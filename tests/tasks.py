"""Tiny tasks for tests: fast enough for thousands of micro-steps on one CPU rank."""

from __future__ import annotations

import numpy as np
import torch

from syncpoint.workers.task import Task


class Vectors(torch.utils.data.Dataset):
    """Fixed vectors (from ``seed``) and their sums; ``augment``: random noise added per fetch."""

    def __init__(self, n: int, dim: int = 4, *, seed: int = 99, augment: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if not self.augment:
            return self.x[i], self.y[i]
        return self.x[i] + 0.01 * torch.randn(self.x.shape[1]), self.y[i]  # random augmentation


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def linear(config: dict) -> Task:
    dim = int(config.get("dim", 4))
    model = torch.nn.Sequential(
        torch.nn.Linear(dim, 8), torch.nn.Dropout(float(config.get("dropout", 0.1))), torch.nn.Linear(8, 1)
    )
    return Task(model=model, dataset=Vectors(int(config.get("num_samples", 64)), dim), loss=mse)


def failing_loss(config: dict) -> Task:
    """The loss raises at a chosen global call count: an application error, not a preemption."""
    task = linear(config)
    calls = {"n": 0}
    fail_at = int(config["fail_at"])

    def loss(model, batch):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise ValueError(f"bad batch at call {fail_at}")
        return mse(model, batch)

    task.loss = loss
    return task


class LastStateOnly:
    """A custom resume policy loaded by import path in tests: resume only from a chosen name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def choose(self, candidates, spec):
        from syncpoint.policies.decisions.resume import Decision

        return Decision(self.name, "custom policy says so")


class EveryFifthMicroStep:
    """A custom save trigger loaded by import path: requests at micro-steps 5, 10, 15, ..."""

    def wants_save(self, tick) -> bool:
        return tick.global_micro_step % 5 == 0


def noisy_collate(samples):
    """A collate that draws randomness per batch (random masking/mixing in real tasks)."""
    xs, ys = zip(*samples, strict=True)
    x = torch.stack(xs)
    return x + 0.05 * torch.randn_like(x), torch.stack(ys)


def linear_random_collate(config: dict) -> Task:
    task = linear(config)
    task.collate = noisy_collate
    return task


def paced_lm(config: dict) -> Task:
    """The example's model and data with a pause before every micro-batch's loss (``pace_s``), or
    held at its first micro-batch until a file exists (``hold_until``).

    Why: tests that must act while a run trains (a drain notice, a second submission) need a run
    that lasts in wall time; a pause costs no CPU, where thousands of extra micro-steps cost the
    other tests theirs. Numerics are the example's: a reference run of ``examples.tiny_lm:build``
    with the same config ends at the same digest.
    """
    import os
    import time

    from examples.tiny_lm import build

    pace, hold = float(config.get("pace_s", 0.0)), config.get("hold_until")
    _record_env(config)
    task = build(config)
    inner = task.loss

    def loss(model, batch):
        # ``hold_until``: the first micro-batch waits (at most 10 min) until the test creates that file
        deadline = time.monotonic() + 600
        while hold and not os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(pace)
        return inner(model, batch)

    task.loss = loss
    return task


def _record_env(config: dict) -> None:
    """``record_env: {to: DIR, names: [...]}``: this rank's values of those variables, as its process
    sees them, written to ``DIR/<pid>.json`` (what a test of ``scaling.env`` reads back)."""
    import json
    import os

    probe = config.get("record_env")
    if probe:
        seen = {name: os.environ.get(name) for name in probe["names"]}
        with open(os.path.join(probe["to"], f"{os.getpid()}.json"), "w") as f:
            json.dump(seen, f)


def CleanVectors(n: int, dim: int = 4) -> Vectors:
    """An eval set without augmentation (a reference computed by hand needs no seeding)."""
    return Vectors(n, dim, seed=1234, augment=False)


def per_sample_metrics(model, batch):
    """A batch mean (0-d) and per-sample values (1-d) of the same errors: both must average exactly."""
    x, y = batch
    err = (model(x) - y).squeeze(1)
    return {"mse": (err**2).mean(), "abs_err": err.abs()}


def linear_eval(config: dict) -> Task:
    """linear with an eval set (``eval_samples``, default 7: uneven batches and shards) and, with
    ``metrics: per_sample``, two metrics; ``eval_noise``: an augmented eval set (random per fetch)."""
    task = linear(config)
    n = int(config.get("eval_samples", 7))
    task.eval_dataset = (
        Vectors(n, int(config.get("dim", 4)))
        if config.get("eval_noise")
        else CleanVectors(n, int(config.get("dim", 4)))
    )
    kind = config.get("metrics", "default")
    if kind == "per_sample":
        task.metrics = per_sample_metrics
    elif kind == "float":
        task.metrics = lambda model, batch: {"loss": float(mse(model, batch))}
    elif kind == "nan":
        task.metrics = lambda model, batch: {"loss": mse(model, batch) * float("nan")}
    elif kind == "matrix":
        task.metrics = lambda model, batch: {"out": model(batch[0])}
    elif kind == "list":
        task.metrics = lambda model, batch: [mse(model, batch)]
    return task


class RunningCenter(torch.nn.Module):
    """Subtracts a running mean of its input: a buffer that a training forward both updates and
    reads, kept out of ``state_dict`` (non-persistent), as a model's own running statistics may be."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(dim), persistent=False)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.center.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.center


class BufferNet(torch.nn.Module):
    """BatchNorm (persistent running statistics) and a RunningCenter; each rank sees other samples,
    so every rank's buffers differ. ``dump``: a directory where the first forward of each process
    writes the buffers it starts from (``rank_<r>.safetensors``): what a resume gave that rank."""

    def __init__(self, dim: int, dump: str | None) -> None:
        super().__init__()
        # every parameter's size even: ZeRO-3 pads odd ones per rank with uninitialized memory, which
        # the digest of the optimizer shards would see
        self.body = torch.nn.Sequential(
            torch.nn.Linear(dim, 8), torch.nn.BatchNorm1d(8), RunningCenter(8), torch.nn.Linear(8, 1, bias=False)
        )
        self.dump = dump

    def forward(self, x):
        if self.dump:
            import os

            from safetensors.torch import save_file

            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            save_file(
                {n: b.detach().cpu().clone() for n, b in self.named_buffers()},
                os.path.join(self.dump, f"rank_{rank}.safetensors"),
            )
            self.dump = None
        return self.body(x)


def buffer_net(config: dict) -> Task:
    dim = int(config.get("dim", 4))
    return Task(
        model=BufferNet(dim, config.get("dump")), dataset=Vectors(int(config.get("num_samples", 32)), dim), loss=mse
    )


class GrowingSteps(torch.optim.Optimizer):
    """An optimizer that keeps running state in its param groups, as Prodigy does: ``d`` (an
    adapted step size, in the constructor's defaults like Prodigy's) grows every step, ``k``
    counts the steps, and ``norm`` (the last gradient norm) appears at the first step, absent at
    build. The update uses all three, so a resume that resets any of them changes the weights."""

    def __init__(
        self, params, lr: float = 0.01, weight_decay: float = 0.0, d0: float = 1.0, growth: float = 1.05
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "d": d0, "d0": d0, "k": 0, "growth": growth})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            k, d, last = group["k"], group["d"], group.get("norm", 1.0)
            total = 0.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                total += float(p.grad.norm())
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(p.grad, alpha=-group["lr"] * d / (1 + k) ** 0.5 / (1.0 + last))
            group["d"], group["k"], group["norm"] = d * group["growth"], k + 1, total


def linear_running_groups(config: dict) -> Task:
    """linear with ``GrowingSteps`` (``optimizer: prodigy``: the real Prodigy); ``weight_decay`` and
    ``d0`` from ``task.config``, so a test can edit them between attempts."""
    task = linear(config)
    wd, d0 = float(config.get("weight_decay", 0.01)), float(config.get("d0", 1.0))
    if config.get("optimizer") == "prodigy":
        from prodigyopt import Prodigy

        task.optimizer = lambda model: Prodigy(model.parameters(), lr=1.0, weight_decay=wd, d0=d0 * 1e-3)
    else:
        task.optimizer = lambda model: GrowingSteps(model.parameters(), weight_decay=wd, d0=d0)
    return task


COUNTERS = ("micro_steps", "global_steps", "global_samples", "skipped_steps")


def linear_counters(config: dict) -> Task:
    """linear whose loss reads DeepSpeed's step counters (a curriculum or warm-up would): a resume
    that leaves any of them elsewhere than the uninterrupted run has it changes every later loss.
    ``starts_at_zero``: the first micro-batch's loss refuses counters other than 0."""
    task = linear(config)
    first = {"call": bool(config.get("starts_at_zero"))}  # a fresh position: every counter must read 0

    def loss(model, batch):
        c = [float(getattr(model, name)) for name in COUNTERS]
        if first.pop("call", False) and any(c):
            seen = dict(zip(COUNTERS, c, strict=True))
            raise AssertionError(f"DeepSpeed's counters at the first micro-batch: {seen}")
        return mse(model, batch) * (1 + 1e-3 * c[0] + 1e-2 * c[1] + 1e-4 * c[2] + c[3])

    task.loss = loss
    return task


class RunningMean(torch.nn.Module):
    """Passes its input through and keeps a running mean of it in a buffer of ``size`` entries
    (a BatchNorm's statistics, shaped by the config and not by any parameter)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(size))
        self.register_buffer("scratch", torch.zeros(size), persistent=False)  # rebuilt, never saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean())
        return x


def linear_stats(config: dict) -> Task:
    """linear with a ``RunningMean`` buffer of ``stats`` entries (``task.config.stats``, default 16)."""
    task = linear(config)
    task.model = torch.nn.Sequential(*task.model, RunningMean(int(config.get("stats", 16))))
    return task


def unreduced_loss(config: dict) -> Task:
    """A loss left per sample (shape (batch, 1)): the mistake of a missing reduction."""
    task = linear(config)

    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y, reduction="none")

    task.loss = loss
    return task


def diverging_loss(config: dict) -> Task:
    """The loss turns NaN from a chosen global call on (a learning rate too high, a log of 0)."""
    task = linear(config)
    calls = {"n": 0}
    nan_from = int(config["nan_from"])

    def loss(model, batch):
        calls["n"] += 1
        value = mse(model, batch)
        return value * float("nan") if calls["n"] >= nan_from else value

    task.loss = loss
    return task


class LossScale:
    """User state the trajectory depends on: the loss is scaled by an EMA of past losses, updated
    every micro-step, differently on every rank (a rank-dependent step count), with plain data
    beside the tensor (a curriculum-like dict). Not an engine object: only ``Task.stateful`` saves it."""

    def __init__(self, rank: int) -> None:
        self.scale = torch.ones(())
        self.rank = rank
        self.seen = {"micro_steps": 0, "history": [0.0, 0.0]}

    def update(self, loss: torch.Tensor) -> None:
        self.scale = 0.9 * self.scale + 0.1 * (1 + loss.detach()) + 0.01 * self.rank
        self.seen["micro_steps"] += 1
        self.seen["history"] = [self.seen["history"][1], float(loss.detach())]

    def state_dict(self) -> dict:
        return {"scale": self.scale.clone(), "seen": {**self.seen, "history": list(self.seen["history"])}}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"].clone()
        self.seen = {**state["seen"], "history": list(state["seen"]["history"])}


def linear_user_state(config: dict) -> Task:
    """The linear task whose loss reads and updates user state every micro-step (``LossScale``), and an
    EMA of the weights (``torch.optim.swa_utils.AveragedModel``) updated each micro-step too."""
    import torch.distributed as dist

    task = linear(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    scale = LossScale(rank)
    ema = torch.optim.swa_utils.AveragedModel(task.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))

    def scaled_mse(model, batch):
        loss = mse(model, batch) * scale.scale
        scale.update(loss)
        ema.update_parameters(task.model)
        return loss

    names = config.get("names", ["ema", "scale"])
    objects = {"scale": scale, "ema": ema}
    return Task(model=task.model, dataset=task.dataset, loss=scaled_mse, stateful={n: objects[n] for n in names})


class NumpyRng:
    """A task's own NumPy generator as user state: ``state_dict`` is ``rng.bit_generator.state`` as NumPy
    gives it (PCG64: two 128-bit integers), ``extra`` a value added beside it (a test's too-large integer)."""

    def __init__(self, seed: int, extra: dict | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.extra = extra or {}

    def state_dict(self) -> dict:
        return {**self.rng.bit_generator.state, **self.extra}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = {k: v for k, v in state.items() if k not in self.extra}


def linear_numpy_rng(config: dict) -> Task:
    """The linear task whose loss is scaled by a draw of the task's own NumPy generator every micro-step
    (``Task.stateful = {"rng": ...}``): a resume is exact only if the generator's state is restored.
    ``config["huge_int"]``: the state also holds 10**301, more digits than a state can hold."""
    task = linear(config)
    holder = NumpyRng(1, {"huge": 10**301} if config.get("huge_int") else None)

    def loss(model, batch):
        return mse(model, batch) * float(1.0 + holder.rng.random())

    return Task(model=task.model, dataset=task.dataset, loss=loss, stateful={"rng": holder})


class RecordingCallback:
    """Writes one JSON line per hook call to ``<log_dir>/rank_<r>.jsonl``, and draws from every global
    RNG in every hook (a callback that samples): syncpoint's shield must keep training unmoved."""

    def __init__(self, log_dir: str, raise_in: str | None = None) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.path = f"{log_dir}/rank_{self.rank}.jsonl"
        self.raise_in = raise_in

    def _record(self, hook: str, **fields) -> None:
        import json
        import random

        import numpy as np

        torch.rand(3), np.random.rand(2), random.random()  # draws the shield must undo
        if hook == self.raise_in:
            raise ValueError(f"the callback's own bug in {hook}")
        with open(self.path, "a") as f:
            f.write(json.dumps({"hook": hook, **fields}) + "\n")

    def on_start(self, info) -> None:
        self._record("on_start", attempt=info.attempt, resumed_from=info.resumed_from, step=info.optimizer_step)

    def on_step(self, info, model) -> None:
        norm = float(sum(p.norm() for p in model.parameters()))
        self._record("on_step", step=info.optimizer_step, loss=info.loss, grad=torch.is_grad_enabled(), norm=norm)

    def on_log(self, record) -> None:
        self._record("on_log", step=record["optimizer_step"])

    def on_evaluate(self, metrics) -> None:
        self._record("on_evaluate", metrics=sorted(metrics))

    def on_state_committed(self, state, reasons) -> None:
        self._record("on_state_committed", state=state, reasons=reasons)

    def on_end(self, info) -> None:
        self._record("on_end", final_state=info.final_state, step=info.optimizer_step)


def linear_callbacks(config: dict) -> Task:
    """The linear task with dropout and augmentation (training draws randomness every micro-step),
    an evaluation set, and ``RecordingCallback`` when ``config.log_dir`` is set."""
    task = linear_eval(config)
    if config.get("log_dir"):
        task.callbacks = [RecordingCallback(str(config["log_dir"]), config.get("raise_in"))]
    return task


def loud_failing(config: dict) -> Task:
    """``failing_loss`` that prints as a user's task does (while it is built, on every rank)."""
    task = failing_loss(config)
    print(f"task built: {sum(p.numel() for p in task.model.parameters())} parameters", flush=True)
    return task
