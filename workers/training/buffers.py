"""Every rank's module buffers, saved and restored per rank (safetensors, never pickle).

Why per rank: DeepSpeed broadcasts buffers once, when the engine is built, and never syncs them
again, so each rank's BatchNorm running statistics (or any buffer a forward updates) follow its
own samples. DeepSpeed's ZeRO 0-2 module file is rank 0's alone: resumed from it, every rank
would carry on with rank 0's buffers. Every rank therefore writes
``buffers/rank_<r:05d>.safetensors`` at every save and applies its own after DeepSpeed's load.

All of ``named_buffers()``, persistent and non-persistent: a buffer left out of ``state_dict`` is
often a constant (a causal mask, a rotary table), but one that training changes is state all the
same, and saving a constant costs only its bytes. ZeRO-3's per-rank model files already hold each
rank's own persistent buffers; the file is written there too, so every stage has one mechanism and
non-persistent buffers are covered at every stage.

On another world size rank ``r`` takes the buffers of saved rank ``r mod saved world size``
(:func:`source_rank`): at the same world size that is its own, and every rank keeps buffers some
rank really trained with, never an average no run ever had.
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from syncpoint.policies.contracts.errors import StateMismatch, StateRefused


def capture(module: torch.nn.Module) -> bytes:
    """This rank's buffers at a boundary, copied to the host (small: statistics, counters, masks)."""
    tensors = {name: b.detach().cpu().clone().contiguous() for name, b in module.named_buffers()}
    return st_save(tensors)


def source_rank(rank: int, saved_world_size: int) -> int:
    """Whose saved buffers this rank applies (module docstring)."""
    return rank % saved_world_size


def read(data: bytes, rel: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A verified buffers file's tensors: refused (``StateRefused``) unless it is a safetensors file,
    ``StateMismatch`` unless it holds exactly this module's buffers, each with its name, shape and
    dtype (the state is then intact but incompatible); called before the
    engine is touched, so a refusal falls back to the next candidate with nothing half-loaded."""
    try:
        saved = st_load(data)
    except SafetensorError as e:
        raise StateRefused(f"{rel}: not a safetensors file ({e}): refused (corrupt)") from None
    problem = _mismatch(saved, dict(module.named_buffers()))
    if problem:
        raise StateMismatch(f"{rel}: {problem} (the state's model has other buffers than this job's model)")
    return saved


def _mismatch(saved: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> str | None:
    """The first difference between the saved buffers and the live module's, or None."""
    missing, extra = sorted(live.keys() - saved.keys()), sorted(saved.keys() - live.keys())
    if missing or extra:
        return f"buffers missing {missing[:5]}, not in this model {extra[:5]}"
    for name in sorted(live):
        have, want = saved[name], live[name]
        if have.shape != want.shape or have.dtype != want.dtype:
            return (
                f"buffer {name} is {have.dtype} {tuple(have.shape)}, this model's is {want.dtype} {tuple(want.shape)}"
            )
    return None


def apply(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy the saved values into the live buffers (checked by :func:`read`), on their device."""
    live = dict(module.named_buffers())
    with torch.no_grad():
        for name, tensor in saved.items():
            live[name].copy_(tensor)
