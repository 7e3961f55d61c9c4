"""A canonical sha256 of a state: parameters, optimizer state, scheduler and data position, and every
rank's file of each per-rank part, each part under its own key as ``syncpoint.workers.state.rank_parts``
says: the RNG, module buffers (fed rank by rank, so two states that differ only in rank 1's BatchNorm
statistics digest differently), a stream's position (its pass, its loader's state and shuffle buffer,
less where an exhausted pass left its inner dataset: ``syncpoint.workers.data.stream_state.settled_stream``)
and the ``Task.stateful`` objects. A state without a part has no such key and digests as it always did.

Independent of file layout and timestamps, so two runs (an uninterrupted one and a resumed one)
can be compared with one string. DeepSpeed's files are loaded with ``weights_only=True`` and the
one allowlist of the plain DeepSpeed classes they contain (``syncpoint.workers.integrity.safe_load``), after their
checksum matched the manifest; nothing is unpickled blindly. The manifest and ``trainer.json`` are
parsed with the state format's models before any file is read (every manifest name checked with
``syncpoint.policies.contracts.state_paths``), so a manifest cannot make ``digest`` read outside the state
(``engine/../../other-run/...``).

Why every failure is one refusal: ``digest`` reads what loading reads, from storage that may be
hostile, and must meet the same bounds (``syncpoint.workers.integrity.safe_load``: no meta tensors, no expanded views,
no unbounded nesting or allocation; JSON within ``syncpoint.policies.contracts.bounded_json``'s bounds). Whatever the
state's bytes make fail is ``StateRefused`` with one line; ``OSError`` is the storage failing,
``FileNotFoundError`` a state that is not there. Every read is bounded (the manifest by its cap, each
file by its listed size) and, locally, never through a link nor of anything but a regular file
(``syncpoint.workers.state.reader.read_listed``).
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from pydantic import ValidationError

from syncpoint.policies.contracts.bounded_json import BoundedJsonError, loads_bounded
from syncpoint.policies.contracts.errors import StateRefused
from syncpoint.policies.contracts.state_format import (
    MODEL_FILE,
    TRAINER_FILE,
    ZERO3_MODEL,
    ZERO_OPTIM,
    ManifestEntry,
    TrainState,
    problem_of,
)
from syncpoint.policies.decisions.redact import redact_url
from syncpoint.workers.data.stream_state import settled_stream as settled_stream  # where it was first
from syncpoint.workers.integrity.safe_load import load_state_file
from syncpoint.workers.state.rank_parts import PARTS
from syncpoint.workers.state.reader import ChecksumMismatch, read_listed, read_manifest
from syncpoint.workers.state.zero3_consolidate import consolidate_zero3
from syncpoint.workers.storage import RunStorage

ReadFile = Callable[[str], bytes]  # a state's file by its path in the state, verified against the manifest

# The digest covers where training stands, not who wrote it or when: run names, attempts, times and
# save reasons are left out so a drill's two differently named runs compare equal.
POSITION_KEYS = (
    "epoch",
    "position_in_epoch",
    "global_micro_step",
    "optimizer_step",
    "grad_accum",
    "micro_batches_per_epoch",
    "micro_batch_size",
    "world_size",
    "seed",
    "scheduler",
    "data",
)
SKIPPED_KEYS = {"ds_config", "ds_version"}
MAX_JSON_BYTES = 32 << 20  # manifest.json and trainer.json: kilobytes for any state syncpoint writes
MAX_JSON_DEPTH = 32


def load_deepspeed_file(data: bytes, name: str = "DeepSpeed state file") -> Any:
    """A DeepSpeed file's contents, weights-only (``StateRefused`` names a disallowed class)."""
    return load_state_file(data, name, map_location="cpu")


class CanonicalHash:
    """A SHA-256 over values in a canonical form (tensors by dtype, shape and bytes; mappings sorted)."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def feed(self, obj: Any) -> None:
        h = self.h
        if isinstance(obj, torch.Tensor):
            self._tensor(obj)
        elif isinstance(obj, dict):
            self._mapping(obj)
        elif isinstance(obj, (list, tuple)):
            h.update(b"[")
            for v in obj:
                self.feed(v)
            h.update(b"]")
        elif isinstance(obj, enum.Enum):
            h.update(f"E{obj.name}".encode())
        elif obj is None or isinstance(obj, (bool, int, float, str)):
            h.update(repr(obj).encode())
        else:
            self._other(obj)

    def _tensor(self, obj: torch.Tensor) -> None:
        t = obj.detach().cpu().contiguous()
        self.h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        raw = t.reshape(-1).view(torch.uint8)
        self.h.update(raw.numpy().tobytes() if t.numel() else b"")

    def _mapping(self, obj: dict[Any, Any]) -> None:
        self.h.update(b"{")
        for k in sorted(obj, key=str):
            if k in SKIPPED_KEYS:
                continue
            self.h.update(repr(k).encode())
            self.feed(obj[k])
        self.h.update(b"}")

    def _other(self, obj: object) -> None:
        """An object DeepSpeed's files hold (a namespace, a named tuple): by its fields, else its repr."""
        if hasattr(obj, "__dict__"):
            self.h.update(type(obj).__name__.encode())
            self.feed(vars(obj))
        elif hasattr(obj, "_asdict"):
            self.feed(obj._asdict())
        else:
            self.h.update(repr(obj).encode())

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _rank_of(path: str) -> int:
    base = path.rsplit("/", 1)[-1]
    m = re.search(r"rank_(\d+)", base) or re.search(r"(\d+)", base)
    return int(m.group(1)) if m else -1


def state_digest(state_url: str) -> dict[str, str]:
    """Digest of one committed state directory; returns the total and each component's hash.
    Raises ``StateRefused`` for anything the state's content makes fail (see the module docstring)."""
    try:
        return _state_digest(state_url)
    except (StateRefused, OSError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - hostile content fails in any way (a missing key, a wrong type)
        text = " ".join(str(e).split())[:200]
        raise StateRefused(f"its content cannot be digested ({type(e).__name__}: {text}): refused (corrupt)") from None


def _zero3_masks(files: Mapping[str, ManifestEntry], read: ReadFile, world: int) -> list[list[torch.Tensor]]:
    """ZeRO-3 only: per rank, per param group, which elements of the rank's flat partition are real.

    Why: DeepSpeed pads each parameter to a multiple of the world size and leaves the padding of
    its fp32 partition uninitialised (``torch.empty``), and Adam then updates those elements too;
    two bitwise-equal runs differ there. The layout is the one ``consolidate_zero3`` reads: rank r
    holds elements ``[r*p, (r+1)*p)`` of each parameter, ``p = ceil(numel / world)``."""
    model0 = next((rel for rel in files if ZERO3_MODEL.match(rel) and _rank_of(rel) == 0), None)
    if model0 is None or world < 1:
        return []
    shapes = load_deepspeed_file(read(model0), model0)["param_shapes"]
    masks: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for group in shapes:
        for r in range(world):
            pieces = []
            for shape in group.values():
                numel = math.prod(int(d) for d in shape)
                part = -(-numel // world)
                real = min(part, max(0, numel - r * part))
                pieces += [torch.ones(real, dtype=torch.bool), torch.zeros(part - real, dtype=torch.bool)]
            masks[r].append(torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool))
    return masks


def _without_padding(osd: Any, masks: list[torch.Tensor]) -> Any:
    """A ZeRO-3 rank's optimizer state with the padding of each group's flat tensors (the fp32
    partition and every moment of that length) set to zero before hashing."""

    def clean(t: Any, g: int) -> Any:
        if isinstance(t, torch.Tensor) and g < len(masks) and t.dim() == 1 and t.numel() == masks[g].numel():
            return t.detach().masked_fill(~masks[g], 0)
        return t

    out = dict(osd)
    if isinstance(osd.get("fp32_flat_groups"), list):
        out["fp32_flat_groups"] = [clean(t, g) for g, t in enumerate(osd["fp32_flat_groups"])]
    inner = osd.get("optimizer_state_dict")
    if isinstance(inner, dict) and isinstance(inner.get("state"), dict):
        state = {
            g: ({k: clean(v, g) for k, v in st.items()} if isinstance(g, int) and isinstance(st, dict) else st)
            for g, st in inner["state"].items()
        }
        out["optimizer_state_dict"] = {**inner, "state": state}
    return out


def _json(data: bytes, what: str) -> Any:
    try:
        return loads_bounded(data, max_bytes=MAX_JSON_BYTES, max_depth=MAX_JSON_DEPTH)
    except BoundedJsonError as e:
        raise StateRefused(
            f"{what} is {e if str(e).startswith('not JSON') else f'JSON {e}'}: refused (corrupt)"
        ) from None


def _state_digest(state_url: str) -> dict[str, str]:
    base, _, name = state_url.rstrip("/").rpartition("/")
    storage = RunStorage(base)
    files = read_manifest(storage, (name,)).files

    def read(rel: str) -> bytes:
        try:
            return read_listed(storage, (name,), rel, files[rel])
        except ChecksumMismatch as e:
            raise ChecksumMismatch(f"{redact_url(state_url)}/{e}") from None

    parts: dict[str, CanonicalHash] = {k: CanonicalHash() for k in ("parameters", "optimizer", "position", "rng")}
    _feed_engine_files(parts, files, read)
    parts["position"].feed(_trainer_state(read).model_dump(include=set(POSITION_KEYS)))
    _feed_rank_files(parts, files, read)
    out = {k: v.hexdigest() for k, v in parts.items()}
    total = hashlib.sha256("".join(f"{k}={out[k]};" for k in sorted(out)).encode()).hexdigest()
    return {"digest": total, **out}


def _feed_engine_files(parts: dict[str, CanonicalHash], files: Mapping[str, ManifestEntry], read: ReadFile) -> None:
    """DeepSpeed's files: the parameters (ZeRO-3's from the optimizer shards) and the optimizer state."""
    model_files = [MODEL_FILE] if MODEL_FILE in files else []
    # zero_pp_rank_*_optim_states (ZeRO 1-3) and bf16_zero_pp_rank_* (bf16 without ZeRO: DeepSpeed's
    # BF16_Optimizer); ZeRO-3's per-rank zero_pp_rank_*_model_states are read for the parameters
    zero_files = sorted((p for p in files if ZERO_OPTIM.match(p)), key=_rank_of)
    if any(ZERO3_MODEL.match(p) for p in files):
        # ZeRO-3: each rank's model file holds empty placeholders; the parameters are the fp32
        # partitions in the optimizer shards, put together as the export does
        parts["parameters"].feed(consolidate_zero3(list(files), lambda rel: load_deepspeed_file(read(rel), rel)))
    for rel in model_files:
        sd = load_deepspeed_file(read(rel), rel)
        parts["parameters"].feed(sd["module"])
        if sd.get("optimizer") is not None:
            parts["optimizer"].feed(sd["optimizer"])
    masks = _zero3_masks(files, read, len(zero_files))
    for rel in zero_files:
        osd = load_deepspeed_file(read(rel), rel)["optimizer_state_dict"]
        parts["optimizer"].feed(_without_padding(osd, masks[_rank_of(rel)]) if masks else osd)


def _trainer_state(read: ReadFile) -> TrainState:
    try:
        return TrainState.model_validate(_json(read(TRAINER_FILE), TRAINER_FILE))
    except ValidationError as e:
        raise StateRefused(f"{problem_of(e, TRAINER_FILE)}: refused (corrupt)") from None


def _feed_rank_files(parts: dict[str, CanonicalHash], files: Mapping[str, ManifestEntry], read: ReadFile) -> None:
    """Every rank's file of each per-rank part (``syncpoint.workers.state.rank_parts``), each part under
    its own key, added only when the state has its files (the RNG's is always there), so a state
    without a part keeps its digest."""
    for part in PARTS:
        owned = sorted((p for p in files if part.layout.owns(p)), key=_rank_of)
        if owned and part.layout.hash_key not in parts:
            parts[part.layout.hash_key] = CanonicalHash()
        for rel in owned:
            for value in part.digest(_rank_of(rel), read(rel), rel):
                parts[part.layout.hash_key].feed(value)
