"""A ``.npy`` token shard memory-mapped read-only, its header parsed without ``ast``.

Why not ``np.load(mmap_mode="r")`` alone: it parses the header dict with ``ast.literal_eval`` and
maps through ``np.memmap``, about 70 us a shard, and a resume opens a whole window of shards before
its first batch (four of them cost more than the rest of that batch). The headers ``np.save``
writes for plain integer arrays match one strict pattern, read here in a few microseconds; any
other header (Fortran order, structured or object dtypes, unusual spacing) returns ``None`` and the
caller falls back to ``np.load``. Nothing is ever unpickled: only integer dtypes are mapped.
"""

from __future__ import annotations

import math
import mmap
import os
import re

import numpy as np

MAGIC = b"\x93NUMPY"
HEAD_BYTES = 4096  # np.save pads the header to a multiple of 64 bytes; a plain array's is < 256
_HEADER = re.compile(
    rb"\{'descr': '(?P<descr>[<>|]?[iu][1248])', 'fortran_order': False, "
    rb"'shape': \((?P<shape>\d+,|\d+, \d+)\), \}\s*\n"
)


class NpyTruncated(ValueError):
    """The file is shorter than its header says."""


def parse_header(head: bytes) -> tuple[np.dtype, tuple[int, ...], int] | None:
    """(dtype, shape, data offset) of a plain C-order integer array's header; ``None`` otherwise."""
    if len(head) < 10 or not head.startswith(MAGIC):
        return None
    major = head[6]
    if major == 1:
        length, start = int.from_bytes(head[8:10], "little"), 10
    elif major in (2, 3):
        length, start = int.from_bytes(head[8:12], "little"), 12
    else:
        return None
    end = start + length
    if end > len(head):
        return None
    m = _HEADER.fullmatch(head[start:end])
    if m is None:
        return None
    shape = tuple(int(v) for v in m["shape"].split(b",") if v.strip())
    return np.dtype(m["descr"].decode()), shape, end


def map_npy(path: str) -> np.ndarray | None:
    """The array of a plain integer ``.npy`` file as a read-only view of its memory map, or ``None``
    when its header is not the plain kind (the caller uses ``np.load``). ``NpyTruncated`` when the
    file holds fewer bytes than the header's shape needs."""
    with open(path, "rb") as f:
        parsed = parse_header(f.read(HEAD_BYTES))
        if parsed is None:
            return None
        dtype, shape, offset = parsed
        count = math.prod(shape)  # Python ints: NumPy's reduction costs ~100 us cold, on a resume's path
        need = offset + count * dtype.itemsize
        size = os.fstat(f.fileno()).st_size
        if size < need:
            raise NpyTruncated(f"it holds {size} bytes, its header's shape {shape} needs {need}")
        if not count:  # an empty file region cannot be mapped
            empty = np.zeros(shape, dtype)
            empty.flags.writeable = False
            return empty
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)
