"""A ZeRO-3 state's whole model, put together from its per-rank files: the one reconstruction the
export, ``syncpoint digest`` and the weights-only ZeRO-3 module load all use.

Why a module of its own: the checkpoint engine (which the reader installs) and the export (which
reads through the reader) both need it; beside either, it closed an import cycle.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from syncpoint.policies.contracts.state_format import ZERO3_MODEL, ZERO_OPTIM


def consolidate_zero3(names: list[str], load: Callable[[str], Any]) -> dict[str, torch.Tensor]:
    """Whole parameters (in the model's dtype) and buffers from a ZeRO-3 state's per-rank files.

    ``names`` are the state's file names, ``load(rel)`` returns one file's unpickled content. The
    layout (DeepSpeed 0.19, as its ``zero_to_fp32`` reads it): parameter by parameter in
    ``param_shapes`` order, rank r's flat fp32 group holds elements ``[r*p, (r+1)*p)`` of each,
    ``p = ceil(numel / world)``, the last partition zero-padded. Frozen parameters are stored the
    same way in each model file's ``frozen_param_fragments``.
    """
    flats = [
        torch.cat(list(sd["optimizer_state_dict"]["fp32_flat_groups"])) for sd in _by_rank(names, ZERO_OPTIM, load)
    ]
    # the optimizer shards say how many ranks wrote the state; a resize may have added model files
    # for more ranks to a fetched copy (syncpoint.workers.state.elastic_state.prepare_resize), which are not read
    models = _by_rank(names, ZERO3_MODEL, load, limit=len(flats))
    if not models or len(models) != len(flats):
        raise ValueError(
            f"a ZeRO-3 state needs one model and one optimizer file per rank; found {len(models)} and {len(flats)}"
        )
    world, first = len(models), models[0]
    full: dict[str, torch.Tensor] = {}
    offset = 0
    for shapes in first["param_shapes"]:
        for name, shape in shapes.items():
            numel, part = _numel(shape), -(-_numel(shape) // world)
            full[name] = torch.cat([f.narrow(0, offset, part) for f in flats]).narrow(0, 0, numel).view(tuple(shape))
            offset += part
    for name, shape in (first.get("frozen_param_shapes") or {}).items():
        frags = [m["frozen_param_fragments"][name] for m in models]
        full[name] = torch.cat(frags).narrow(0, 0, _numel(shape)).view(tuple(shape))
    for name, source in (first.get("shared_params") or {}).items():
        full[name] = full[source]
    return _in_module_order(first["module"], full)


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _by_rank(
    names: list[str], pattern: re.Pattern[str], load: Callable[[str], Any], limit: int | None = None
) -> list[Any]:
    found = sorted((int(m.group(1)), rel) for rel in names if (m := pattern.match(rel)))
    if limit is not None:
        found = [(r, rel) for r, rel in found if r < limit]
    if [r for r, _ in found] != list(range(len(found))):
        raise ValueError(f"ZeRO-3 files are not one per rank 0..n-1: {[rel for _, rel in found]}")
    return [load(rel) for _, rel in found]


def _in_module_order(module: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's keys in its order: parameters gathered (cast to the placeholder's dtype, i.e.
    bf16 in bf16 runs, as DeepSpeed casts its fp32 master partitions), buffers as saved (whole)."""
    out: dict[str, torch.Tensor] = OrderedDict()
    for key, t in module.items():
        src = full[key].to(t.dtype) if key in full else t
        out[key] = src.detach().cpu().clone().contiguous()
    for key in full.keys() - out.keys():
        out[key] = full[key].detach().cpu().clone().contiguous()
    return out
