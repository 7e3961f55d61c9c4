"""A restore's files that several ranks of one node need are read and checksummed once per node.

Why: every rank of a ZeRO-1/2 restore loads DeepSpeed's whole model file, and at another world
size (or a ZeRO-3 module-only load) every rank reads every shard, so each rank of a node
downloaded (object store) or read and checksummed (local storage, the node's memory copy) the same
bytes again: a 2-rank node read 2.18 GB for a 1.74 GB state (bench P10). Now one rank reads each
such file (``syncpoint.policies.decisions.shared_reads``) and hands the others what it verified:

* **in place** (the file lies in the state directory or the memory copy): the file's identity when
  its checksum matched: device, inode, size, modification and change time. Another rank opens the
  same name itself, without following links, and takes its own descriptor as verified only when
  it has exactly that identity: the same test ``VerifiedFile.unchanged`` applies to a file of its
  own after the load, so nothing is trusted that the rank would not trust in its own file.
* **downloaded** (object store): the reading rank downloads into its private directory, as always;
  another rank hard-links that file into its own directory and takes it when the link is the inode
  the reader verified (device, inode, size, modification time; a link changes the change time).

Sharing saves reads; it never decides trust. When the reader failed, the identity differs, or the
link cannot be made (another file system), the rank reads and verifies the file itself, as before.

A download is also split by bytes: the reader of a shared file downloads its head, and each other
rank of the node that needs it downloads one range of its tail into its own directory
(``syncpoint.policies.decisions.shared_reads.prefetch_pieces``), so the node's ranks download equal shares
and finish together (at ZeRO-2 one rank downloaded the model file and its shard, the other only its
shard, and then waited for it: bench P10). The reader copies those ranges into its file, fetches
itself any range a rank could not, and checksums the whole file: a range is only bytes, trusted as
part of the file it completes, never alone.

Who shares: ranks of the same machine and temporary directory (boot id, host name, the temp dir's
device and inode), found by one gather of the whole process group per restore; a second gather
hands the downloaded ranges to their readers, and a third hands over the verified files. Every rank
makes each call exactly once (:meth:`NodePeers.finish` makes whatever a failed fetch left out), so
a rank that fails early never leaves the others waiting.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch.distributed as dist

from syncpoint.policies.contracts.errors import StateRefused
from syncpoint.policies.decisions.shared_reads import assign_readers, prefetch_pieces
from syncpoint.workers.integrity.verified_files import Identity, identity


@dataclass(frozen=True)
class Offer:
    """A file another rank of this node verified: where it lies (its directory) and its identity."""

    where: str
    identity: Identity


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, end)`` of a shared file that a rank downloaded for the file's reader, and the
    file they lie in (in that rank's private directory) with its identity when it was written."""

    rel: str
    start: int
    end: int
    path: str
    identity: Identity


class Splitter(Protocol):
    """How a download splits a shared file between the node's ranks (``read_split``)."""

    def head(self, rel: str, end: int) -> None:
        """Download bytes ``[0, end)`` of ``rel``, which this rank verifies once the rest arrives."""

    def piece(self, rel: str, start: int, end: int) -> tuple[str, Identity]:
        """Download bytes ``[start, end)`` of ``rel`` for its reader: (the file, its identity)."""

    def join(self, rel: str, pieces: Sequence[Piece]) -> Identity:
        """Complete ``rel`` after its head from ``pieces`` (fetching any range none holds), verify
        it, put it in place; its identity."""


def node_key() -> str:
    """What ranks that can share files agree on: the same kernel boot, host name and temp dir."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read(64).strip()
    except OSError:
        boot = ""
    tmp = tempfile.gettempdir()
    try:
        st = os.stat(tmp)
        where = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        where = ""
    return f"{boot}|{socket.gethostname()}|{os.path.realpath(tmp)}|{where}"


@dataclass
class NodePeers:
    """One restore's two gathers over the default process group (module docstring). Use once."""

    key: str = field(default_factory=node_key)
    readers: dict[str, int] = field(default_factory=dict)  # shared file -> the rank that reads it
    pieces: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)  # rank -> its ranges of shared files
    _wheres: dict[int, str] = field(default_factory=dict)
    _planned: bool = False
    _handed: bool = False
    _shared: bool = False

    @property
    def unused(self) -> bool:
        """Whether no gather was made yet (a restore from the memory copy that failed its check
        falls back to storage after its gathers: that download reads every file itself)."""
        return not self._planned

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def plan(self, needs: Mapping[str, int], where: str) -> None:
        """Gather every rank's needed files (name -> size) and directory; afterwards :meth:`reads`
        says which files this rank reads. Only ranks with this rank's node key share."""
        self._planned = True
        gathered: list[tuple[str, dict[str, int], str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.key, dict(needs), where))
        same = {r: g for r, g in enumerate(gathered) if g is not None and g[0] == self.key}
        self._wheres = {r: g[2] for r, g in same.items()}
        needs_of = {r: g[1] for r, g in same.items()}
        self.readers = assign_readers(needs_of) if len(same) > 1 else {}
        self.pieces = prefetch_pieces(needs_of, self.readers)

    def reads(self, rel: str) -> bool:
        """Whether this rank reads ``rel`` itself (first): its own files, and the shared ones it was given."""
        return self.readers.get(rel, self.rank) == self.rank

    def heads(self) -> dict[str, int]:
        """The shared files this rank reads whose tail other ranks download: file -> where the
        first of their ranges starts (this rank downloads the bytes before it)."""
        heads: dict[str, int] = {}
        for rank, ranges in self.pieces.items():
            for rel, start, _ in ranges:
                if rank != self.rank and self.readers.get(rel) == self.rank:
                    heads[rel] = min(start, heads.get(rel, start))
        return heads

    def hand_over(self, pieces: Sequence[Piece]) -> dict[str, list[Piece]]:
        """Hand the ranges this rank downloaded to their readers; those of the files this rank reads,
        in file order. Only a rank of this node is listened to."""
        self._handed = True
        gathered: list[list[Piece] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(pieces))
        mine: dict[str, list[Piece]] = {}
        for rank, got in enumerate(gathered):
            if rank == self.rank or rank not in self._wheres:
                continue
            for p in got or []:
                if self.readers.get(p.rel) == self.rank:
                    mine.setdefault(p.rel, []).append(p)
        return {rel: sorted(ps, key=lambda p: p.start) for rel, ps in mine.items()}

    def share(self, verified: Mapping[str, Identity]) -> dict[str, Offer]:
        """Hand over what this rank verified; the offers for the files another rank of the node read."""
        if not self._handed:
            self.hand_over([])
        self._shared = True
        gathered: list[dict[str, Identity] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {rel: verified[rel] for rel in verified if rel in self.readers})
        offers: dict[str, Offer] = {}
        for rel, reader in self.readers.items():
            done = gathered[reader] or {}
            if reader != self.rank and rel in done:
                offers[rel] = Offer(self._wheres[reader], tuple(done[rel]))  # type: ignore[arg-type]
        return offers

    def finish(self) -> None:
        """Make the gathers this rank has not made yet (a fetch that failed before them), empty."""
        if not self._planned:
            self.plan({}, "")
        if not self._handed:
            self.hand_over([])
        if not self._shared:
            self.share({})


def read_split(
    peers: NodePeers | None,
    needs: Mapping[str, int],
    where: str,
    mine: Callable[[str], Identity],
    rest: Callable[[str, Offer | None], None],
    read_ahead: Callable[[str, int, int], None] | None = None,
    split: Splitter | None = None,
) -> None:
    """Read ``needs`` (file -> size, in order) the node's way: this rank's share first (``mine``
    reads and verifies one file and returns its identity), then the gather that hands the results
    over, then every other file (``rest``, given another rank's offer, or ``None``: read it
    yourself). Without ``peers`` every file is this rank's. The gather is made even when ``mine``
    raises, so the other ranks never wait for this one.

    ``read_ahead(file, start, end)``: warm the page cache with a range of a shared file that
    another rank of the node checksums (``syncpoint.policies.decisions.shared_reads.prefetch_pieces``); this
    rank does its ranges first, and every rank then reads its files only it needs before the shared
    ones it checksums, so the ranges are in memory when the checksum reaches them. A failed read
    ahead is ignored: it decides nothing, the checksum still reads every byte.

    ``split`` (downloads): the same ranges are downloaded for the reader instead (module
    docstring): every rank downloads its files only it needs first, then its heads and ranges of
    the shared files; the ranges are handed over, and each reader completes and verifies its
    files before the results are. A range that failed is left out: its reader fetches it."""
    if peers is None:
        for rel in needs:
            mine(rel)
        return
    done: dict[str, Identity] = {}
    offers: dict[str, Offer] = {}
    peers.plan(needs, where)
    try:
        if read_ahead is not None:
            for rel, start, end in peers.pieces.get(peers.rank, []):
                try:
                    read_ahead(rel, start, end)
                except (OSError, StateRefused):
                    pass
        order = sorted(needs, key=lambda rel: rel in peers.readers)  # stable: files only this rank needs first
        if split is None:
            done.update((rel, mine(rel)) for rel in order if peers.reads(rel))
        else:
            _download_split(peers, order, mine, split, done)
    finally:
        offers = peers.share(done)
    for rel in needs:
        if rel not in done:
            rest(rel, offers.get(rel))


def _download_split(
    peers: NodePeers, order: Sequence[str], mine: Callable[[str], Identity], split: Splitter, done: dict[str, Identity]
) -> None:
    """This rank's files, the heads of the shared files it reads and its ranges of the others' (in
    that order); then the ranges are handed over and each of this rank's shared files completed."""
    heads = peers.heads()
    for rel in order:
        if rel in heads:
            split.head(rel, heads[rel])
        elif peers.reads(rel):
            done[rel] = mine(rel)
    arrived = peers.hand_over(_pieces_for_readers(split, peers.pieces.get(peers.rank, [])))
    for rel in heads:
        done[rel] = split.join(rel, arrived.get(rel, []))


def _pieces_for_readers(split: Splitter, ranges: Sequence[tuple[str, int, int]]) -> list[Piece]:
    """Download this rank's ranges of shared files for their readers; a range that fails is left
    out (its reader fetches it, and decides what a failure of storage or content means)."""
    pieces = []
    for rel, start, end in ranges:
        try:
            pieces.append(Piece(rel, start, end, *split.piece(rel, start, end)))
        except (OSError, StateRefused):
            pass
    return pieces


def link_from_peer(offer: Offer, src: str, partial_dir: str, dest: str) -> bool:
    """Hard-link a peer's downloaded file (``src``, inside ``offer.where``) to ``dest`` when the link
    is the inode the peer verified; ``False`` (nothing left behind) when it cannot or is not."""
    tmp = os.path.join(partial_dir, f"peer-{secrets.token_hex(8)}")
    try:
        os.link(src, tmp, follow_symlinks=False)
    except OSError:
        return False
    try:
        st = os.lstat(tmp)
        if not stat.S_ISREG(st.st_mode) or identity(st)[:4] != offer.identity[:4]:
            os.unlink(tmp)
            return False
        os.replace(tmp, dest)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
