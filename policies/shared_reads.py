"""Which rank of a node reads and checksums each file that several of its ranks need.

Why: at ZeRO-1/2 every rank loads DeepSpeed's whole model file, and at another world size (or a
ZeRO-3 module-only load) every rank reads every shard, so a node with N ranks read or downloaded those files N times.
One rank per file is enough (``syncpoint.workers.state.node_share`` hands the others its result).
A pure function, so every rank computes the same answer from the same gathered lists, with no
further message. A leaf module: it imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Mapping


def assign_readers(needs: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    """Each file that two or more ranks of one node need (``needs``: rank -> {file: size}) -> the
    rank that reads it for them. Largest files first, each to the rank with the fewest bytes to
    read so far (its files no other rank needs counted too), the lowest rank on a tie: the node's
    reading is balanced, and the answer depends only on ``needs``. A file only one rank needs is
    not listed: that rank reads it, as it always did."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank in sorted(needs):
        for rel, size in needs[rank].items():
            holders.setdefault(rel, []).append(rank)
            sizes[rel] = max(size, sizes.get(rel, 0))
    load = {rank: sum(size for rel, size in needs[rank].items() if len(holders[rel]) == 1) for rank in needs}
    readers: dict[str, int] = {}
    for rel in sorted((r for r, hs in holders.items() if len(hs) > 1), key=lambda r: (-sizes[r], r)):
        reader = min(holders[rel], key=lambda rank: (load[rank], rank))
        readers[rel] = reader
        load[reader] += sizes[rel]
    return readers
