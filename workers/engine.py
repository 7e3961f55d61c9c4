"""Build the DeepSpeed engine from the spec (DeepSpeed itself is the engine, on CPU via gloo)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from orchestrator.spec import JobSpec


def deepspeed_config(spec: JobSpec, grad_accum: int | None = None) -> dict[str, Any]:
    t, d = spec.train, spec.deepspeed
    zero: dict[str, Any] = {"stage": d.zero_stage}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum or t.grad_accum,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "gradient_clipping": t.gradient_clipping,
        "bf16": {"enabled": d.precision == "bf16"},
        "fp16": {"enabled": d.precision == "fp16"},
    }
    cfg.update(d.config)
    return cfg


def make_optimizer(spec: JobSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    o, lr = spec.train.optimizer, spec.train.lr
    params = [p for p in model.parameters() if p.requires_grad]
    if o.type == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.type == "adam":
        return torch.optim.Adam(params, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)


def build_engine(spec: JobSpec, model: torch.nn.Module, grad_accum: int | None = None):
    import deepspeed

    optimizer = make_optimizer(spec, model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(spec, grad_accum),
                                           dist_init_required=False)
    return engine


def model_fingerprint(model: torch.nn.Module) -> str:
    """Names, shapes and dtypes of every parameter: what a state must match to load exactly."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.requires_grad};".encode())
    return h.hexdigest()[:16]


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
