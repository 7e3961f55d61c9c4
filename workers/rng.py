"""Capture and restore every RNG a rank uses, as tensors (safetensors), never pickle.

Python ``random``, NumPy's global generator, torch CPU and (when present) every CUDA device. The
loop restores them after the data skip and after everything that consumes randomness at start-up
(model build, engine init), immediately before the first fetch, so dropout and any model-side
randomness continue exactly.
"""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from policies.bounded_json import BoundedJsonError, loads_bounded
from policies.errors import StateRefused

MAX_HEADER_BYTES = 1 << 20  # a safetensors header syncpoint writes: tensor names, shapes, a small metadata dict


def capture() -> bytes:
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    tensors = {
        "python": torch.tensor(py_state, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    meta = {"python_version": version, "python_gauss": gauss, "numpy_name": np_name, "numpy_pos": int(np_pos),
            "numpy_has_gauss": int(np_has_gauss), "numpy_cached_gaussian": float(np_cached),
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    return st_save(tensors, metadata={"rng": json.dumps(meta)})


def restore(data: bytes) -> None:
    tensors = st_load(data)
    meta = json.loads(safetensors_metadata(data)["rng"])
    random.setstate((meta["python_version"], tuple(int(x) for x in tensors["python"].tolist()), meta["python_gauss"]))
    np.random.set_state((meta["numpy_name"], tensors["numpy_keys"].numpy().astype(np.uint32), meta["numpy_pos"],
                         meta["numpy_has_gauss"], meta["numpy_cached_gaussian"]))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available() and meta["cuda_devices"]:
        torch.cuda.set_rng_state_all([tensors[f"cuda_{i}"] for i in range(meta["cuda_devices"])])


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (its JSON header), without loading tensors.

    Refused (``StateRefused``, one line) unless the header's stated length fits the blob and
    MAX_HEADER_BYTES, and the header is a shallow JSON object whose metadata maps strings to
    strings: the bytes come from storage, and a header of 10⁵ nested arrays, or a length of 2⁶⁴,
    must not become a crash or an allocation."""
    header_len = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 <= header_len <= min(len(data) - 8, MAX_HEADER_BYTES):
        raise StateRefused(f"a safetensors header of {header_len} bytes in a file of {len(data)} (at most "
                           f"{MAX_HEADER_BYTES}): refused (corrupt)")
    try:
        header = loads_bounded(data[8:8 + header_len], max_bytes=MAX_HEADER_BYTES, max_depth=8)
    except BoundedJsonError as e:
        raise StateRefused(f"a safetensors header that is {e}: refused (corrupt)") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise StateRefused("a safetensors header that is not an object with string metadata: refused (corrupt)")
    return meta


# The last part of the seed that re-derives a rank's streams when a state is resumed on another
# world size. Its value is part of the resume contract (a resumed run must draw the same numbers
# as an earlier resume of the same state): never change it.
RESIZED_WORLD_SALT = 0xE1A5


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (no Python hash randomisation)."""
    digest = hashlib.blake2b(",".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed_for_resized_world(seed: int, optimizer_step: int, rank: int) -> None:
    """Per-rank streams cannot be carried to another world size: derive them from (seed, optimizer
    step, rank) instead, the same for every resume of the same state at the same world size."""
    seed_everything(derive_seed(seed, optimizer_step, rank, RESIZED_WORLD_SALT))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
