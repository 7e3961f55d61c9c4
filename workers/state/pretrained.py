"""Hugging Face in and out: ``final/`` as a ``save_pretrained`` directory, and ``resume.init_from``
from one.

Out: when ``Task.model`` is a ``transformers.PreTrainedModel``, the export is the model's own
``save_pretrained`` (config, generation config where the model has one, safetensors weights with
transformers' handling of tied weights and shards), given the gathered state dict, so
``from_pretrained(<run>/final)`` loads it with nothing left at random initialisation.

In: ``resume.init_from`` may name such a directory (a local copy of a hub model, another run's
``final/``) instead of a run. Why it loads into the module before DeepSpeed wraps it, not after:
ZeRO keeps fp32 master copies (and ZeRO-3 partitions) made at ``deepspeed.initialize``; weights
written into the module afterwards would be overwritten by the first step. Read as a state is:
only regular files, no link followed, no pickle (``safetensors`` files only; a
``pytorch_model.bin`` is refused), each read bounded by the size its own header declares, and
refused before any tensor is read when a parameter or persistent buffer of the model is missing
from it (tied weights count once), has another shape, or when the file holds names the model
lacks (naming them, as selection names a state's mismatch). The bytes' sha256 is recorded at the
run's first use, so a later attempt refuses a directory that changed in between.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from syncpoint.policies.contracts.errors import ResumeRefused
from syncpoint.policies.contracts.state_format import MANIFEST_FILE, STATES_DIR
from syncpoint.policies.decisions.redact import redact_url
from syncpoint.policies.decisions.resume import starts_over
from syncpoint.workers.training.engine import persistent_buffers

if TYPE_CHECKING:
    from syncpoint.workers.storage import RunStorage

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 16 << 20  # a model's config.json / the shard index: kilobytes
MAX_HEADER_BYTES = 100 << 20  # safetensors' own header bound (its reader refuses more)
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")


def is_pretrained_model(module: torch.nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (looked up, never imported: a task that built one has)."""
    import sys

    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)


def save_pretrained_files(module: torch.nn.Module, tensors: dict[str, torch.Tensor], into: str) -> list[str]:
    """``module.save_pretrained(into, state_dict=tensors)``: the files written, relative to ``into``.
    ``tensors`` is the whole state dict (ZeRO-3's gathered one: the module's own parameters are empty
    placeholders there)."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar is no line of the run's
    try:
        module.save_pretrained(into, state_dict=tensors, safe_serialization=True)  # type: ignore[operator]
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return sorted(
        os.path.relpath(os.path.join(d, f), into)
        for d, _, files in os.walk(into)
        for f in files
        if not f.startswith(".")
    )


def looks_pretrained(storage: RunStorage) -> bool:
    """A directory a user meant as a pretrained model: a ``config.json`` and no ``states/`` (its
    weights may still be missing or pickled: ``read_pretrained`` says which)."""
    try:
        names = set(storage.list_names())
    except OSError:
        return False
    return CONFIG_FILE in names and "states" not in names


@dataclass
class Pretrained:
    """What ``read_pretrained`` found: the tensors by name, and the sha256 of every byte read."""

    tensors: dict[str, torch.Tensor]
    sha256: str


def model_bytes_bound(module: torch.nn.Module) -> int:
    """The most a pretrained directory's weights can hold for this model: every parameter and buffer
    at 8 bytes an element (float64, the widest dtype a checkpoint stores), and a header entry of at
    most 1 KiB for each (its name, dtype, shape and offsets)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(8 * int(t.numel()) + 1024 for t in tensors)


def _weight_files(storage: RunStorage, files: Mapping[str, int], h: hashlib._Hash, shown: str, field: str) -> list[str]:
    """The directory's weight files: the one file, or those its index names (the index hashed into
    ``h``); ``ResumeRefused`` saying how to save safetensors when there are none (pickled ones named)."""
    if WEIGHTS_FILE in files:
        return [WEIGHTS_FILE]
    if WEIGHTS_INDEX in files:
        index_bytes = storage.read_bytes(WEIGHTS_INDEX, limit=MAX_CONFIG_BYTES)
        h.update(index_bytes)
        return _index_shards(index_bytes, shown, field)
    pickled = [n for n in PICKLED_WEIGHTS if n in files]
    raise ResumeRefused(
        f"{field}: {shown} has no {WEIGHTS_FILE}"
        + (f" ({pickled[0]} is pickled, which syncpoint never loads)" if pickled else "")
        + ": save it with save_pretrained(..., safe_serialization=True), or convert it to safetensors"
    )


def read_pretrained(
    storage: RunStorage, max_bytes: int | None = None, *, field: str = "resume.init_from", config: bool = True
) -> Pretrained:
    """Every weight file of the directory, parsed by ``safetensors`` (``ResumeRefused`` naming the
    file and why when one is not a regular file, is pickled, or is not what its header says).
    ``max_bytes``: the weights' bound (``model_bytes_bound``): larger files are refused from the
    listing, before any is read. ``field``: what the messages name (the spec field, or the call);
    ``config``: a ``config.json`` is part of the directory (a Hugging Face one)."""
    from safetensors.torch import load as load_safetensors

    shown = redact_url(storage.url)
    listing = storage.listing()
    for rel, what in listing.unsafe.items():
        if rel in (CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX) or rel.endswith(".safetensors"):
            raise ResumeRefused(f"{field}: {shown}/{rel} is {what}, not a regular file: refused")
    h = hashlib.sha256()
    if config:
        h.update(storage.read_bytes(CONFIG_FILE, limit=MAX_CONFIG_BYTES))
    shards = _weight_files(storage, listing.files, h, shown, field)
    if max_bytes is not None:
        listed = sum(listing.files.get(rel, 0) for rel in shards)
        bound = max_bytes + len(shards) * (8 + (64 << 10))  # each shard: its header's length and metadata
        if listed > bound:
            raise ResumeRefused(
                f"{field}: {shown}'s weights are {listed} bytes, more than the task's model can hold "
                f"(about {max_bytes} bytes at 8 bytes an element): another, larger model. Point it at this "
                "model's directory"
            )
    tensors: dict[str, torch.Tensor] = {}
    for rel in shards:
        size = listing.files.get(rel)
        if size is None:
            raise ResumeRefused(f"{field}: {shown}/{rel} is missing (named by {WEIGHTS_INDEX})")
        data = storage.read_bytes(rel, limit=size)
        _check_header(data, f"{shown}/{rel}", field)
        h.update(data)
        try:
            part = load_safetensors(data)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for every defect
            raise ResumeRefused(f"{field}: {shown}/{rel} is not a valid safetensors file ({e})") from None
        tensors.update(part)
    return Pretrained(tensors, h.hexdigest())


def _index_shards(index_bytes: bytes, shown: str, field: str) -> list[str]:
    try:
        weight_map = json.loads(index_bytes)["weight_map"]
        shards = sorted({str(v) for v in weight_map.values()})
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ResumeRefused(f"{field}: {shown}/{WEIGHTS_INDEX} is not a weight index") from None
    bad = [s for s in shards if "/" in s or s.startswith(".") or not s.endswith(".safetensors")]
    if bad:
        raise ResumeRefused(f"{field}: {shown}/{WEIGHTS_INDEX} names {bad[0]!r}, not a shard beside it")
    return shards


def _check_header(data: bytes, where: str, field: str) -> None:
    """The file is exactly its 8-byte header length, the header, and the data its header declares."""
    if len(data) < 8:
        raise ResumeRefused(f"{field}: {where} is {len(data)} bytes, too short for safetensors")
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise ResumeRefused(f"{field}: {where} declares a header of {n} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[8 : 8 + n])
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise ResumeRefused(f"{field}: {where} has no readable safetensors header") from None
    if 8 + n + end != len(data):
        raise ResumeRefused(
            f"{field}: {where} holds {len(data)} bytes, its header declares {8 + n + end}: torn or padded"
        )


def _aliases(module: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter, tied ones together (``lm_head.weight`` and ``transformer.wte.weight``)."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def _renamed(
    tensors: dict[str, torch.Tensor], module: torch.nn.Module, expected: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The file's names mapped onto the module's: as they are, or with the model's
    ``base_model_prefix`` added or removed (a ``GPT2Model`` checkpoint into ``GPT2LMHeadModel``),
    whichever matches more names (what ``from_pretrained`` does)."""
    want = set(expected)
    prefix = str(getattr(module, "base_model_prefix", "") or "")
    options = [tensors]
    if prefix:
        options.append({f"{prefix}.{k}": v for k, v in tensors.items()})
        cut = f"{prefix}."
        options.append({k[len(cut) :] if k.startswith(cut) else k: v for k, v in tensors.items()})
    return max(options, key=lambda o: len(want & set(o)))


FIT_HINT = "Point it at the pretrained directory of this architecture, or build the model it was saved from"


def check_and_load(
    module: torch.nn.Module, found: Pretrained, shown: str, field: str = "resume.init_from", hint: str = FIT_HINT
) -> None:
    """Refuse (``ResumeRefused``, naming the first few, then ``hint``) missing, extra and reshaped
    names, from the headers' shapes before any value is copied; then copy every tensor into the module."""
    aliases = _aliases(module)
    buffers = persistent_buffers(module)
    expected = [n for names in aliases for n in names] + list(buffers)
    tensors = _renamed(found.tensors, module, expected)
    missing = [names[0] for names in aliases if not any(n in tensors for n in names)]
    missing += [n for n in buffers if n not in tensors]
    extra = sorted(set(tensors) - set(expected))
    params = dict(module.named_parameters(remove_duplicate=False))
    reshaped = [
        f"{n}: {tuple(tensors[n].shape)} in the file, {_shape(params.get(n, buffers.get(n)))} in the model"
        for n in expected
        if n in tensors and tuple(tensors[n].shape) != _shape(params.get(n, buffers.get(n)))
    ]
    for what, names in (
        ("the model's parameters or buffers missing from it (they would stay at random initialisation)", missing),
        ("names the model does not have (another architecture or head?)", extra),
        ("shapes that differ", reshaped),
    ):
        if names:
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            raise ResumeRefused(
                f"{field}: {shown} does not fit the task's model: {what}: {', '.join(names[:5])}{more}. {hint}"
            )
    with torch.no_grad():
        for names in aliases:
            src = next(tensors[n] for n in names if n in tensors)
            dst = params[names[0]]
            dst.copy_(src.to(dst.dtype))
        for n, b in buffers.items():
            b.copy_(tensors[n].to(b.dtype))


def _shape(t: torch.Tensor | None) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape) if t is not None else ()


@dataclass
class PretrainedInit:
    """``resume.init_from`` as a pretrained directory, loaded before DeepSpeed wraps the model: what
    it was (its sha256), or why it could not be taken; the error is raised only if the attempt
    starts from it (a run resuming its own state ignores ``init_from``)."""

    url: str
    sha256: str | None = None
    error: str | None = None


def load_pretrained_init(
    init_from: str | None, module: torch.nn.Module, run: RunStorage, policy: str
) -> PretrainedInit | None:
    """Every rank: when ``init_from`` is a pretrained directory, load it into ``module``; None when it
    is a run or a state (``syncpoint.workers.state.resume_negotiation`` takes those after the engine).

    Not read when the run directory already holds a committed state and the resume policy is not
    ``fresh``: the attempt resumes that state, which ignores ``init_from``, and a restart would
    otherwise read the whole pretrained model on every rank for nothing. Should a custom policy still
    start fresh on top of those states, the attempt is refused, saying why (``error``)."""
    from syncpoint.workers.storage import RunStorage

    if not init_from or "/states/" in init_from.rstrip("/") + "/":
        return None
    storage = RunStorage(init_from)
    if not looks_pretrained(storage):
        return None
    shown = redact_url(init_from)
    if not starts_over(policy) and _holds_committed_state(run):
        return PretrainedInit(
            init_from,
            error=(
                f"resume.init_from: {shown} is a pretrained directory, loaded only when the run starts fresh; this "
                f"run holds committed states and resume.policy {policy!r} started fresh on top of them. Use "
                "resume.policy: fresh (with resume.on_existing) to start over from the pretrained weights"
            ),
        )
    try:
        found = read_pretrained(storage, model_bytes_bound(module))
        check_and_load(module, found, shown)
    except ResumeRefused as e:
        return PretrainedInit(init_from, error=str(e))
    except OSError as e:
        return PretrainedInit(init_from, error=f"resume.init_from: {shown} could not be read ({e})")
    return PretrainedInit(init_from, sha256=found.sha256)


def _holds_committed_state(run: RunStorage) -> bool:
    """Whether any state of the run directory has its manifest (newest names first: usually one look)."""
    try:
        names = sorted(run.list_names(STATES_DIR), reverse=True)
    except OSError:
        return False
    return any(run.exists(STATES_DIR, name, MANIFEST_FILE) for name in names)


def upload_pretrained(storage: RunStorage, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Rank 0: ``save_pretrained`` into a temporary directory, then each file to ``final/`` through
    storage (never through a planted link)."""
    with tempfile.TemporaryDirectory(prefix="syncpoint-export-hf-") as d:
        names = save_pretrained_files(module, tensors, d)
        for rel in names:
            storage.upload_file(os.path.join(d, rel), "final", *rel.split(os.sep))
    return names
