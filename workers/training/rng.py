"""Capture and restore every RNG a rank uses, as tensors (safetensors), never pickle.

Python ``random``, NumPy's global generator, torch CPU and (when present) every CUDA device, and
the generators the task owns on its train side (reachable from its loss, model, metrics or
optimizer; ``syncpoint.workers.training.task_rngs``), which the loop registers with ``use_task_generators``. The loop
restores them after the data skip and after everything that consumes randomness at start-up
(model build, engine init), immediately before the first fetch, so dropout and any model-side
randomness continue exactly. Data-side generators (the dataset's, the collate's) are not saved:
``syncpoint.workers.data.sampler`` makes them a function of (seed, epoch, sample index).

A state's RNG file is parsed whole and tried when the state is fetched (``verify``: applied, then
put back), so a bad file is a refusal of that state, which falls back like any other, and the
restore after the skip applies what was verified and cannot fail.

File layout (one per rank): tensors ``python``, ``numpy_keys``, ``torch_cpu``, ``cuda_<i>`` and
``task/<i>``; one metadata key, ``rng`` (JSON): the scalars of the global streams and
``task_generators``, a list of each generator's path, kind, and its tensor's name (torch,
``random.Random``) or, for NumPy, its bit generator's state with integers as strings. A file
without ``task_generators`` was written before task generators were captured.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, NotRequired, Required, TypedDict

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from syncpoint.policies.contracts.bounded_json import BoundedJsonError, JSONValue, loads_bounded
from syncpoint.policies.contracts.errors import StateRefused
from syncpoint.policies.decisions.seeds import (
    HASH_SEED_SALT as HASH_SEED_SALT,  # re-exported: part of this module's API
)
from syncpoint.policies.decisions.seeds import derive_seed
from syncpoint.policies.decisions.seeds import hash_seed as hash_seed
from syncpoint.workers.training import task_rngs

MAX_HEADER = 8 << 20  # a header larger than this is no RNG file (a rank's is a few KiB)
MAX_ARRAY_BYTES = 1 << 20  # one NumPy state array (MT19937's key is 2.5 KiB)
TASK_META: Final = "task_generators"
MT_WORDS = 624  # Python's and NumPy's MT19937: 624 words and a position

# The train-side generators of the task this process runs: path -> generator (the loop sets them).
_TASK: dict[str, task_rngs.TaskGenerator] = {}


def use_task_generators(generators: Mapping[str, task_rngs.TaskGenerator]) -> None:
    """Capture, restore and seed these generators with the rank's RNG from now on (replacing any)."""
    _TASK.clear()
    _TASK.update(sorted(generators.items()))


def task_generator_kinds() -> dict[str, str]:
    """What a state records of the registered generators (``trainer.json`` ``task_generators``)."""
    return {path: task_rngs.kind(g) for path, g in _TASK.items()}


class TaskEntry(TypedDict, total=False):
    """One task generator in an RNG file's metadata: its path and kind, and where its state lies: a
    tensor (torch; ``random.Random`` with its version and gauss) or, for NumPy, ``state`` (``_to_json``)."""

    path: Required[str]
    kind: Required[str]
    tensor: str
    version: int
    gauss: float | None
    state: JSONValue


class RngMeta(TypedDict):
    """An RNG file's one metadata key, ``rng``: the global streams' scalars and the task's generators."""

    python_version: int
    python_gauss: float | None
    numpy_name: str
    numpy_pos: int
    numpy_has_gauss: int
    numpy_cached_gaussian: float
    cuda_devices: int
    task_generators: NotRequired[list[TaskEntry]]  # absent: written before task generators were captured


@dataclass
class SavedRng:
    """Every stream's state, in the form its setter takes (in memory; ``serialize`` writes it)."""

    python: tuple[int, tuple[int, ...], float | None]
    numpy: tuple[str, np.ndarray, int, int, float]
    torch_cpu: torch.Tensor
    cuda: list[torch.Tensor]
    task: dict[str, tuple[str, Any]] | None  # path -> (kind, state); None: a file from before they were captured


def snapshot() -> SavedRng:
    """Every RNG stream of this process as it is now (Python, NumPy, torch CPU and CUDA, the task's)."""
    cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else []
    return SavedRng(
        python=random.getstate(),
        numpy=np.random.get_state(),  # type: ignore[arg-type]
        torch_cpu=torch.get_rng_state(),
        cuda=cuda,
        task={p: (task_rngs.kind(g), task_rngs.get_state(g)) for p, g in _TASK.items()},
    )


def capture() -> bytes:
    """This rank's RNG file's bytes (``snapshot`` serialized)."""
    return serialize(snapshot())


def serialize(saved: SavedRng) -> bytes:
    """An RNG snapshot as safetensors bytes (tensors and plain metadata: nothing pickled)."""
    version, py_state, gauss = saved.python
    np_name, np_keys, np_pos, np_has_gauss, np_cached = saved.numpy
    tensors = {
        "python": torch.tensor(py_state, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "torch_cpu": saved.torch_cpu,
    }
    for i, s in enumerate(saved.cuda):
        tensors[f"cuda_{i}"] = s
    meta: RngMeta = {
        "python_version": version,
        "python_gauss": gauss,
        "numpy_name": np_name,
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_cached_gaussian": float(np_cached),
        "cuda_devices": len(saved.cuda),
    }
    entries: list[TaskEntry] = []
    for i, (path, (kind, state)) in enumerate((saved.task or {}).items()):
        entry: TaskEntry = {"path": path, "kind": kind}
        if kind.startswith("torch."):
            tensors[f"task/{i}"], entry["tensor"] = state, f"task/{i}"
        elif kind == "random.Random":
            tensors[f"task/{i}"], entry["tensor"] = torch.tensor(state[1], dtype=torch.int64), f"task/{i}"
            entry["version"], entry["gauss"] = state[0], state[2]
        else:
            entry["state"] = _to_json(state)
        entries.append(entry)
    if saved.task is not None:
        meta[TASK_META] = entries
    return st_save(tensors, metadata={"rng": json.dumps(meta)})  # one key: safetensors orders several at random


def restore(saved: SavedRng | bytes) -> None:
    """Put every stream back (a file's bytes are parsed first; ``verify`` has tried them)."""
    s = parse(saved) if isinstance(saved, bytes) else saved
    random.setstate(s.python)
    np.random.set_state(s.numpy)
    torch.set_rng_state(s.torch_cpu)
    if s.cuda and torch.cuda.is_available():
        for i in range(min(len(s.cuda), torch.cuda.device_count())):
            torch.cuda.set_rng_state(s.cuda[i], i)
    for path, g in _TASK.items():
        if s.task is not None and path in s.task:
            task_rngs.set_state(g, s.task[path][1])


def verify(data: bytes, name: str) -> SavedRng:
    """Parse a state's RNG file whole and try it on this process (applied, then put back), so
    nothing the restore does can fail later; ``StateRefused`` names what is wrong."""
    saved = parse(data, name)
    for path, g in _TASK.items():
        if saved.task is None:
            break  # a file from before task generators were captured: they keep their built state
        if path not in saved.task:
            raise StateRefused(f"{name} holds no state for the task's generator {path}: refused (corrupt)")
        if saved.task[path][0] != task_rngs.kind(g):
            raise StateRefused(
                f"{name}: the task's generator {path} is a {task_rngs.kind(g)}, the file holds a "
                f"{saved.task[path][0]}: refused"
            )
    before = snapshot()
    try:
        restore(saved)
    except Exception as e:  # noqa: BLE001 - whatever a setter refuses, the state is refused for it
        raise StateRefused(f"{name}: cannot be restored ({type(e).__name__}: {e}): refused (corrupt)") from None
    finally:
        restore(before)
    return saved


# ------------------------------------------------------------------ parsing a file from storage


class _Bad(ValueError):
    pass


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise _Bad(what)


def parse(data: bytes, name: str = "RNG file") -> SavedRng:
    """The file's streams, every field checked (``StateRefused`` names the first bad one)."""
    try:
        return _parse(data)
    except _Bad as e:
        raise StateRefused(f"{name}: {e}: refused (corrupt)") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own errors, a JSON error: all mean a bad file
        raise StateRefused(f"{name}: unreadable ({type(e).__name__}: {e}): refused (corrupt)") from None


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (its JSON header), without loading tensors.

    Refused (``StateRefused``, one line) unless the header's stated length fits the blob and
    MAX_HEADER, and the header is a shallow JSON object whose metadata maps strings to
    strings: the bytes come from storage, and a header of 10⁵ nested arrays, or a length of 2⁶⁴,
    must not become a crash or an allocation."""
    header_len = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= header_len <= min(len(data) - 8, MAX_HEADER):
        raise StateRefused(
            f"a safetensors header of {header_len} bytes in a file of {len(data)} (at most "
            f"{MAX_HEADER}): refused (corrupt)"
        )
    try:
        header = loads_bounded(data[8 : 8 + header_len], max_bytes=MAX_HEADER, max_depth=8)
    except BoundedJsonError as e:
        raise StateRefused(f"a safetensors header that is {e}: refused (corrupt)") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise StateRefused("a safetensors header that is not an object with string metadata: refused (corrupt)")
    return meta


def _parse(data: bytes) -> SavedRng:
    meta = safetensors_metadata(data)  # the header bounded (StateRefused otherwise)
    _need(isinstance(meta.get("rng"), str), "no rng metadata")
    tensors = st_load(data)
    try:
        g = loads_bounded(meta["rng"].encode(), max_bytes=MAX_HEADER, max_depth=32)
    except BoundedJsonError as e:
        raise StateRefused(f"rng metadata that is {e}: refused (corrupt)") from None
    _need(isinstance(g, dict), "rng metadata is not an object")
    python = (
        _int(g.get("python_version"), "python_version", 1, 1 << 16),
        _mt_words(tensors, "python", MT_WORDS + 1),
        _gauss(g.get("python_gauss"), "python_gauss"),
    )
    _need(python[1][-1] <= MT_WORDS, "python: position out of range")
    _need(g.get("numpy_name") == "MT19937", f"numpy_name {g.get('numpy_name')!r} is not MT19937")
    cached = g.get("numpy_cached_gaussian")
    _need(isinstance(cached, (int, float)) and not isinstance(cached, bool), "numpy_cached_gaussian is no number")
    numpy = (
        "MT19937",
        np.asarray(_mt_words(tensors, "numpy_keys", MT_WORDS), dtype=np.uint32),
        _int(g.get("numpy_pos"), "numpy_pos", 0, MT_WORDS),
        _int(g.get("numpy_has_gauss"), "numpy_has_gauss", 0, 1),
        float(cached),
    )
    cuda_devices = _int(g.get("cuda_devices", 0), "cuda_devices", 0, 1 << 12)
    cuda = [_bytes_tensor(tensors, f"cuda_{i}") for i in range(cuda_devices)]
    torch_cpu = _bytes_tensor(tensors, "torch_cpu")
    _need(
        torch_cpu.numel() == torch.get_rng_state().numel(),
        f"torch_cpu holds {torch_cpu.numel()} bytes, a torch CPU state {torch.get_rng_state().numel()}",
    )
    task = _parse_task(g[TASK_META], tensors) if TASK_META in g else None
    return SavedRng(python=python, numpy=numpy, torch_cpu=torch_cpu, cuda=cuda, task=task)


def _parse_task(entries: Any, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, Any]]:
    _need(isinstance(entries, list), f"{TASK_META} is not a list")
    out: dict[str, tuple[str, Any]] = {}
    for i, e in enumerate(entries):
        _need(
            isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("kind"), str),
            f"{TASK_META}[{i}] names no path and kind",
        )
        path = e["path"]
        _need(path not in out, f"{TASK_META}: {path} twice")
        try:
            out[path] = (e["kind"], _task_state(e, tensors))
        except _Bad as bad:
            raise _Bad(f"the task's generator {path}: {bad}") from None
    return out


def _task_state(e: TaskEntry, tensors: dict[str, torch.Tensor]) -> Any:
    """One generator's state from its entry as read (path and kind checked by the caller; the rest here)."""
    kind, key = e["kind"], str(e.get("tensor"))
    if kind.startswith("torch.Generator("):
        return _bytes_tensor(tensors, key)
    if kind == "random.Random":
        words = _mt_words(tensors, key, MT_WORDS + 1)
        _need(words[-1] <= MT_WORDS, f"{key}: position out of range")
        return _int(e.get("version"), "version", 1, 1 << 16), words, _gauss(e.get("gauss"), "gauss")
    if kind.startswith("numpy.random."):
        state = _from_json(e.get("state"))
        _need(isinstance(state, dict), "its state is not an object")
        return state
    raise _Bad(f"unknown kind {kind!r}")


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    _need(
        isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, f"{what} {v!r} is no integer in [{lo}, {hi}]"
    )
    return v


def _gauss(v: Any, what: str) -> float | None:
    _need(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)), f"{what} {v!r} is no number")
    return None if v is None else float(v)


def _mt_words(tensors: dict[str, torch.Tensor], key: str, n: int) -> tuple[int, ...]:
    t = tensors.get(key)
    _need(t is not None, f"no tensor {key}")
    assert t is not None
    _need(t.dtype == torch.int64 and tuple(t.shape) == (n,), f"{key} is {t.dtype} {tuple(t.shape)}, not int64 ({n},)")
    words = tuple(int(x) for x in t.tolist())
    _need(all(0 <= w < 2**32 for w in words[:MT_WORDS]), f"{key}: a word outside [0, 2**32)")
    return words


def _bytes_tensor(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    t = tensors.get(key)
    _need(t is not None, f"no tensor {key}")
    assert t is not None
    _need(t.dtype == torch.uint8 and t.dim() == 1, f"{key} is {t.dtype} {tuple(t.shape)}, not a uint8 vector")
    return t


# NumPy bit-generator states are dicts of ints (128-bit for PCG64), arrays and names: JSON with the
# integers as strings (exact in any reader) and arrays as hex bytes with dtype and shape.
_ARRAY_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int32", "int64")


def _to_json(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_json(x) for x in v]
    if isinstance(v, np.ndarray):
        return {"$array": v.tobytes().hex(), "dtype": str(v.dtype), "shape": list(v.shape)}
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return {"$int": str(int(v))}
    if isinstance(v, (float, np.floating)):
        return float(v)
    return v


def _from_json(v: Any) -> Any:
    if isinstance(v, list):
        return [_from_json(x) for x in v]
    if not isinstance(v, dict):
        _need(v is None or isinstance(v, (str, bool, float)), f"unexpected value {v!r} in a NumPy state")
        return v
    if set(v) == {"$int"}:
        _need(isinstance(v["$int"], str) and len(v["$int"]) <= 80, "a NumPy state integer is no string")
        return int(v["$int"])
    if "$array" in v:
        dtype, shape, hexed = v.get("dtype"), v.get("shape"), v.get("$array")
        _need(
            dtype in _ARRAY_DTYPES
            and isinstance(shape, list)
            and isinstance(hexed, str)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape),
            "a NumPy state array without dtype and shape",
        )
        assert isinstance(hexed, str) and isinstance(shape, list) and isinstance(dtype, str)
        raw = bytes.fromhex(hexed)
        _need(
            len(raw) <= MAX_ARRAY_BYTES and len(raw) == int(np.prod(shape)) * np.dtype(dtype).itemsize,
            "a NumPy state array of the wrong size",
        )
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    return {k: _from_json(x) for k, x in v.items()}


# ------------------------------------------------------------------ seeds


# The last part of the seed that re-derives a rank's streams when a state is resumed on another
# world size. Its value is part of the resume contract (a resumed run must draw the same numbers
# as an earlier resume of the same state): never change it.
RESIZED_WORLD_SALT = 0xE1A5


def reseed_for_resized_world(seed: int, optimizer_step: int, rank: int) -> None:
    """Per-rank streams cannot be carried to another world size: derive them from (seed, optimizer
    step, rank) instead, the same for every resume of the same state at the same world size."""
    seed_everything(derive_seed(seed, optimizer_step, rank, RESIZED_WORLD_SALT))


def seed_everything(seed: int) -> None:
    """The global streams and every registered task generator (each from its own path)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    for path, g in _TASK.items():
        task_rngs.reseed(g, derive_seed(seed, task_rngs.path_salt(path)))


HASH_PROBE = "syncpoint-hash-probe"


@functools.cache
def hash_seed_problem(expected: int) -> str | None:
    """Why this interpreter does not hash strings as one started with ``PYTHONHASHSEED=expected``
    does, or None (also when that cannot be checked here).

    Why a subprocess: the hash secret is fixed when an interpreter starts, so only an interpreter
    started with the variable tells the value to expect; the environment variable alone does not
    (a fork server started without it forks ranks whose environment names it)."""
    env = {**os.environ, "PYTHONHASHSEED": str(expected)}
    try:
        out = subprocess.run(
            [sys.executable, "-S", "-c", f"print(hash({HASH_PROBE!r}))"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        probe = int(out.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if probe == hash(HASH_PROBE):
        return None
    return (
        f"this worker's Python does not run with PYTHONHASHSEED={expected} (the job's, derived from train.seed; "
        f"it has {os.environ.get('PYTHONHASHSEED', 'none')!s}): code whose order depends on a set or dict of "
        "strings sees another order after every restart. syncpoint sets it for the workers it starts (Ray Train "
        "workers, syncpoint.workers.supervision.launch); a launcher of your own must start each worker process with "
        f"PYTHONHASHSEED={expected} in its environment"
    )
