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
    holders, sizes, load = _own_loads(needs)
    readers: dict[str, int] = {}
    for rel in sorted((r for r, hs in holders.items() if len(hs) > 1), key=lambda r: (-sizes[r], r)):
        reader = min(holders[rel], key=lambda rank: (load[rank], rank))
        readers[rel] = reader
        load[reader] += sizes[rel]
    return readers


def _own_loads(
    needs: Mapping[int, Mapping[str, int]],
) -> tuple[dict[str, list[int]], dict[str, int], dict[int, int]]:
    """Each file's ranks (in rank order) and size, and each rank's bytes of files only it needs."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank in sorted(needs):
        for rel, size in needs[rank].items():
            holders.setdefault(rel, []).append(rank)
            sizes[rel] = max(size, sizes.get(rel, 0))
    load = {rank: sum(size for rel, size in needs[rank].items() if len(holders[rel]) == 1) for rank in needs}
    return holders, sizes, load


MIN_PIECE = 16 << 20  # a prefetch smaller than this costs more in coordination than it balances


def prefetch_pieces(
    needs: Mapping[int, Mapping[str, int]], readers: Mapping[str, int], min_piece: int = MIN_PIECE
) -> dict[int, list[tuple[str, int, int]]]:
    """Byte ranges of the shared files that ranks other than the reader read ahead, or download for
    it (rank -> [(file, start, end)]), so a node's ranks read equal shares of its bytes.

    Why: the rank that checksums a shared file reads all of it, so at ZeRO-2 one rank of a node
    read the model file and its own shard while the others read only their shards and then waited
    for it (bench P10). A checksum is one sequential pass and cannot be split, but the page cache
    is shared: another rank that needs the same file reads the file's tail first, and the reader
    finds those bytes in memory; from an object store the other rank downloads the tail for the
    reader, which checksums the whole file (``syncpoint.workers.state.node_share``). Each shared
    file (largest first) is split by water-filling: the file's bytes go to the ranks that need it,
    lowest load first, until their loads are level; the reader keeps the head, the others get the
    tail in rank order. Pieces under ``min_piece`` bytes
    stay with the reader. Loads count the files only one rank needs and the shared files each
    reader was given (:func:`assign_readers`)."""
    holders, sizes, load = _own_loads(needs)
    for rel, reader in readers.items():
        load[reader] += sizes[rel]
    pieces: dict[int, list[tuple[str, int, int]]] = {}
    for rel in sorted(readers, key=lambda r: (-sizes[r], r)):
        reader, size = readers[rel], sizes[rel]
        helpers = [r for r in holders[rel] if r != reader]
        base = {reader: load[reader] - size, **{r: load[r] for r in helpers}}
        shares = _level(base, size)
        end = size
        for helper in sorted(helpers, reverse=True):  # the tail, in rank order from the reader's end
            share = shares[helper]
            if share < min_piece:
                continue
            pieces.setdefault(helper, []).insert(0, (rel, end - share, end))
            load[helper] += share
            load[reader] -= share
            end -= share
    return pieces


def _level(base: Mapping[int, int], total: int) -> dict[int, int]:
    """Split ``total`` bytes among ranks with ``base`` loads so the lowest loads rise to one level
    (water-filling): the level is where the ``k`` lowest loads, raised together, take ``total``."""
    loads = sorted(base.values())
    level = 0
    for k in range(1, len(loads) + 1):
        level = (total + sum(loads[:k])) // k
        if k == len(loads) or level <= loads[k]:
            break
    return {rank: max(0, level - b) for rank, b in base.items()}
