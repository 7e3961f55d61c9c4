"""The page-cache-bypassing writer: exact bytes for every size and chunking, on disks that take
O_DIRECT and on filesystems that refuse it (tmpfs), and nothing fsync'd after an error."""

from __future__ import annotations

import io
import os
import random

import pytest

from syncpoint.workers.storage.direct_io import ALIGN, BLOCK, DirectFileWriter

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 12345]


def _dirs(tmp_path):
    out = [tmp_path]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        out.append("/dev/shm")  # tmpfs refuses O_DIRECT: the buffered fallback
    return out


@pytest.mark.parametrize("size", SIZES)
def test_write_in_random_pieces_gives_the_exact_bytes(tmp_path, size):
    data = random.Random(size).randbytes(size)
    for d in _dirs(tmp_path):
        path = os.path.join(d, f"syncpoint-direct-test-{os.getpid()}-{size}.bin")
        try:
            rng, pos = random.Random(1), 0
            with DirectFileWriter(path) as f:
                while pos < size:
                    n = rng.choice([1, 7, ALIGN, 100_000, BLOCK + 3])
                    f.write(memoryview(data)[pos : pos + n])
                    pos += n
            with open(path, "rb") as r:
                assert r.read() == data
        finally:
            os.unlink(path)


@pytest.mark.parametrize("size", [0, ALIGN + 1, BLOCK + 1, 2 * BLOCK])
def test_fill_from_copies_and_shows_every_chunk(tmp_path, size):
    data = random.Random(size).randbytes(size)
    seen = []
    path = str(tmp_path / "copy.bin")
    with DirectFileWriter(path) as f:
        assert f.fill_from(io.BytesIO(data), lambda chunk: seen.append(bytes(chunk))) == size
    assert open(path, "rb").read() == data == b"".join(seen)


def test_an_error_inside_leaves_the_file_closed_and_the_buffers_reusable(tmp_path):
    path = str(tmp_path / "partial.bin")
    with pytest.raises(RuntimeError):
        with DirectFileWriter(path) as f:
            f.write(b"x" * (BLOCK + 5))
            raise RuntimeError("serialization failed")
    assert f.closed and f.buffers == []
    with DirectFileWriter(str(tmp_path / "next.bin")) as g:  # buffers came back to the pool
        g.write(b"y" * 10)
    assert open(tmp_path / "next.bin", "rb").read() == b"y" * 10
