"""World-size-independent optimizer state for elastic runs ("gather on save").

DeepSpeed 0.19 refuses to load ZeRO-1/2 optimizer shards at another data-parallel degree (short
of the offline universal-checkpoint conversion). Elastic runs therefore also store, in every
state, the full fp32 master weights and optimizer moments per parameter, gathered with
DeepSpeed's public ``safe_get_full_*`` API and written by rank 0 as safetensors
(``optim/full.safetensors``). Loading at another world size puts them back with
``safe_set_full_*`` into the new partitions. Cost: one all-reduce per parameter and state key per
save, and the file is the size of the whole optimizer state (measured in bench/p2_save_cost.py
when elastic). ZeRO-0 needs none of this: its optimizer state is whole in DeepSpeed's own file.

ZeRO-3 takes the same route (gathered, not converted): DeepSpeed 0.19's stage-3 load refuses
another data-parallel degree too, and its only converter is the offline universal checkpoint,
whose loader unpickles with ``weights_only=False`` (refused, ``syncpoint.workers.state.checkpoint_engine``).
``safe_get_full_*`` / ``safe_set_full_*`` work on stage-3 partitions (DeepSpeed's
``get_full_hp_param`` / ``set_full_hp_param``), so one file format serves stages 1-3 and a
resume needs no conversion step. The weights themselves come from DeepSpeed's module-only
load, which at ZeRO-3 syncpoint routes through the weights-only loader. The difference at stage
3 is where the optimizer keeps its per-partition state: the base optimizer's param groups are
empty between steps (DeepSpeed fills them only for a step or a load), and its state is keyed by
the flat fp32 partitions.

The base optimizer's param-group values travel in the file's metadata too (``groups``, rank 0's,
those JSON holds exactly): an optimizer that keeps running state in its groups (Prodigy's ``d``
and ``k``) continues from it after a resize, as after a same-size load, where DeepSpeed's own
files carry the groups; ``syncpoint.workers.training.param_groups`` then decides which of them the live run overrides.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from syncpoint.policies.contracts.state_format import FULL_OPTIMIZER_FILE, local_path, zero3_model_file
from syncpoint.workers.training.param_groups import portable_values
from syncpoint.workers.training.rng import safetensors_metadata

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def _base_optimizer(engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _state_keys(engine: DeepSpeedEngine) -> list[str]:
    base = _base_optimizer(engine)
    for st in base.state.values():
        return sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0)
    return []


def _step(engine: DeepSpeedEngine) -> float:
    base = _base_optimizer(engine)
    for st in base.state.values():
        step = st.get("step")
        return float(step.item() if torch.is_tensor(step) else step or 0)
    return 0.0


def save_full_optimizer_state(engine: DeepSpeedEngine, staging: str, rank: int) -> None:
    """All ranks (collectives); rank 0 writes ``<staging>/optim/full.safetensors``."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _relink_optimizer_state(engine)
    keys = _state_keys(engine)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        tensors[f"{name}::fp32"] = safe_get_full_fp32_param(p).detach().cpu().contiguous()
        for key in keys:
            tensors[f"{name}::{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().contiguous()
    if rank == 0:
        path = local_path(staging, FULL_OPTIMIZER_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        groups = [portable_values(g) for g in _base_optimizer(engine).param_groups]
        save_file(
            tensors,
            path,
            metadata={"step": json.dumps(_step(engine)), "keys": json.dumps(keys), "groups": json.dumps(groups)},
        )


def _relink_optimizer_state(engine: DeepSpeedEngine) -> None:
    """Map every parameter to its group's optimizer state again, now that every group has stepped.

    Why: DeepSpeed 0.19's ZeRO-1/2 ``_optimizer_step(group)`` links the fragments of *all* groups
    after the *first* group's step (``_lazy_init_hp_params_optimizer_state``, once), when the later
    groups' state is still empty; with several param groups ``safe_get_full_optimizer_state`` then
    finds no ``exp_avg`` for their parameters. Linking again is cheap (views into the flat state)
    and changes no tensor. DeepSpeed-internal, ZeRO-1/2 only (stage 3 reads its state directly)."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state") and getattr(opt, "_hp_optimizer_states_linked", False):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def load_full_optimizer_state(engine: DeepSpeedEngine, data: bytes) -> None:
    """Every rank: scatter the full state into this world size's ZeRO partitions."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    tensors = st_load(data)
    header = safetensors_metadata(data)
    keys, step = json.loads(header["keys"]), json.loads(header["step"])
    opt, base = engine.optimizer, _base_optimizer(engine)
    for group, values in zip(base.param_groups, json.loads(header.get("groups", "[]")), strict=False):
        group.update({k: v for k, v in values.items() if k != "params"})  # states before the field: none
    for flat in _partitions(engine):  # torch creates optimizer state at the first step: create it now
        state = base.state[flat]
        state["step"] = _step_value(base, step)
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


def prepare_resize(engine: DeepSpeedEngine, local_dir: str, rank: int) -> None:
    """ZeRO-3 at another world size: give this rank the model file DeepSpeed will look for.

    Why: DeepSpeed's module-only load reads ``zero_pp_rank_<this rank>_mp_rank_00_model_states.pt``;
    a state written by fewer ranks has none for the new ranks, so they would skip the load while
    rank 0 enters its gather collectives (a hang, or gloo's size mismatch). At stage 3 that file's
    module part is placeholders and shapes, the same on every rank (the weights come from the
    partitions, consolidated weights-only), so rank 0's serves. Only this rank's fetched copy
    changes, after its checksums were verified; storage is untouched. Call before the load.
    """
    if int(engine.zero_optimization_stage()) != 3:
        return
    mine = local_path(local_dir, zero3_model_file(rank))
    if not os.path.exists(mine):
        shutil.copyfile(local_path(local_dir, zero3_model_file(0)), mine)


def _partitions(engine: DeepSpeedEngine) -> list[torch.Tensor]:
    """The tensors the base optimizer keys its state by: its param groups' params at ZeRO 1/2, the
    flat fp32 partitions at ZeRO-3 (whose param groups are empty between steps)."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is not None:
        return list(flats)
    return [flat for group in _base_optimizer(engine).param_groups for flat in group["params"]]


def _step_value(base: torch.optim.Optimizer, step: float) -> int | torch.Tensor:
    """Each optimizer's own type for ``step``: torch's Adam a float32 tensor, DeepSpeed's CPU Adam
    (optimizer offload) a plain int it passes to its C++ kernel."""
    if type(base).__name__ == "DeepSpeedCPUAdam":
        return int(step)
    return torch.tensor(float(step), dtype=torch.float32)


def check_full_optimizer_state(engine: DeepSpeedEngine, path: str) -> None:
    """Refuse (``StateRefused``) a gathered full state that does not fit this model, before any of
    the state is loaded: ``load_full_optimizer_state`` runs after DeepSpeed already loaded the
    weights, so a missing tensor or a wrong shape found there would leave a half-loaded engine.
    Reads only the safetensors header (names, shapes, metadata)."""
    from syncpoint.policies.contracts.errors import StateRefused

    problem = _full_state_problem(engine, path)
    if problem:
        raise StateRefused(f"{FULL_OPTIMIZER_FILE}: {problem}: refused (corrupt)")


def _full_state_problem(engine: DeepSpeedEngine, path: str) -> str | None:
    """Why the file cannot be scattered into this engine (one phrase), or None when it can."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            keys, step = json.loads(meta["keys"]), json.loads(meta["step"])
            groups = json.loads(meta.get("groups", "[]"))
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except FileNotFoundError:
        return "missing, though this elastic resume needs it"
    except (KeyError, ValueError, TypeError, SafetensorError) as e:
        return f"not a safetensors file with keys and step in its metadata ({type(e).__name__}: {e})"
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)) or not isinstance(step, (int, float)):
        return "its metadata names no list of state keys and no numeric step"
    if not (isinstance(groups, list) and all(isinstance(g, dict) for g in groups)) or (
        groups and len(groups) != len(_base_optimizer(engine).param_groups)
    ):
        return "its metadata's param groups are not one object per param group of this optimizer"
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        for key in ("fp32", *keys):
            got = shapes.get(f"{name}::{key}")
            want = tuple(getattr(p, "ds_shape", p.shape))
            if got != want:
                return f"{name}::{key} is {'missing' if got is None else f'shaped {got}'}, this model needs {want}"
    return None
