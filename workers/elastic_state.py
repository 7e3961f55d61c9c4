"""World-size-independent optimizer state for elastic runs ("gather on save").

DeepSpeed 0.19 refuses to load ZeRO-1/2 optimizer shards at another data-parallel degree (short
of the offline universal-checkpoint conversion). Elastic runs therefore also store, in every
state, the full fp32 master weights and optimizer moments per parameter, gathered with
DeepSpeed's public ``safe_get_full_*`` API and written by rank 0 as safetensors
(``optim/full.safetensors``). Loading at another world size puts them back with
``safe_set_full_*`` into the new partitions. Cost: one all-reduce per parameter and state key per
save, and the file is the size of the whole optimizer state (measured in bench/p2_save_cost.py
when elastic). ZeRO-0 needs none of this: its optimizer state is whole in DeepSpeed's own file.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from workers.rng import safetensors_metadata

FULL_STATE = "optim/full.safetensors"


def _base_optimizer(engine):  # noqa: ANN001, ANN202
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _state_keys(engine) -> list[str]:  # noqa: ANN001
    base = _base_optimizer(engine)
    for st in base.state.values():
        return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0)
    return []


def _step(engine) -> float:  # noqa: ANN001
    base = _base_optimizer(engine)
    for st in base.state.values():
        step = st.get("step")
        return float(step.item() if torch.is_tensor(step) else step or 0)
    return 0.0


def save_full_optimizer_state(engine, staging: str, rank: int) -> None:  # noqa: ANN001
    """All ranks (collectives); rank 0 writes ``<staging>/optim/full.safetensors``."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    keys = _state_keys(engine)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        tensors[f"{name}::fp32"] = safe_get_full_fp32_param(p).detach().cpu().contiguous()
        for key in keys:
            tensors[f"{name}::{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().contiguous()
    if rank == 0:
        os.makedirs(os.path.join(staging, "optim"), exist_ok=True)
        save_file(tensors, os.path.join(staging, FULL_STATE), metadata={"step": json.dumps(_step(engine)),
                                                                       "keys": json.dumps(keys)})


def load_full_optimizer_state(engine, data: bytes) -> None:  # noqa: ANN001
    """Every rank: scatter the full state into this world size's ZeRO partitions."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    tensors = st_load(data)
    header = safetensors_metadata(data)
    keys, step = json.loads(header["keys"]), json.loads(header["step"])
    opt, base = engine.optimizer, _base_optimizer(engine)
    for group in base.param_groups:  # torch creates optimizer state at the first step: create it now
        for flat in group["params"]:
            state = base.state[flat]
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
            for key in keys:
                state.setdefault(key, torch.zeros_like(flat, memory_format=torch.preserve_format))
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed maps each parameter to its optimizer-state fragments lazily, at the first step;
        # no step has run yet in a resumed attempt, so map them now (DeepSpeed-internal, ZeRO-1/2).
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        safe_set_full_fp32_param(p, tensors[f"{name}::fp32"])
        for key in keys:
            safe_set_full_optimizer_state(p, tensors[f"{name}::{key}"], key)
