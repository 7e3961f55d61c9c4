"""A state's files downloaded into a rank's private directory, each renamed into place only once
its size and checksum match its manifest entry.

Why a module of its own: a download is where storage's bytes become files DeepSpeed reads, so one
place says how every such file gets there: downloaded whole by this rank, hard-linked from the
rank of the node that downloaded and verified it, or assembled from ranges the node's ranks
downloaded side by side (``syncpoint.workers.state.node_share``). Whichever way, the same check
decides before the rename: the bytes on this rank's disk against the manifest, and a file that
fails it never reaches the state's place in the directory. With ``preloads``, each DeepSpeed file
in place starts unpickling (``syncpoint.workers.state.preload``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from syncpoint.policies.contracts.errors import OversizedEntry, StateRefused, UnsafeEntry
from syncpoint.policies.contracts.state_format import ENGINE_TAG, STATES_DIR, ManifestEntry, local_path
from syncpoint.workers.integrity.verified_files import ChecksumMismatch, Identity, identity
from syncpoint.workers.state.node_share import NodePeers, Offer, Piece, link_from_peer, read_split
from syncpoint.workers.state.preload import Preloads
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.fsspec_backend import checksum_file
from syncpoint.workers.storage.protocol import CHUNK

PARTIAL_DIR = ".partial"  # downloads land here first; only engine/ and optim/ entries are fetched: no clash


def download_all(
    storage: RunStorage,
    name: str,
    files: dict[str, ManifestEntry],
    fetched: list[str],
    local: str,
    peers: NodePeers | None,
    preloads: Preloads | None,
) -> None:
    """Download and verify ``fetched`` into ``local``; with ``peers``, a file another rank of this
    node downloaded is hard-linked from its directory instead, and a file several ranks need is
    downloaded by them side by side (``syncpoint.workers.state.node_share``); with ``preloads``,
    each DeepSpeed file is handed there once it is in place."""

    def mine(rel: str) -> Identity:
        download_verified(storage, name, rel, files[rel], local)
        _preload(preloads, rel, local_path(local, rel))
        return identity(os.lstat(local_path(local, rel)))

    def rest(rel: str, offer: Offer | None) -> None:
        if not _link_offered(offer, rel, local):
            download_verified(storage, name, rel, files[rel], local)
        _preload(preloads, rel, local_path(local, rel))

    split = SplitDownload(storage, name, files, local, preloads)
    read_split(peers, {rel: files[rel].size for rel in fetched}, local, mine, rest, split=split)


def download_verified(storage: RunStorage, name: str, rel: str, entry: ManifestEntry, local: str) -> None:
    """Download under a temporary name; rename into place only once size and checksum matched."""
    dest = destination(local, rel)  # before any byte is fetched
    partial = _partial(local)
    with storage_refusals(rel, entry):
        size, digest = storage.download_file(partial, STATES_DIR, name, rel, limit=entry.size, algo=entry.algorithm)
    _place(partial, size, digest, rel, entry, dest)


@dataclass
class SplitDownload:
    """A shared file downloaded by the node's ranks side by side (``node_share.read_split``): its head
    by this rank, its other ranges by the ranks that need it too, checksummed whole before use."""

    storage: RunStorage
    name: str
    files: dict[str, ManifestEntry]
    local: str
    preloads: Preloads | None
    heads: dict[str, tuple[str, int]] = field(default_factory=dict)  # file -> (partial file, bytes in it)

    def head(self, rel: str, end: int) -> None:
        destination(self.local, rel)  # before any byte is fetched
        partial = _partial(self.local, "head-")
        self.heads[rel] = (partial, end)
        self._fetch(rel, partial, 0, end)

    def piece(self, rel: str, start: int, end: int) -> tuple[str, Identity]:
        partial = _partial(self.local, "piece-")
        self._fetch(rel, partial, start, end, at=0)
        return partial, identity(os.lstat(partial))

    def join(self, rel: str, pieces: Sequence[Piece]) -> Identity:
        partial, at = self.heads.pop(rel)
        entry = self.files[rel]
        copied = False
        for p in pieces:  # in file order; one that does not continue the file is skipped
            if p.start == at and p.end <= entry.size and copy_piece(p, partial):
                at, copied = p.end, True
        if at < entry.size:  # what no rank brought: fetched here
            self._fetch(rel, partial, at, entry.size)
        size, digest = checksum_file(partial, entry.algorithm)
        if copied and (size, digest) != (entry.size, entry.digest):
            os.unlink(partial)  # another rank's bytes never decide a refusal: this rank's own download does
            download_verified(self.storage, self.name, rel, entry, self.local)
        else:
            _place(partial, size, digest, rel, entry, destination(self.local, rel))
        _preload(self.preloads, rel, local_path(self.local, rel))
        return identity(os.lstat(local_path(self.local, rel)))

    def _fetch(self, rel: str, path: str, start: int, end: int, at: int | None = None) -> None:
        """Bytes ``[start, end)`` of ``rel`` into ``path`` at ``at`` (their own offset by default)."""
        entry = self.files[rel]
        with storage_refusals(rel, entry):
            self.storage.download_range(
                path, STATES_DIR, self.name, rel, start=start, end=end, limit=entry.size, at=start if at is None else at
            )


def copy_piece(piece: Piece, partial: str) -> bool:
    """Copy a range another rank of the node downloaded into ``partial`` at its offset, when its file
    is still the regular file of the identity it was handed over with; ``False`` otherwise (the
    caller fetches the range itself). Its bytes are checked with the whole file."""
    try:
        src = os.open(piece.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(src)
        length = piece.end - piece.start
        if not stat.S_ISREG(st.st_mode) or identity(st) != piece.identity or st.st_size != length:
            return False
        dst = os.open(partial, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            done = 0
            while done < length and (chunk := os.pread(src, min(CHUNK, length - done), done)):
                os.pwrite(dst, chunk, piece.start + done)
                done += len(chunk)
        finally:
            os.close(dst)
        return done == length
    except OSError:
        return False
    finally:
        os.close(src)


def destination(local: str, rel: str) -> str:
    """Where ``rel`` (already a safe path) lands under ``local``, checked after resolving links:
    a second line of defence should the rule in ``path_problem`` ever miss a case."""
    dest = local_path(local, rel)
    root = os.path.realpath(local)
    resolved = os.path.realpath(dest)
    if resolved == root or os.path.commonpath([root, resolved]) != root:
        raise StateRefused(f"manifest entry {rel!r} resolves outside the state ({resolved}): refused (corrupt)")
    return dest


def _partial(local: str, prefix: str = "tmp") -> str:
    """A new empty file in this rank's directory for bytes not verified yet."""
    partial_dir = os.path.join(local, PARTIAL_DIR)
    os.makedirs(partial_dir, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=partial_dir, prefix=prefix)
    os.close(fd)
    return partial


@contextlib.contextmanager
def storage_refusals(rel: str, entry: ManifestEntry, missing: bool = True) -> Iterator[None]:
    """What storage says about a listed file, as the refusal of the state it belongs to (with
    ``missing=False`` a missing file raises ``FileNotFoundError``: the caller tells what it means)."""
    try:
        yield
    except FileNotFoundError:
        if not missing:
            raise
        raise StateRefused(f"{rel}: missing from storage, though the manifest lists it: refused (corrupt)") from None
    except OversizedEntry:
        raise ChecksumMismatch(
            f"{rel} is larger than the {entry.size} bytes the manifest says (changed after commit)"
        ) from None
    except UnsafeEntry as e:
        raise StateRefused(f"{e}: refused (corrupt)") from None


def _place(partial: str, size: int, digest: str, rel: str, entry: ManifestEntry, dest: str) -> None:
    """Rename a downloaded file to ``dest`` when its size and checksum match ``entry``; else remove it."""
    if size != entry.size:
        os.unlink(partial)
        raise ChecksumMismatch(f"{rel} is {size} bytes, the manifest says {entry.size} (changed after commit)")
    if digest != entry.digest:
        os.unlink(partial)
        raise ChecksumMismatch(f"{rel}: {entry.algorithm} does not match the manifest (content changed after commit)")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.replace(partial, dest)


def _preload(preloads: Preloads | None, rel: str, path: str) -> None:
    """Start unpickling a verified DeepSpeed file (``syncpoint.workers.state.preload``)."""
    if preloads is not None and rel.startswith(f"{ENGINE_TAG}/") and rel.endswith(".pt"):
        preloads.add(rel, path)


def _link_offered(offer: Offer | None, rel: str, local: str) -> bool:
    """Whether ``rel`` is now in ``local``, linked from the peer that downloaded and verified it."""
    if offer is None:
        return False
    dest = destination(local, rel)
    partial_dir = os.path.join(local, PARTIAL_DIR)
    os.makedirs(partial_dir, exist_ok=True)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    return link_from_peer(offer, local_path(offer.where, rel), partial_dir, dest)
