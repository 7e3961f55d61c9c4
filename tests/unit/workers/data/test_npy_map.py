"""``syncpoint.workers.data.npy_map``: a ``.npy`` token shard mapped without ``ast``. It must read exactly
what ``np.load`` reads for the plain headers ``np.save`` writes, hand anything else back to NumPy,
and never trust a header's shape beyond the file's bytes."""

from __future__ import annotations

import numpy as np
import pytest

from syncpoint.workers.data.npy_map import NpyTruncated, map_npy, parse_header


@pytest.mark.parametrize("dtype", ["<u2", "<i4", "<i8", ">i4", "|u1", "<u8", "<i2"])
@pytest.mark.parametrize("shape", [(0,), (1,), (1000,), (7, 3), (0, 5)])
@pytest.mark.parametrize("version", [None, (1, 0), (2, 0), (3, 0)])
def test_a_plain_integer_array_maps_to_what_np_load_reads(tmp_path, dtype, shape, version):
    arr = (np.arange(int(np.prod(shape))) % 250).astype(dtype).reshape(shape)
    path = tmp_path / "a.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, arr, version=version)
    got = map_npy(str(path))
    assert got is not None
    want = np.load(path, mmap_mode="r", allow_pickle=False)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want)
    assert not got.flags.writeable


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(4.0),  # floats: not tokens, NumPy's own error path
        np.asfortranarray(np.arange(6).reshape(2, 3)),
        np.zeros(3, dtype=[("a", "<i4"), ("b", "<i4")]),
        np.arange(8).reshape(2, 2, 2),  # 3-D: not a token layout here
    ],
)
def test_any_other_header_is_handed_back_to_numpy(tmp_path, arr):
    path = tmp_path / "a.npy"
    np.save(path, arr)
    assert map_npy(str(path)) is None


def test_a_header_is_never_evaluated_and_odd_bytes_are_not_plain():
    assert parse_header(b"") is None
    assert parse_header(b"\x93NUMPY\x09\x00" + b"\x00" * 20) is None  # unknown version
    evil = b"{'descr': __import__('os').system('x'), 'fortran_order': False, 'shape': (3,), }\n"
    head = b"\x93NUMPY\x01\x00" + len(evil).to_bytes(2, "little") + evil
    assert parse_header(head) is None
    pickled = b"{'descr': '|O', 'fortran_order': False, 'shape': (3,), }\n"
    assert parse_header(b"\x93NUMPY\x01\x00" + len(pickled).to_bytes(2, "little") + pickled) is None
    long = b"\x93NUMPY\x01\x00" + (10**4).to_bytes(2, "little") + b" " * 100  # says longer than it is
    assert parse_header(long) is None


def _npy_bytes(header: bytes, body: bytes) -> bytes:
    text = header + b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + body


def test_a_header_that_claims_more_rows_than_the_file_holds_is_refused_before_mapping(tmp_path):
    huge = tmp_path / "huge.npy"
    huge.write_bytes(_npy_bytes(b"{'descr': '<u2', 'fortran_order': False, 'shape': (10000000000000,), }", b"\0" * 20))
    with pytest.raises(NpyTruncated, match="needs"):
        map_npy(str(huge))
    short = tmp_path / "short.npy"
    np.save(short, np.arange(10, dtype=np.uint16))
    short.write_bytes(short.read_bytes()[:-4])
    with pytest.raises(NpyTruncated, match="needs"):
        map_npy(str(short))
    ok = tmp_path / "ok.npy"
    ok.write_bytes(_npy_bytes(b"{'descr': '<u2', 'fortran_order': False, 'shape': (3,), }", b"\1\0\2\0\3\0"))
    assert map_npy(str(ok)).tolist() == [1, 2, 3]
