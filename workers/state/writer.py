"""The state writer: every rank's files first, then ``manifest.json`` last, by rank 0.

``StateWriter`` is bound once per attempt to the engine, the run's storage, rank 0's lease, the
signing key, the checksum algorithm and the fault injector; each save passes only what changes
(``trainer.json``'s record and this rank's per-rank parts' files). Its phase order is in its docstring.
Anything without a manifest is torn and selection rejects it: a crash at any phase before the
manifest's commit leaves a state nobody resumes from.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from syncpoint.policies.contracts.errors import LeaseLostError, UnsafeEntry
from syncpoint.policies.contracts.state_format import (
    ENGINE_TAG,
    LOCAL_DIRS,
    MANIFEST_FILE,
    STATES_DIR,
    TRAINER_FILE,
    Manifest,
    ManifestEntry,
    TrainState,
    json_bytes,
    state_name,
)
from syncpoint.policies.decisions.retention import is_state_name
from syncpoint.workers.integrity.checksum import DEFAULT, ChecksummingWriter, checksum_bytes, entry
from syncpoint.workers.integrity.signing import BINDING, binding_of, sign
from syncpoint.workers.state.checkpoint_engine import Sink, StreamingCheckpointEngine, install, write_captured
from syncpoint.workers.state.memory_copy import MemoryCopy
from syncpoint.workers.state.staging import staging_prefix, staging_root, sweep_stale_staging
from syncpoint.workers.storage import RunStorage, nofollow
from syncpoint.workers.storage.lease import RunLease
from syncpoint.workers.supervision.faults import Faults

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


@dataclass
class SaveResult:
    """One committed save as the loop reports it (log line, events, goodput): which state, its
    size, and the time it cost in all and the part training waited for."""

    name: str
    optimizer_step: int
    bytes: int
    seconds: float  # from the boundary to the commit
    blocked_seconds: float  # how long the training loop waited
    background_cpu_seconds: float = 0.0  # an async save's upload thread's CPU time (0 when synchronous)
    contended_seconds: float = 0.0  # the part of it busy cores gave up (``SaveCoordinator`` says)


class NonfiniteSnapshot(Exception):
    """An async save's snapshot held a non-finite parameter or optimizer moment on some rank: it was
    not committed (its files are deleted), and the save request waits for a finite boundary."""

    def __init__(self, name: str, ranks: list[int]) -> None:
        super().__init__(f"the snapshot of state {name} is not finite on rank(s) {ranks}")
        self.name, self.ranks = name, ranks


@dataclass
class Snapshot:
    """What a save captured at its boundary, on local disk/memory, before any upload."""

    name: str
    staging: str
    trainer: TrainState  # trainer.json (``json_bytes(trainer.record())`` is what rank 0 writes)
    started: float
    algo: str = DEFAULT  # checksum algorithm of the manifest entries
    blocked: float = 0.0
    background_cpu: float = 0.0  # the upload thread's CPU time (``AsyncUpload``)
    # an async snapshot's parameters and optimizer state are finite (the upload thread checks its
    # copies: ``SnapshotArena.finite``); a synchronous save's were checked before it began
    finite: bool = True
    files: dict[str, ManifestEntry] = field(default_factory=dict)  # this rank's files already in storage
    # async: DeepSpeed's shards copied into the engine's arena, to serialize in the background; the
    # engine whose arena holds them (released once they are written)
    captured: dict[str, Any] = field(default_factory=dict, repr=False)
    arena_of: StreamingCheckpointEngine | None = field(default=None, repr=False)
    # set once the arena holds every staged copy (the upload thread makes them first): training waits
    # for it before its next optimizer step (``StateWriter.wait_staged``)
    copied: threading.Event | None = field(default=None, repr=False)
    signing_key: bytes | None = field(
        default=None, repr=False
    )  # rank 0 signs the manifest (syncpoint.workers.integrity.signing)
    # this rank's file of every per-rank part the save carries, captured at the boundary, by path in
    # the state (syncpoint.workers.state.rank_parts: RNG, buffers, Task.stateful objects, stream position)
    rank_files: dict[str, bytes] = field(default_factory=dict, repr=False)
    memory: MemoryCopy | None = field(default=None, repr=False)  # this node's copy (memory_copy), written alongside


def take_snapshot(
    engine: DeepSpeedEngine,
    trainer: TrainState,
    faults: Faults,
    full_optimizer_state: bool = False,
    *,
    algo: str = DEFAULT,
    direct: RunStorage | None = None,
    signing_key: bytes | None = None,
    rank_files: Mapping[str, bytes] | None = None,
    memory: MemoryCopy | None = None,
    since: float | None = None,
) -> Snapshot:
    """The blocking part of a save (all ranks, at a boundary): DeepSpeed serializes its shards,
    checksummed on the way, straight into storage (``direct``: a synchronous save), or, for an
    asynchronous one, its shards' tensors are only copied into the engine's reusable host buffers
    (serialized later by :func:`upload_snapshot`); elastic ZeRO-1/2 runs add the gathered
    optimizer state (into local staging). ``rank_files``: this rank's file of every per-rank part,
    captured at the same boundary (``syncpoint.workers.state.rank_parts.capture_all``), by path in the state.
    ``since``: when the loop began servicing this save (``perf_counter``): its blocked time and its time to
    durable storage count from there."""
    t0 = time.perf_counter() if since is None else since
    faults.save_started()
    faults.at_phase("before_shards")
    name = state_name(trainer.global_micro_step)
    staging = tempfile.mkdtemp(prefix=staging_prefix(), dir=staging_root())
    ce = install(engine)
    written: dict[str, ManifestEntry] = {}
    captured: dict[str, Any] = {}
    try:
        if direct is not None:
            with ce.streaming(staging, _durable_sink(direct, name, algo, memory)) as written:
                engine.save_checkpoint(staging, tag=ENGINE_TAG, save_latest=False)
        else:
            with ce.capturing(staging, now=_changed_by_forward(engine)) as captured:
                engine.save_checkpoint(staging, tag=ENGINE_TAG, save_latest=False)
        if full_optimizer_state:
            from syncpoint.workers.state.elastic_state import save_full_optimizer_state

            save_full_optimizer_state(engine, staging, dist.get_rank())
    except BaseException:
        if direct is None:
            ce.arena.release()  # nothing will be written from it
        shutil.rmtree(staging, ignore_errors=True)
        raise
    snap = Snapshot(
        name,
        staging,
        trainer,
        t0,
        algo=algo,
        signing_key=signing_key,
        rank_files=dict(rank_files or {}),
        memory=memory,
    )
    snap.files.update(written)
    if direct is None:
        snap.captured, snap.arena_of, snap.copied = dict(captured), ce, ce.arena.copied
    snap.blocked = time.perf_counter() - t0
    return snap


def _changed_by_forward(engine: DeepSpeedEngine) -> Callable[[Any], bool]:
    """Which of the state's tensors a forward pass changes in place: the module's buffers (BatchNorm
    statistics), by their memory. Their copies are made at the boundary; every other tensor of the
    state (parameters, their ZeRO partitions, optimizer moments) changes only at the next optimizer
    step, so its copy is staged (``syncpoint.workers.state.snapshot_arena``)."""
    memory = {b.untyped_storage().data_ptr() for b in engine.module.buffers()}
    return lambda t: t.untyped_storage().data_ptr() in memory


def _durable_sink(storage: RunStorage, name: str, algo: str, memory: MemoryCopy | None = None) -> Sink:
    def durable_sink(rel: str) -> AbstractContextManager[ChecksummingWriter]:
        durable = storage.open_durable(STATES_DIR, name, rel, algo=algo)
        return durable if memory is None else _teed(durable, memory, name, rel)

    return durable_sink


class _Tee:
    """A writer's target that also copies every byte into this node's memory copy. The copy is best
    effort: a failed write (shared memory full) drops that file's copy, never the save."""

    def __init__(self, target: Any, fd: int | None) -> None:
        self.target, self.fd, self.failed = target, fd, False

    def write(self, data: Any) -> Any:
        written = self.target.write(data)
        if self.fd is not None:
            try:
                nofollow.write_all(self.fd, data)
            except OSError:
                self.fd, self.failed = None, True
        return written

    def flush(self) -> None:
        self.target.flush()


@contextlib.contextmanager
def _teed(
    durable: AbstractContextManager[ChecksummingWriter], memory: MemoryCopy, name: str, rel: str
) -> Iterator[ChecksummingWriter]:
    with durable as writer, contextlib.ExitStack() as copy:
        try:
            fd: int | None = copy.enter_context(memory.file(name, rel))
        except (OSError, UnsafeEntry):
            fd = None
        tee = _Tee(writer.target, fd)
        writer.target = tee
        yield writer
    if tee.failed:
        memory.discard(name, rel)


def _copy_to_memory(memory: MemoryCopy | None, name: str, rel: str, data: bytes | None = None, path: str = "") -> None:
    """A file's memory copy, from its bytes or its local ``path``; best effort (a failure only means
    this file restores from storage)."""
    if memory is not None:
        try:
            if data is not None:
                memory.write_bytes(name, rel, data)
            else:
                memory.copy_file(name, rel, path)
        except (OSError, UnsafeEntry):
            memory.discard(name, rel)


def upload_snapshot(storage: RunStorage, snap: Snapshot, rank: int, faults: Faults) -> dict[str, ManifestEntry]:
    """Make this rank's files durable in storage (safe to run in a background thread): an async
    save's copied shards are serialized straight into storage (checksummed on the way; then the
    arena is free for the next save), what is in staging is copied (no second read when its
    checksum is known), then this rank's per-rank parts' files. An async snapshot whose parameters or
    optimizer state are not finite writes nothing (``Snapshot.finite``: checked here, on its copies, so
    that the check of every byte of the state costs the training loop nothing)."""
    mine: dict[str, ManifestEntry] = dict(snap.files)
    try:
        if snap.arena_of is not None:
            ce = snap.arena_of
            try:
                ce.arena.end_copies()  # the staged copies first: training waits for them at its next step
                snap.finite = ce.arena.finite()
                if snap.finite:
                    mine.update(
                        write_captured(
                            snap.captured,
                            _durable_sink(storage, snap.name, snap.algo, snap.memory),
                            ce.zipfile_serialization,
                        )
                    )
            finally:
                snap.captured, snap.arena_of = {}, None
                ce.arena.release()
        if not snap.finite:  # never committed (``commit_snapshot``): nothing more is written
            snap.files = {}
            return {}
        for sub in LOCAL_DIRS:
            src = os.path.join(snap.staging, sub)
            for fname in sorted(os.listdir(src)) if os.path.isdir(src) else []:
                rel, staged = f"{sub}/{fname}", os.path.join(src, fname)
                size, digest = storage.upload_file(staged, STATES_DIR, snap.name, sub, fname, algo=snap.algo)
                _copy_to_memory(snap.memory, snap.name, rel, path=staged)  # e.g. elastic ZeRO's gathered optimizer
                mine[rel] = entry(size, snap.algo, digest)
    finally:
        shutil.rmtree(snap.staging, ignore_errors=True)
    for rel, data in snap.rank_files.items():
        storage.write_bytes(data, STATES_DIR, snap.name, rel)
        _copy_to_memory(snap.memory, snap.name, rel, data)
        mine[rel] = entry(len(data), snap.algo, checksum_bytes(data, snap.algo))
    faults.at_phase("after_some_shards")
    snap.files = mine
    return mine


def commit_snapshot(storage: RunStorage, snap: Snapshot, faults: Faults, lease: RunLease | None = None) -> SaveResult:
    """All ranks, main thread: the gather proves every rank's files are durable (and, for an async
    snapshot, that every rank's copies are finite: else none commits and ``NonfiniteSnapshot`` says
    which ranks' were not), then rank 0
    writes trainer.json, confirms it still holds the run directory's lease (``lease``, rank 0's)
    and commits the manifest with the lease's fencing generation; the closing broadcast tells
    everyone it is committed, or that the lease was lost, in which case every rank raises
    ``LeaseLostError`` (nobody is left waiting in a barrier)."""
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    verdict: str | None = None
    gathered: list[tuple[dict[str, ManifestEntry], bool] | None] = [None] * world
    dist.all_gather_object(gathered, (snap.files, snap.finite))
    not_finite = [r for r, part in enumerate(gathered) if part is None or not part[1]]
    if not_finite:  # every rank sees the same list: none commits, none waits in a collective
        if rank == 0:
            delete_state(storage, snap.name)  # the finite ranks' files, never committed
        snap.blocked += time.perf_counter() - t0
        raise NonfiniteSnapshot(snap.name, not_finite)
    files: dict[str, ManifestEntry] = {}
    for part in gathered:
        files.update(part[0] if part else {})
    if rank == 0:
        trainer_bytes = json_bytes(snap.trainer.record())
        storage.write_bytes(trainer_bytes, STATES_DIR, snap.name, TRAINER_FILE)
        _copy_to_memory(snap.memory, snap.name, TRAINER_FILE, trainer_bytes)
        files[TRAINER_FILE] = entry(len(trainer_bytes), snap.algo, checksum_bytes(trainer_bytes, snap.algo))
        faults.at_phase("before_manifest")
        verdict = lease.confirm() if lease is not None else None
    if rank == 0 and verdict is None:
        # the entries as the records a manifest holds: its validator checks each one as it checks a read one
        manifest = Manifest.model_validate(
            {
                "state": snap.name,
                "created_at": time.time(),
                "world_size": world,
                "checksum": snap.algo,
                "files": {rel: f.record() for rel, f in sorted(files.items())},
                "lease_generation": lease.generation if lease is not None else None,
            }
        ).record()
        if snap.signing_key is not None:
            manifest[BINDING] = binding_of(storage.url, snap.name, snap.trainer.job_identity)
            manifest = sign(manifest, snap.signing_key)
        data = json_bytes(manifest)
        faults.during_manifest(storage, data, STATES_DIR, snap.name, MANIFEST_FILE)
        storage.commit_bytes(data, STATES_DIR, snap.name, MANIFEST_FILE)
    box = [verdict]
    dist.broadcast_object_list(box, src=0)  # the barrier: committed, or the lease is lost
    if box[0]:
        raise LeaseLostError(box[0])
    if snap.memory is not None:
        snap.memory.keep_only(snap.name)  # this node keeps the newest committed state (and newer saves)
    end = time.perf_counter()
    return SaveResult(
        name=snap.name,
        optimizer_step=snap.trainer.optimizer_step,
        bytes=sum(f.size for f in files.values()),
        seconds=end - snap.started,
        blocked_seconds=snap.blocked + (end - t0),
        background_cpu_seconds=snap.background_cpu,
    )


class AsyncUpload:
    """At most one save in flight per rank: the snapshot uploads in a background thread while
    training continues; the loop commits it (collectively, on the main thread) at the first
    boundary where every rank reports its upload finished."""

    def __init__(self, storage: RunStorage, rank: int, faults: Faults) -> None:
        self.storage, self.rank, self.faults = storage, rank, faults
        self.snap: Snapshot | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        return self.snap is not None

    def start(self, snap: Snapshot) -> None:
        assert self.snap is None, "a save is already in flight"
        self.snap, self.error = snap, None
        self.thread = threading.Thread(
            target=self._run, args=(snap,), name=f"syncpoint-upload-{snap.name}", daemon=False
        )
        self.thread.start()

    def _run(self, snap: Snapshot) -> None:
        started = time.thread_time()
        try:
            upload_snapshot(self.storage, snap, self.rank, self.faults)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread by finish()
            self.error = e
        finally:
            snap.background_cpu = time.thread_time() - started

    def uploading(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def settle(self) -> None:
        """At the attempt's failure: the upload's writes end before the failure leaves the loop (a later
        attempt in this process may write the same state's files), uncommitted, as a crash leaves them;
        its error, if any, is said, not raised: the attempt's failure is what counts."""
        if self.thread is not None:
            self.thread.join()
        self.snap = self.thread = None
        error, self.error = self.error, None
        if error is not None:
            print(f"[syncpoint] the save in flight failed too: {type(error).__name__}: {error}", file=sys.stderr)

    def finish(self) -> Snapshot:
        """Wait for the upload (a finished run waits for its last save) and hand back the snapshot."""
        assert self.thread is not None and self.snap is not None
        t0 = time.perf_counter()
        self.thread.join()
        snap, self.snap, self.thread = self.snap, None, None
        snap.blocked += time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        return snap


class StateWriter:
    """One attempt's state writer (every rank constructs it once; ``save`` at a sync boundary only).

    Phases of a save, in order, and what a crash in each leaves behind:

    1. **Claim** (rank 0, one broadcast): re-confirm the run directory's lease, so a run that lost
       it never writes into a directory the new owner may be writing, and un-commit (remove the
       manifest of) a state of the same name from an earlier trajectory, so no manifest ever
       describes files being rewritten. A lost lease stops every rank here (``LeaseLostError``);
       a crash leaves at most an un-committed old directory: torn.
    2. **Stage** (fault ``before_shards`` first): DeepSpeed's ``save_checkpoint`` through the
       streaming checkpoint engine, checksummed as serialized; a synchronous save streams the shards
       straight into ``states/<name>/`` (durably), an asynchronous one only copies their tensors
       into the engine's host arena; elastic ZeRO adds the gathered optimizer state in local
       staging. A crash leaves some shard files and no manifest: torn, never selected; retention
       deletes it once a newer state commits (unless ``keep_last: 0`` keeps everything).
    3. **Upload** (a background thread for an asynchronous save): the arena's shards serialized
       into storage, staged files copied, then this rank's per-rank parts' files; fault
       ``after_some_shards`` after them. A crash leaves files without a manifest: torn.
    4. **Gather** of every rank's file list with sizes and checksums: the barrier that proves
       every rank's files are durable.
    5. **Trainer record** (rank 0): ``trainer.json`` written; fault ``before_manifest``; the lease
       confirmed again. A crash leaves every file but the manifest: torn.
    6. **Manifest, written last, which commits** (rank 0): every file with size and checksum and the
       lease's fencing generation, signed when there is a key, committed atomically (temp name +
       rename locally, a single PUT on object stores). Fault ``during_manifest`` leaves half its
       bytes under the temp name, which selection never reads: still torn.
    7. **Verdict** (one broadcast): committed, or the lease was lost, and then every rank raises
       ``LeaseLostError`` (nobody is left waiting in a barrier).

    After a commit the coordinator (``syncpoint.workers.state.saving``) applies retention (faults
    ``before_retention``, ``during_retention``)."""

    def __init__(
        self,
        engine: DeepSpeedEngine,
        storage: RunStorage,
        faults: Faults,
        *,
        rank: int,
        lease: RunLease | None,
        signing_key: bytes | None,
        checksum: str = DEFAULT,
        full_optimizer_state: bool = False,
        memory: MemoryCopy | None = None,
    ) -> None:
        self.engine, self.storage, self.faults, self.rank = engine, storage, faults, rank
        self.memory = memory  # this node's memory copy of every state it writes (syncpoint.workers.state.memory_copy)
        self.lease, self.signing_key, self.checksum = lease, signing_key, checksum
        self.full_optimizer_state = full_optimizer_state  # elastic ZeRO: the gathered optimizer state too
        self.upload = AsyncUpload(storage, rank, faults)
        sweep_stale_staging()  # what a rank killed in an earlier save left on this node

    @property
    def in_flight(self) -> bool:
        """An asynchronous save is uploading or waits for its commit."""
        return self.upload.in_flight

    def uploading(self) -> bool:
        """This rank's asynchronous upload is still writing (the boundary's vote carries it: the
        manifest commits only once every rank's upload has finished)."""
        return self.upload.uploading()

    def save(
        self, trainer: TrainState, *, rank_files: Mapping[str, bytes] | None = None, since: float | None = None
    ) -> SaveResult:
        """A synchronous save: every phase before training continues. ``since``: when the loop began
        servicing it (``take_snapshot``); the claim's wait counts as blocked too."""
        since = time.perf_counter() if since is None else since
        self._claim(state_name(trainer.global_micro_step))
        snap = take_snapshot(
            self.engine,
            trainer,
            self.faults,
            self.full_optimizer_state,
            algo=self.checksum,
            direct=self.storage,
            signing_key=self.signing_key,
            rank_files=rank_files,
            memory=self.memory,
            since=since,
        )
        t0 = time.perf_counter()
        upload_snapshot(self.storage, snap, self.rank, self.faults)
        snap.blocked += time.perf_counter() - t0
        return commit_snapshot(self.storage, snap, self.faults, self.lease)

    def save_in_background(
        self, trainer: TrainState, *, rank_files: Mapping[str, bytes] | None = None, since: float | None = None
    ) -> None:
        """An asynchronous save: claim and stage now, upload in a background thread; the commit
        waits for :meth:`commit_in_flight`. ``since`` as for :meth:`save`."""
        since = time.perf_counter() if since is None else since
        self._claim(state_name(trainer.global_micro_step))
        self.upload.start(
            take_snapshot(
                self.engine,
                trainer,
                self.faults,
                self.full_optimizer_state,
                algo=self.checksum,
                signing_key=self.signing_key,
                rank_files=rank_files,
                memory=self.memory,
                since=since,
            )
        )

    def wait_staged(self) -> None:
        """Before training changes its parameters or optimizer state (its next optimizer step): the
        in-flight snapshot's staged copies are made. Time waited counts as blocked by that save."""
        snap = self.upload.snap
        if snap is None or snap.copied is None or snap.copied.is_set():
            return
        t0 = time.perf_counter()
        snap.copied.wait()
        snap.blocked += time.perf_counter() - t0

    def commit_in_flight(self) -> SaveResult:
        """Wait for the background upload, then gather, write the trainer record and commit (or raise
        ``NonfiniteSnapshot``: not committed, nothing in flight any more)."""
        return commit_snapshot(self.storage, self.upload.finish(), self.faults, self.lease)

    def _claim(self, name: str) -> None:
        verdict = self.lease.confirm() if self.rank == 0 and self.lease is not None else None
        if self.rank == 0 and verdict is None and self.storage.exists(STATES_DIR, name, MANIFEST_FILE):
            self.storage.remove(STATES_DIR, name, MANIFEST_FILE)
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise LeaseLostError(box[0])


def delete_state(storage: RunStorage, name: str) -> bool:
    """Un-commit first (manifest), then remove: a half-deleted directory is torn, never 'resumable'.

    Only a state syncpoint wrote: a name that is not a state name, or an entry that is a symbolic
    link (deleting through it would delete its target's files, outside the run), is reported and
    left alone (returns False).
    """
    if not is_state_name(name) or storage.is_link(STATES_DIR, name):
        print(
            f"[syncpoint] WARNING: retention left states/{name} alone: not a state directory syncpoint wrote "
            "(a symbolic link or a foreign name)",
            file=sys.stderr,
            flush=True,
        )
        return False
    storage.remove(STATES_DIR, name, MANIFEST_FILE)
    storage.delete_tree(STATES_DIR, name)
    return True
