"""Which rank of a node reads each file several of its ranks need (``syncpoint.policies.shared_reads``)."""

from __future__ import annotations

from syncpoint.policies.shared_reads import assign_readers


def test_readers_balance_a_nodes_bytes_and_agree_on_every_rank():
    needs = {0: {"model": 40, "s0": 60}, 1: {"model": 40, "s1": 60}, 2: {"model": 40, "s2": 10}}
    assert assign_readers(needs) == {"model": 2}  # rank 2 has the fewest bytes of its own (10)
    every = {r: {"a": 50, "b": 30, "c": 20, "d": 10} for r in range(2)}
    readers = assign_readers(every)
    assert readers == {"a": 0, "b": 1, "c": 1, "d": 0}  # 60 bytes each
    assert assign_readers({0: {"x": 1}}) == {} and assign_readers({}) == {}
    assert assign_readers(dict(reversed(list(needs.items())))) == assign_readers(needs)  # order of ranks is no matter
