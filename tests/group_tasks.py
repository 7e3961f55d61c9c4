"""Tasks with their own optimizer (``Task.optimizer``) and custom schedules, loaded by import path in tests."""

from __future__ import annotations

import math

import torch

from examples.tiny_lm import build
from syncpoint.workers.task import Task


def _two_groups(config: dict):
    """Embeddings (token and position) in one group, everything else in another, each with its own
    lr and weight decay (``task.config`` sets them, so a test can edit them between attempts)."""

    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        embed = [p for n, p in model.named_parameters() if n.startswith(("embed.", "pos"))]
        rest = [p for n, p in model.named_parameters() if not n.startswith(("embed.", "pos"))]
        groups = [
            {
                "params": embed,
                "lr": float(config.get("embed_lr", 2e-3)),
                "weight_decay": float(config.get("embed_wd", 0.1)),
            },
            {
                "params": rest,
                "lr": float(config.get("rest_lr", 5e-4)),
                "weight_decay": float(config.get("rest_wd", 0.0)),
            },
        ]
        if config.get("optimizer") == "cpu_adam":  # DeepSpeed's CPU Adam, other betas per group
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            groups[1]["betas"] = (0.8, 0.95)
            return DeepSpeedCPUAdam(groups, lr=1e-3, adamw_mode=True)
        return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))

    return make


def lm_two_groups(config: dict) -> Task:
    """``task.config.own_optimizer: false``: the same task with the spec's built-in optimizer."""
    task = build(config)
    if config.get("own_optimizer", True):
        task.optimizer = _two_groups(config)
    return task


def lm_returns_no_optimizer(config: dict) -> Task:
    task = build(config)
    task.optimizer = lambda model: "adamw"  # type: ignore[assignment,return-value]
    return task


# ---------------------------------------------------------------- custom schedules (train.scheduler.path)


def half_then_quarter(position: int, total: int) -> float:
    """A warmup of two units, then 1/2 for the first half of the horizon and 1/4 after."""
    if position < 2:
        return (position + 1) / 2
    return 0.5 if position < total // 2 else 0.25


def not_finite(position: int, total: int) -> float:
    return math.nan if position >= 1 else 1.0


NOT_A_FUNCTION = 3
