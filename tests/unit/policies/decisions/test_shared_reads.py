"""Which rank of a node reads each file several of its ranks need (``syncpoint.policies.decisions.shared_reads``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from syncpoint.policies.decisions.shared_reads import assign_readers, prefetch_pieces


def test_readers_balance_a_nodes_bytes_and_agree_on_every_rank():
    needs = {0: {"model": 40, "s0": 60}, 1: {"model": 40, "s1": 60}, 2: {"model": 40, "s2": 10}}
    assert assign_readers(needs) == {"model": 2}  # rank 2 has the fewest bytes of its own (10)
    every = {r: {"a": 50, "b": 30, "c": 20, "d": 10} for r in range(2)}
    readers = assign_readers(every)
    assert readers == {"a": 0, "b": 1, "c": 1, "d": 0}  # 60 bytes each
    assert assign_readers({0: {"x": 1}}) == {} and assign_readers({}) == {}
    assert assign_readers(dict(reversed(list(needs.items())))) == assign_readers(needs)  # order of ranks is no matter


def _disk_loads(needs, readers, pieces):
    """Bytes each rank reads from disk: files only it needs, its shared files less the pieces
    others read ahead, and its own pieces."""
    holders = {}
    for rank, files in needs.items():
        for rel in files:
            holders.setdefault(rel, []).append(rank)
    load = {r: sum(s for rel, s in files.items() if len(holders[rel]) == 1) for r, files in needs.items()}
    for rel, reader in readers.items():
        load[reader] += max(needs[r][rel] for r in holders[rel])
    for rank, ranges in pieces.items():
        for rel, start, end in ranges:
            load[rank] += end - start
            load[readers[rel]] -= end - start
    return load


def test_a_shared_files_tail_is_read_ahead_until_the_nodes_loads_are_level():
    needs = {0: {"model": 440, "s0": 650}, 1: {"model": 440, "s1": 650}}
    readers = assign_readers(needs)
    assert readers == {"model": 0}
    assert prefetch_pieces(needs, readers, min_piece=1) == {1: [("model", 220, 440)]}
    assert _disk_loads(needs, readers, prefetch_pieces(needs, readers, min_piece=1)) == {0: 870, 1: 870}
    four = {r: {"model": 400, f"s{r}": 100} for r in range(4)}
    pieces = prefetch_pieces(four, assign_readers(four), min_piece=1)
    assert pieces == {1: [("model", 100, 200)], 2: [("model", 200, 300)], 3: [("model", 300, 400)]}
    busy = {0: {"model": 440, "s0": 650}, 1: {"model": 440, "s1": 1300}}
    assert prefetch_pieces(busy, assign_readers(busy), min_piece=1) == {}  # the reader is the idler rank
    assert prefetch_pieces(needs, readers, min_piece=300) == {}  # a piece under the minimum stays
    assert prefetch_pieces({}, {}) == {} and prefetch_pieces({0: {"x": 5}}, {}) == {}


@given(
    st.dictionaries(
        st.integers(0, 5),
        st.dictionaries(st.sampled_from(["m", "n", "a", "b", "c"]), st.integers(0, 10_000), max_size=4),
        max_size=5,
    ),
    st.integers(1, 3_000),
)
@settings(max_examples=300, deadline=None)
def test_read_ahead_pieces_only_ever_level_a_nodes_reads(raw, min_piece):
    """Any node: pieces lie at the tail of a shared file a helper needs (all of it, when the reader
    is busier than every helper), never overlap, are at least ``min_piece`` bytes, and never raise
    the busiest rank's load."""
    sizes = {}
    needs = {}
    for rank, files in raw.items():  # one size per file, as in a real state
        needs[rank] = {rel: sizes.setdefault(rel, size) for rel, size in files.items()}
    readers = assign_readers(needs)
    pieces = prefetch_pieces(needs, readers, min_piece=min_piece)
    assert pieces == prefetch_pieces(dict(reversed(list(needs.items()))), readers, min_piece=min_piece)
    spans = {}
    for rank, ranges in pieces.items():
        for rel, start, end in ranges:
            assert rel in readers and readers[rel] != rank and rel in needs[rank]
            assert 0 <= start < end <= sizes[rel] and end - start >= min_piece
            spans.setdefault(rel, []).append((start, end))
    for rel, ranges in spans.items():
        ranges.sort()
        assert ranges[-1][1] == sizes[rel]  # the tail
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous, no overlap
    before = _disk_loads(needs, readers, {})
    after = _disk_loads(needs, readers, pieces)
    assert sum(after.values()) == sum(before.values())
    assert max(after.values(), default=0) <= max(before.values(), default=0)
