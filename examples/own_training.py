"""The tiny language model with your own training around it: user state, a callback, MLflow.

* **User state** (``Task.stateful``): an exponential moving average of the weights
  (``torch.optim.swa_utils.AveragedModel``), updated every micro-step, and a loss-spike watch whose
  running mean decides how much of each micro-batch's loss counts. Both are saved per rank with
  every state and restored exactly, so a resumed run is the uninterrupted one, EMA included.
* **A callback** (``Task.callbacks``): every ``sample_every`` (8) optimizer steps rank 0 prints text sampled from the
  model (a random draw, shielded by syncpoint so it moves nothing), and after each evaluation the
  EMA's loss on the first evaluation batch beside the model's.
* **MLflow** (``train.report_to`` in ``own_training.yaml``): metrics at the optimizer step, one
  MLflow run across every attempt, in ``<run>/mlruns`` by default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.tiny_lm import build as build_tiny_lm
from examples.tiny_lm import lm_loss
from syncpoint import Task


class SpikeWatch:
    """A running mean of the loss; a micro-batch whose loss is far above it counts half (state the
    loss reads and updates every micro-step: without an exact restore a resume would differ)."""

    def __init__(self) -> None:
        self.mean = torch.zeros(())
        self.seen = 0

    def weight(self, loss: torch.Tensor) -> float:
        spike = self.seen > 10 and float(loss) > 1.5 * float(self.mean)
        self.mean = 0.95 * self.mean + 0.05 * loss.detach() if self.seen else loss.detach().clone()
        self.seen += 1
        return 0.5 if spike else 1.0

    def state_dict(self) -> dict:
        return {"mean": self.mean.clone(), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.seen = state["mean"].clone(), int(state["seen"])


class SampleAndCompare:
    """Rank 0 prints sampled text every ``every`` steps and, after each evaluation, the EMA's loss
    (to stdout, or appended to the file ``samples_to`` when it is set)."""

    def __init__(
        self, ema: torch.optim.swa_utils.AveragedModel, probe: torch.Tensor, every: int, samples_to: str | None
    ) -> None:
        self.ema, self.probe, self.every, self.samples_to = ema, probe, every, samples_to
        self.rank = dist.get_rank() if dist.is_initialized() else 0  # the task is built inside the process group

    def say(self, line: str) -> None:
        if self.samples_to:
            with open(self.samples_to, "a") as f:
                f.write(line + "\n")
        else:
            print(line, flush=True)

    def on_step(self, info, model) -> None:
        if self.rank != 0 or info.optimizer_step % self.every:
            return
        tokens = self.probe[:1, :8].clone()
        for _ in range(16):  # sampling draws from torch's RNG: syncpoint puts it back after the call
            logits = model(tokens[:, -model.pos.shape[0] :])[:, -1]
            tokens = torch.cat([tokens, torch.multinomial(F.softmax(logits, -1), 1)], dim=1)
        text = "".join(" " if t == 0 else chr(96 + int(t)) if int(t) < 27 else "?" for t in tokens[0])
        self.say(f"[example] step {info.optimizer_step}: {text!r}")

    def on_evaluate(self, metrics) -> None:
        if self.rank != 0:
            return
        ema_loss = float(lm_loss(self.ema.module, self.probe))
        self.say(f"[example] eval_loss {metrics.get('eval_loss', float('nan')):.4f}, EMA {ema_loss:.4f}")


def build(config: dict) -> Task:
    task = build_tiny_lm(config)
    ema = torch.optim.swa_utils.AveragedModel(task.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.99))
    watch = SpikeWatch()

    def loss(model, batch: torch.Tensor) -> torch.Tensor:
        value = lm_loss(model, batch)
        ema.update_parameters(task.model)
        return value * watch.weight(value)

    probe = torch.stack([task.eval_dataset[i] for i in range(4)]) if task.eval_dataset is not None else None
    every, samples_to = int(config.get("sample_every", 8)), config.get("samples_to")
    callbacks = [SampleAndCompare(ema, probe, every, samples_to)] if probe is not None else []
    return Task(
        model=task.model,
        dataset=task.dataset,
        loss=loss,
        eval_dataset=task.eval_dataset,
        stateful={"ema": ema, "spike_watch": watch},
        callbacks=callbacks,
    )
