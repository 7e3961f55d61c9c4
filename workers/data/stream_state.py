"""A rank's stream position as a file: tensors as safetensors, everything else as JSON, never pickle.

Why a codec of its own: a stream's state (``torchdata``'s ``StatefulDataLoader.state_dict()``, with
every DataLoader worker's dataset state inside, syncpoint's shuffle buffer included) is a tree of
plain values and, in a buffer of formatted examples, tensors. Pickling it would let whoever can
write storage run code on every rank at resume. So the tree is written as JSON with each tensor
replaced by a reference into the same file's safetensors section; tuples, byte strings and dicts
with non-string keys get a marked form so the tree reads back equal to what was saved. Anything
else, or an integer longer than the reader takes (``MAX_INT_DIGITS``, one bound for both), is
refused at the first save, naming its path in the tree (``StreamStateError``): a state that cannot
be written exactly, or read back, is a job error, not a silently truncated position.

File: ``stream/rank_<r:05d>.safetensors`` (``syncpoint.policies.contracts.state_format.stream_file``), one metadata key
``stream`` holding ``{"version": 1, "pass": <the rank's pass over its stream>, "loader": <tree>}``.
Parsing is whole and strict (``parse``): a file that is not exactly this is ``StateRefused``, so a
bad one is a refusal of its state at fetch, which falls back to the next candidate.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from syncpoint.policies.contracts.bounded_json import BoundedJsonError, loads_bounded
from syncpoint.policies.contracts.errors import StateRefused, TaskError

FORMAT_VERSION = 1
META_KEY = "stream"
MAX_DEPTH = 96  # StatefulDataLoader -> worker snapshots -> datasets' nested iterables -> buffered examples
MAX_JSON_BYTES = 64 << 20  # safetensors caps its header at 100 MB
# The integers a tree may hold, for the writer (refused at the first save past it) and the reader
# (refused as corrupt past it) alike: a NumPy PCG64 state (``rng.bit_generator.state``, which
# ``interleave_datasets(probabilities=..., seed=...)`` keeps in its state) holds 128-bit integers
# (39 digits), 256-bit ones have 78; 300 digits stays below a float's range (~1.8e308), so any
# later float() of a value read back cannot overflow, and keeps the reader's work per integer small.
MAX_INT_DIGITS = 300
# Markers of the forms JSON lacks; a dict of the task's own that uses one of these keys is refused.
TENSOR, TUPLE = "__syncpoint_tensor__", "__syncpoint_tuple__"
BYTES, ITEMS = "__syncpoint_bytes__", "__syncpoint_items__"
MARKERS = (TENSOR, TUPLE, BYTES, ITEMS)


class StreamStateError(TaskError):
    """A stream's state holds something the codec cannot write exactly (its path is named)."""


@dataclass
class SavedStream:
    """One rank's stream position as saved: its pass over its stream and the loader's state."""

    pass_number: int
    loader: dict[str, object]  # ``StatefulDataLoader.state_dict()``: handed back to its ``load_state_dict``


STREAM_FIX = (
    "Make the dataset's state_dict() (and what it buffers) hold only those (with_format('torch') for examples of "
    "arrays)"
)


@dataclass(frozen=True)
class TreeLabel:
    """Who a tree belongs to, for the one-paragraph errors: its name ("the stream's state"), the fix
    to state, and the ``TaskError`` kind to raise."""

    what: str
    fix: str
    error: type[TaskError]


STREAM_LABEL = TreeLabel("the stream's state", STREAM_FIX, StreamStateError)


def encode(saved: SavedStream) -> bytes:
    """The file's bytes; ``StreamStateError`` naming the first value that is neither JSON nor a tensor."""
    return encode_tree({"pass": saved.pass_number, "loader": saved.loader}, META_KEY, STREAM_LABEL)


def encode_tree(fields: Mapping[str, object], meta_key: str, label: TreeLabel) -> bytes:
    """A safetensors file whose ``meta_key`` metadata is ``{"version": 1, **fields}``, each field's
    tree encoded (tensors by reference into the file's tensors); ``label.error`` naming the first value
    that is neither JSON nor a tensor."""
    tensors: dict[str, torch.Tensor] = {}
    meta = {"version": FORMAT_VERSION, **{k: _encode(v, "state", tensors, 0, label) for k, v in fields.items()}}
    return st_save(tensors, metadata={meta_key: json.dumps(meta, allow_nan=False, sort_keys=True)})


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], depth: int, label: TreeLabel) -> Any:
    if depth > MAX_DEPTH:
        raise label.error(f"{label.what} is nested deeper than {MAX_DEPTH} levels at {path}")
    if isinstance(obj, list):
        return [_encode(v, f"{path}[{i}]", tensors, depth + 1, label) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, f"{path}[{i}]", tensors, depth + 1, label) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        return _encode_dict(obj, path, tensors, depth, label)
    return _encode_leaf(obj, path, tensors, label)


def _encode_leaf(obj: Any, path: str, tensors: dict[str, torch.Tensor], label: TreeLabel) -> Any:
    """A JSON scalar as itself, a tensor by reference into the file's tensors, bytes as base64."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return _encode_int(obj, path, label)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise label.error(f"{label.what} holds {obj!r} at {path}, which JSON cannot hold")
        return float(obj)
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {TENSOR: key}
    if isinstance(obj, (bytes, bytearray)):
        return {BYTES: base64.b64encode(bytes(obj)).decode()}
    raise label.error(
        f"{label.what} holds a {type(obj).__module__}.{type(obj).__qualname__} at {path}: syncpoint saves it as "
        "JSON values (None, bool, int, finite float, str, bytes, list, tuple, dict) and torch tensors, never "
        f"pickled objects. {label.fix}"
    )


def _encode_int(obj: int, path: str, label: TreeLabel) -> int:
    """The int itself, if the reader takes it back (at most MAX_INT_DIGITS digits); refused here
    otherwise, at the first save, rather than as a corrupt state at the first resume."""
    # 2**(4d) > 10**d: past 4*MAX_INT_DIGITS bits it is too long, and str() of it could itself refuse
    magnitude = abs(int(obj))
    if magnitude.bit_length() > 4 * MAX_INT_DIGITS or len(str(magnitude)) > MAX_INT_DIGITS:
        raise label.error(
            f"{label.what} holds an integer of {magnitude.bit_length()} bits at {path}: syncpoint saves integers of "
            f"at most {MAX_INT_DIGITS} digits (a 128- or 256-bit RNG state fits). Keep a larger number as a str, "
            "or as a tensor of its 64-bit words"
        )
    return int(obj)


def _encode_dict(obj: dict[Any, Any], path: str, tensors: dict[str, torch.Tensor], depth: int, label: TreeLabel) -> Any:
    """String keys as a JSON object (none of them a marker); any other keys as [key, value] pairs."""
    if all(isinstance(k, str) for k in obj):
        clash = next((k for k in obj if k in MARKERS), None)
        if clash is not None:
            raise label.error(f"{label.what} has a key {clash!r} at {path}, which syncpoint reserves")
        return {k: _encode(v, f"{path}[{k!r}]", tensors, depth + 1, label) for k, v in obj.items()}
    return {
        ITEMS: [
            [
                _encode(k, f"{path}<key {k!r}>", tensors, depth + 1, label),
                _encode(v, f"{path}[{k!r}]", tensors, depth + 1, label),
            ]
            for k, v in obj.items()
        ]
    }


def parse(data: bytes, rel: str) -> SavedStream:
    """A stream file read back whole; ``StateRefused`` (corrupt) unless it is exactly one."""
    fields = parse_tree(data, rel, META_KEY, ("loader", "pass"), "stream state")
    number, loader = fields["pass"], fields["loader"]
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise StateRefused(f"{rel}: pass {number!r} is no count: refused (corrupt)")
    if not isinstance(loader, dict):
        raise StateRefused(f"{rel}: the loader's state is no object: refused (corrupt)")
    return SavedStream(number, loader)


def parse_tree(data: bytes, rel: str, meta_key: str, keys: tuple[str, ...], kind: str) -> dict[str, object]:
    """The fields of a file ``encode_tree`` wrote, read back whole and strictly: exactly ``keys``
    (and the version), every tensor referenced exactly once; ``StateRefused`` (corrupt) otherwise."""
    with_meta = _metadata(data, rel)
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as e:
        raise StateRefused(f"{rel}: not a {kind} file ({e}): refused (corrupt)") from None
    raw = with_meta.get(meta_key)
    if raw is None:
        raise StateRefused(f"{rel}: no {meta_key!r} metadata: refused (corrupt)")
    try:
        meta = loads_bounded(raw, max_bytes=MAX_JSON_BYTES, max_depth=MAX_DEPTH * 2 + 4, max_int_digits=MAX_INT_DIGITS)
    except BoundedJsonError as e:
        raise StateRefused(f"{rel}: its {meta_key!r} metadata is {e}: refused (corrupt)") from None
    if not isinstance(meta, dict) or sorted(meta) != sorted([*keys, "version"]):
        raise StateRefused(
            f"{rel}: not a {kind} (keys {sorted(meta) if isinstance(meta, dict) else meta!r}): refused (corrupt)"
        )
    if meta["version"] != FORMAT_VERSION:
        raise StateRefused(f"{rel}: {kind} version {meta['version']!r}, this syncpoint reads {FORMAT_VERSION}: refused")
    used: set[str] = set()
    fields = {k: _decode(meta[k], tensors, used, rel) for k in keys}
    if used != set(tensors):
        raise StateRefused(
            f"{rel}: tensors {sorted(set(tensors) - used)[:5]} are referenced nowhere: refused (corrupt)"
        )
    return fields


def _metadata(data: bytes, rel: str) -> dict[str, str]:
    """The safetensors header's ``__metadata__``, read within bounds before any tensor is (its stated
    length must fit the file and MAX_JSON_BYTES: the bytes come from storage)."""
    header_len = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= header_len <= min(len(data) - 8, MAX_JSON_BYTES):
        raise StateRefused(
            f"{rel}: a safetensors header of {header_len} bytes in a file of {len(data)}: refused (corrupt)"
        )
    try:
        header = loads_bounded(data[8 : 8 + header_len], max_bytes=MAX_JSON_BYTES, max_depth=8)
    except BoundedJsonError as e:
        raise StateRefused(f"{rel}: a safetensors header that is {e}: refused (corrupt)") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise StateRefused(f"{rel}: a safetensors header without string metadata: refused (corrupt)")
    return meta


def _decode(obj: Any, tensors: dict[str, torch.Tensor], used: set[str], rel: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, used, rel) for v in obj]
    if not isinstance(obj, dict):
        return obj
    marked = [k for k in MARKERS if k in obj]
    if not marked:
        return {k: _decode(v, tensors, used, rel) for k, v in obj.items()}
    if len(obj) != 1:
        raise StateRefused(f"{rel}: a marked value {marked[0]} with other keys: refused (corrupt)")
    kind, value = marked[0], obj[marked[0]]
    if kind == TENSOR:
        return _decode_tensor(value, tensors, used, rel)
    if kind == BYTES:
        return _decode_bytes(value, rel)
    return _decode_pairs(kind, value, tensors, used, rel)


def _decode_tensor(value: Any, tensors: dict[str, torch.Tensor], used: set[str], rel: str) -> torch.Tensor:
    """A reference to one of the file's tensors, each referenced exactly once."""
    if not isinstance(value, str) or value not in tensors or value in used:
        raise StateRefused(f"{rel}: tensor reference {value!r} names no tensor of the file: refused (corrupt)")
    used.add(value)
    return tensors[value]


def _decode_bytes(value: Any, rel: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raise StateRefused(f"{rel}: a byte string that is not base64: refused (corrupt)") from None


def _decode_pairs(kind: str, value: Any, tensors: dict[str, torch.Tensor], used: set[str], rel: str) -> Any:
    """A tuple's items, or a dict's [key, value] pairs (keys that are not strings)."""
    if not isinstance(value, list):
        raise StateRefused(f"{rel}: {kind} holds no list: refused (corrupt)")
    if kind == TUPLE:
        return tuple(_decode(v, tensors, used, rel) for v in value)
    if not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise StateRefused(f"{rel}: {ITEMS} holds no [key, value] pairs: refused (corrupt)")
    try:
        return {_decode(k, tensors, used, rel): _decode(v, tensors, used, rel) for k, v in value}
    except TypeError:
        raise StateRefused(f"{rel}: a dict key that cannot be one: refused (corrupt)") from None


def settled_stream(state: Any) -> Any:
    """A loader's stream state with the inner dataset's position dropped from every pass the stream has
    exhausted (each ``dataset_state``, a DataLoader worker's included).

    Why: once a pass is exhausted the stream never reads its source again in that pass, and the next pass
    starts it afresh (``syncpoint.workers.data.stream``), so where ``datasets`` left its inner iterator is no
    part of what comes next; and it depends on how the pass was reached: an uninterrupted run left
    ``datasets``' shard index past the last shard, a run resumed inside the pass left it at that shard's
    end. Hashed as saved, a drill of the streaming example reported a digest MISMATCH with every loss
    equal (2026-12-06)."""
    if isinstance(state, dict):
        out = {k: settled_stream(v) for k, v in state.items()}
        if out.get("exhausted") is True and "inner" in out and "pass" in out:
            out["inner"] = None
        return out
    if isinstance(state, list):
        return [settled_stream(v) for v in state]
    return state
