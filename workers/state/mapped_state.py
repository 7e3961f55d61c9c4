"""The optimizer state DeepSpeed kept from a memory-mapped preload, copied into the process's own memory.

Why: a downloaded file is unpickled with its storages mapped from the file
(``syncpoint.workers.state.preload``): no second copy of every byte while the next file downloads,
and the load copies straight from the page cache. But ``torch.optim.Optimizer.load_state_dict``
keeps a tensor it is given when its dtype and device already match (``Tensor.to`` returns it), so
the optimizer's moments would stay views of the mapping, and every tensor of one file shares that
one mapping: a kept step counter alone pins the whole deleted file's disk space and page cache for
the rest of the run. After the load, each optimizer state tensor that lies in a mapping of the
fetched files is replaced by a copy, so the mapping ends with the fetch's cleanup (a test checks
that nothing maps the files afterwards, at ZeRO-1, 2 and 3).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch


def mapped_ranges(directory: str) -> list[tuple[int, int]]:
    """This process's address ranges that map a file under ``directory`` (``/proc/self/maps``; none
    where the system has no such file)."""
    prefix = os.path.join(os.path.realpath(directory), "")
    ranges = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return ranges


def copy_mapped_optimizer_state(engine: Any, directory: str) -> int:
    """Replace every optimizer state tensor of ``engine`` that lies in a mapping of a file under
    ``directory`` by a copy; how many were replaced."""
    ranges = mapped_ranges(directory)
    if not ranges:
        return 0
    copied = 0
    for per_param in _optimizer_states(engine):
        for key, value in list(per_param.items()):
            if torch.is_tensor(value) and _inside(value.untyped_storage().data_ptr(), ranges):
                per_param[key] = value.clone()
                copied += 1
    return copied


def _optimizer_states(engine: Any) -> Iterator[dict]:
    """Each parameter's state dict of the engine's optimizer and of the optimizer a ZeRO wrapper holds."""
    seen: set[int] = set()
    wrapper = getattr(engine, "optimizer", None)
    for optimizer in (wrapper, getattr(wrapper, "optimizer", None)):
        state = getattr(optimizer, "state", None)
        if optimizer is None or id(optimizer) in seen or not isinstance(state, dict):
            continue
        seen.add(id(optimizer))
        yield from (s for s in state.values() if isinstance(s, dict))


def _inside(address: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start <= address < end for start, end in ranges)
