"""The state reader: fetch a chosen state, verify every byte against the manifest, then load.

Why this order: a manifest and the files it names are data from storage, and whoever can write
storage can rewrite both consistently, so a matching checksum proves integrity, not intent. Before
anything reaches DeepSpeed, fetching therefore (1) accepts only manifest names that are normalized
paths inside the state (``syncpoint.policies.contracts.state_paths``) and resolves each below the fetch directory,
(2) downloads each file under a temporary name and renames it into place only after its size and
checksum matched, so a wrong file never sits where a loader looks, and (3) unpickles every
DeepSpeed file once with the weights-only loader (``syncpoint.workers.integrity.safe_load``; storages memory-mapped,
so it costs only the pickle metadata), and (4) parses this rank's file of each per-rank part whole
as its part says (``syncpoint.workers.state.rank_parts``: the RNG file tried on this process, so the restore
after the data skip cannot fail on a state already accepted; a stream's state file). A state that fails
any of these raises ``StateRefused`` on every rank alike (every rank fetches and checks the same
files), before the engine is touched: a refused state never leaves a half-loaded engine behind.
DeepSpeed's own reads then go through the same loader again (``syncpoint.workers.state.checkpoint_engine``), so
nothing is ever unpickled blindly.
Every rank fetches the whole ``engine/`` directory (ZeRO-3's module-only consolidation, the
elastic paths and DeepSpeed's ``zero.elastic_checkpoint`` read every data-parallel rank's shard),
except where the caller knows DeepSpeed reads only this rank's files (``own_shard``: a ZeRO-1/2/3
load of the optimizer at the same world size; DeepSpeed 0.19.8 ``_get_all_zero_checkpoint_state_dicts``
loads other ranks' optimizer shards only with ``elastic_checkpoint``, and at ZeRO-3 ``_get_ckpt_name``
names only this rank's ``zero_pp_rank_<r>`` module file): there the other ranks' files are
neither downloaded nor checked here, each rank checks its own, and the caller's collective agreement
on refusals (``syncpoint.workers.state.resume_negotiation``) still makes every rank refuse alike, before any load.
On an object store that halves what a 2-rank restore downloads.

On local storage, where the caller's load goes only through DeepSpeed's checkpoint engine
(``in_place``: the same world size, optimizer loaded), nothing is copied: each file is opened in
the state directory without following links, checksummed in one read, and loaded through that
same descriptor (``syncpoint.workers.integrity.verified_files``, which says how each rule above is kept); the checkpoint
engine then serves DeepSpeed only those verified files, and a file written meanwhile is refused
after the load, before training uses it. The elastic and ZeRO-3 module-only paths read or add
files by name in the directory, so they still get a private verified copy.

Every read is bounded by the manifest: a file is read or copied up to its listed size plus one byte
and refused when larger (a shard listed with size 0 and linked to ``/dev/zero`` costs one byte);
locally nothing is read through a link or unless it is a regular file (``syncpoint.workers.storage.nofollow``), and
such a refusal (``UnsafeEntry``) refuses the state like a checksum does, so selection falls back.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from pydantic import ValidationError

from syncpoint.policies.contracts.bounded_json import BoundedJsonError, loads_bounded
from syncpoint.policies.contracts.errors import StateRefused, UnsafeEntry
from syncpoint.policies.contracts.state_format import (
    ENGINE_TAG,
    FULL_OPTIMIZER_FILE,
    LOCAL_DIRS,
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    RNG,
    STATES_DIR,
    TRAINER_FILE,
    Manifest,
    ManifestEntry,
    local_path,
    problem_of,
)
from syncpoint.policies.contracts.state_paths import path_problem
from syncpoint.policies.decisions.candidates import Candidate
from syncpoint.workers.integrity import verified_files
from syncpoint.workers.integrity.checksum import matches_entry
from syncpoint.workers.integrity.safe_load import check_state_file
from syncpoint.workers.integrity.verified_files import (
    ChecksumMismatch,
    Identity,
    VerifiedFile,
    available,
    open_verified,
    read_verified,
)
from syncpoint.workers.state.downloads import PARTIAL_DIR, download_all, storage_refusals
from syncpoint.workers.state.mapped_state import copy_mapped_optimizer_state
from syncpoint.workers.state.node_share import NodePeers, Offer, read_split
from syncpoint.workers.state.preload import Preloads
from syncpoint.workers.state.rank_parts import PartBehaviour, behaviour
from syncpoint.workers.storage import RunStorage

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from syncpoint.workers.state.memory_copy import MemoryCopy

__all__ = ["ChecksumMismatch", "FetchedState", "StateRefused", "fetch_state", "load_into_engine"]

MANIFEST_MAX_DEPTH = 8  # a manifest nests 4 levels (files -> entry -> checksum; the signature and binding)
FETCHED_PREFIXES = tuple(f"{d}/" for d in LOCAL_DIRS)  # the rest is read into memory
# a data-parallel rank's own files: its ZeRO optimizer shard, and at ZeRO-3 its module partition
ZERO_SHARD = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt")


@dataclass
class FetchedState:
    """A state this rank fetched and verified: where its files are, and its small files read whole."""

    local_dir: str  # contains engine/ as DeepSpeed wrote it
    # this rank's file of each per-rank part it reads, verified and parsed (``rank_parts``: its RNG
    # tried on this process, a stream's position parsed whole), by part name
    parts: dict[str, Any] = field(default_factory=dict)
    # in place: local_dir is the state itself (never deleted); DeepSpeed reads only these open files
    verified: dict[str, VerifiedFile] | None = field(default=None)
    # a downloaded copy: the files verified into local_dir, and those being unpickled meanwhile (``preload``)
    names: tuple[str, ...] = ()
    preloads: Preloads | None = None
    # this node's memory copy: DeepSpeed maps the verified files' storages instead of reading them
    # (syncpoint's own files in a private directory, never rewritten; ``syncpoint.workers.state.mapped_state``)
    mapped: bool = False

    @property
    def in_place(self) -> bool:
        return self.verified is not None

    def unchanged(self) -> None:
        """In place: refuse (``StateRefused``) when a file was written after it was verified."""
        for f in (self.verified or {}).values():
            f.unchanged()

    def cleanup(self) -> None:
        if self.preloads is not None:  # first: a preload still reads a descriptor or file removed below
            self.preloads.close()
        if self.verified is None:
            shutil.rmtree(self.local_dir, ignore_errors=True)
            return
        for f in self.verified.values():  # the state directory itself is storage: only our descriptors go
            f.close()


def fetch_state(
    storage: RunStorage,
    cand: Candidate,
    rank: int,
    *,
    want_rng: bool = True,
    sources: Mapping[str, int] | None = None,
    own_shard: int | None = None,
    in_place: bool = False,
    memory: MemoryCopy | None = None,
    say: Callable[[str, bool], None] | None = None,
    peers: NodePeers | None = None,
    preload: bool = False,
) -> FetchedState:
    """Download and verify this rank's view of a state.

    Raises ``StateRefused`` (``ChecksumMismatch`` for changed bytes) when the state itself is
    unusable: an unsafe or malformed manifest entry, a file missing from storage, changed bytes, a
    DeepSpeed file that needs a class outside the allowlist or is no torch file. ``OSError`` means
    the storage or the local disk failed, not the state.

    ``own_shard``: this rank's data-parallel rank when DeepSpeed will read only its own ZeRO
    files (module docstring); the other ranks' optimizer shards (and ZeRO-3 module files) are skipped.

    ``in_place``: the caller's load reads only through the checkpoint engine (module docstring);
    on local storage the state is then verified where it lies instead of copied.

    ``sources``: the saved rank whose file of each per-rank part this rank reads, by part name
    (``syncpoint.workers.state.rank_parts.sources``); each is read into memory, verified and parsed
    by its part (a part that is not ``optional`` must be listed). ``want_rng``: this rank's own RNG
    file too, when it is listed (False: a weights-only import reads no per-rank part).

    ``memory``: this node's memory copy (``syncpoint.workers.state.memory_copy``): with ``in_place``,
    the state is verified there and loaded from it when the copy holds every file this rank needs
    and each matches the manifest; else storage is read. ``say(line, from_memory)`` is told which,
    and why a copy was not used.

    ``peers``: every rank of the process group fetches at once, and a file that several ranks of
    this node need is read by one of them for all (``syncpoint.workers.state.node_share``); each rank
    makes its gathers exactly once, whatever fails.

    ``preload``: the caller's load reads exactly the DeepSpeed files fetched here (``own_shard``
    and the optimizer loaded); a downloaded file is unpickled on a second thread as soon as it is
    verified (``syncpoint.workers.state.preload``), and ``load_into_engine`` hands DeepSpeed the
    results. A state verified in place (local storage, the memory copy) is not preloaded: its reads
    take a few seconds, and there the second thread's unpickling measured slower than DeepSpeed's
    own read after the fetch (bench P10)."""
    try:
        wanted = {RNG.name: rank} if want_rng else {}
        wanted.update(sources or {})
        small = {name: RankRead(behaviour(name), behaviour(name).layout.file(src)) for name, src in wanted.items()}
        return _fetch(storage, cand, own_shard, in_place, small, memory, say, peers, preload)
    finally:
        if peers is not None:
            peers.finish()


@dataclass(frozen=True)
class RankRead:
    """One per-rank part's file this rank reads: the part, and the file (maybe another rank's)."""

    part: PartBehaviour
    rel: str


def _fetch(
    storage: RunStorage,
    cand: Candidate,
    own_shard: int | None,
    in_place: bool,
    small: dict[str, RankRead],
    memory: MemoryCopy | None,
    say: Callable[[str, bool], None] | None,
    peers: NodePeers | None,
    preload: bool,
) -> FetchedState:
    files = manifest_files(cand)
    fetched = [rel for rel in sorted(files) if rel.startswith(FETCHED_PREFIXES) and not _other_shard(rel, own_shard)]
    state_dir = storage.local_path(STATES_DIR, cand.name) if in_place and available() else None
    if state_dir is not None:
        root = _open_state(storage, cand.name)
        try:
            return _verify_in_place(root, state_dir, files, fetched, small, peers=peers, read_ahead=True)
        finally:
            os.close(root)
    if memory is not None and in_place and available():
        told = say or (lambda _line, _used: None)
        from_memory = _from_memory(memory, cand.name, files, fetched, small, told, peers)
        if from_memory is not None:
            return from_memory
    local = tempfile.mkdtemp(prefix="syncpoint-load-")
    preloads = Preloads() if preload else None
    try:
        download_all(
            storage, cand.name, files, fetched, local, peers if peers is not None and peers.unused else None, preloads
        )
        shutil.rmtree(os.path.join(local, PARTIAL_DIR), ignore_errors=True)
        for rel in fetched:
            if (
                rel.startswith(f"{ENGINE_TAG}/")
                and rel.endswith(".pt")
                and not (preloads is not None and preloads.checked(rel))
            ):
                check_state_file(local_path(local, rel), rel)
        parts = {
            name: r.part.parse(_read_verified(storage, cand.name, r.rel, files), r.rel)
            for name, r in small.items()
            if r.rel in files or not r.part.optional
        }
        _read_verified(storage, cand.name, TRAINER_FILE, files)
        return FetchedState(local, parts, names=tuple(fetched), preloads=preloads)
    except BaseException:
        if preloads is not None:  # first: a preload still reads a file removed below
            preloads.close()
        shutil.rmtree(local, ignore_errors=True)
        raise


def _from_memory(
    memory: MemoryCopy,
    name: str,
    files: dict[str, ManifestEntry],
    fetched: list[str],
    small: dict[str, RankRead],
    say: Callable[[str, bool], None],
    peers: NodePeers | None,
) -> FetchedState | None:
    """The state verified in this node's memory copy, or ``None`` (told to ``say``) when the copy is
    missing, incomplete or fails verification: the caller then reads storage."""
    try:
        root = memory.open_state(name)
    except (OSError, UnsafeEntry) as e:
        say(f"this node's memory copy of {name} cannot be opened ({e}): restoring from storage", False)
        return None
    if root is None:
        say(f"no memory copy of {name} on this node: restoring from storage", False)
        return None
    try:
        fetched_state = _verify_in_place(root, memory.path_of(name), files, fetched, small, peers=peers)
    except (StateRefused, UnsafeEntry, OSError) as e:
        say(f"this node's memory copy of {name} failed verification ({e}): restoring from storage", False)
        return None
    finally:
        os.close(root)
    say(f"restoring {name} from this node's memory copy (verified against its manifest)", True)
    fetched_state.mapped = True
    return fetched_state


def _open_state(storage: RunStorage, name: str) -> int:
    """The state directory reached from the run directory without following a link."""
    try:
        root = storage.open_local_dir(STATES_DIR, name)
    except FileNotFoundError:
        raise StateRefused(f"{STATES_DIR}/{name}: missing from storage: refused") from None
    except UnsafeEntry as e:
        raise StateRefused(f"{e}: refused (corrupt)") from None
    assert root is not None, "in place needs local storage"
    return root


def _verify_in_place(
    root: int,
    state_dir: str,
    files: dict[str, ManifestEntry],
    fetched: list[str],
    small: dict[str, RankRead],
    *,
    peers: NodePeers | None = None,
    read_ahead: bool = False,
) -> FetchedState:
    """Open and verify each file in the state directory itself (``root``, its descriptor); weights-only
    check through the same descriptors (``syncpoint.workers.integrity.verified_files``). With
    ``peers``, a file another rank of this node verified is taken when this rank's descriptor has
    the identity it verified (``syncpoint.workers.state.node_share``)."""
    verified: dict[str, VerifiedFile] = {}
    try:
        _verify_all(root, state_dir, files, fetched, verified, peers, read_ahead)
        for rel in fetched:
            if rel.startswith(f"{ENGINE_TAG}/") and rel.endswith(".pt"):
                check_state_file(verified[rel].path, rel)
        read = {name: r for name, r in small.items() if r.rel in files or not r.part.optional}
        for listed in (TRAINER_FILE, *(r.rel for r in read.values())):
            if listed not in files:
                raise StateRefused(
                    f"{os.path.basename(state_dir)}: {MANIFEST_FILE} does not list {listed}: refused (corrupt)"
                )
        parts = {name: r.part.parse(read_verified(root, r.rel, files[r.rel]), r.rel) for name, r in read.items()}
        read_verified(root, TRAINER_FILE, files[TRAINER_FILE])
        return FetchedState(state_dir, parts, verified)
    except BaseException:
        for f in verified.values():
            f.close()
        raise


def _verify_all(
    root: int,
    state_dir: str,
    files: dict[str, ManifestEntry],
    fetched: list[str],
    verified: dict[str, VerifiedFile],
    peers: NodePeers | None,
    read_ahead: bool,
) -> None:
    """Open and verify ``fetched`` into ``verified`` (the caller closes them on failure); with
    ``peers``, this rank first verifies its share, then takes the rest by identity or verifies it.
    ``read_ahead``: this rank also reads ahead its ranges of the shared files another rank of the
    node checksums (``syncpoint.workers.state.node_share.read_split``): storage on a disk, not the
    memory copy, whose bytes are in memory already."""

    def mine(rel: str) -> Identity:
        verified[rel] = open_verified(root, rel, files[rel])
        return verified[rel].signature

    def rest(rel: str, offer: Offer | None) -> None:
        verified[rel] = open_verified(root, rel, files[rel], known=offer.identity if offer else None)

    def ahead(rel: str, start: int, end: int) -> None:
        verified_files.read_ahead(root, rel, start, min(end, files[rel].size))

    read_split(peers, {rel: files[rel].size for rel in fetched}, state_dir, mine, rest, ahead if read_ahead else None)


def _other_shard(rel: str, own_shard: int | None) -> bool:
    """Whether ``rel`` is another data-parallel rank's ZeRO optimizer shard (never, without ``own_shard``)."""
    if own_shard is None or not rel.startswith(f"{ENGINE_TAG}/"):
        return False
    m = ZERO_SHARD.fullmatch(rel.split("/", 1)[1])
    return m is not None and int(m.group(1)) != own_shard


def manifest_files(cand: Candidate) -> dict[str, ManifestEntry]:
    """The manifest's ``files``, refused unless every name is a safe path inside the state and every
    entry has a size and a known checksum (``init_from`` reaches here without classification)."""
    problem = path_problem(cand.name)
    if problem or "/" in cand.name:
        raise StateRefused(f"state name {cand.name!r} {problem or 'has a /'}: refused")
    record = cand.parse().record
    if record is None:
        raise _malformed(cand.name, str(cand.record_problem))
    return record.files


def parse_manifest(raw: object, name: str) -> Manifest:
    """A manifest read from storage, refused (``StateRefused``, the bad field named) unless it is one."""
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        raise _malformed(name, problem_of(e, MANIFEST_FILE)) from None


def _malformed(name: str, problem: str) -> StateRefused:
    return StateRefused(
        f"{name}: {problem}; a state names only normalized relative paths "
        "inside itself, each with a size and one known checksum: refused (corrupt)"
    )


def _read_verified(storage: RunStorage, name: str, rel: str, files: dict[str, ManifestEntry]) -> bytes:
    """A small file read into memory (never written locally), returned only if it matches."""
    if rel not in files:
        raise StateRefused(f"{name}: {MANIFEST_FILE} does not list {rel}: refused (corrupt)")
    try:
        return read_listed(storage, (STATES_DIR, name), rel, files[rel])
    except FileNotFoundError:
        raise StateRefused(f"{rel}: missing from storage, though the manifest lists it: refused (corrupt)") from None


def read_listed(storage: RunStorage, state: tuple[str, ...], rel: str, entry: ManifestEntry) -> bytes:
    """A file a manifest lists, read into memory with its listed size as the bound, returned only if
    it matches its entry. ``state``: the state directory's parts in ``storage``. Raises
    ``StateRefused`` (``ChecksumMismatch`` for changed bytes), ``FileNotFoundError`` when it is
    missing (not a committed state); any other ``OSError`` is the storage failing."""
    with storage_refusals(rel, entry, missing=False):
        data = storage.read_bytes(*state, rel, limit=entry.size)
    if not matches_entry(entry, data):
        raise ChecksumMismatch(f"{rel}: {entry.algorithm} does not match the manifest")
    return data


def read_manifest(storage: RunStorage, state: tuple[str, ...]) -> Manifest:
    """A state's manifest read with its cap (``MANIFEST_MAX_BYTES``) and parsed; ``StateRefused`` for
    one that is not (``FileNotFoundError`` when there is none: not a committed state)."""
    name = state[-1]
    try:
        raw = storage.read_bytes(*state, MANIFEST_FILE, limit=MANIFEST_MAX_BYTES)
    except UnsafeEntry as e:
        raise StateRefused(f"{e}: refused (corrupt)") from None
    try:
        obj = loads_bounded(raw, max_bytes=MANIFEST_MAX_BYTES, max_depth=MANIFEST_MAX_DEPTH)
    except BoundedJsonError as e:
        raise StateRefused(
            f"{name}: {MANIFEST_FILE} is {e if str(e).startswith('not JSON') else f'JSON {e}'}: refused (corrupt)"
        ) from None
    return parse_manifest(obj, name)


def load_into_engine(
    engine: DeepSpeedEngine,
    fetched: FetchedState,
    *,
    module_only: bool = False,
    optimizer: bool = True,
    other_world_size: bool = False,
) -> None:
    """Load a verified state. From another world size, ZeRO-1/2 optimizer state comes from the
    gathered full state (``syncpoint.workers.state.elastic_state``); ZeRO-0's is whole in DeepSpeed's own file.

    Raises ``StateRefused`` before the engine is touched when the gathered full state does not fit
    this model; DeepSpeed's reads go through syncpoint's weights-only checkpoint engine (installed
    here too, so no caller can load through DeepSpeed's own ``weights_only=False``)."""
    from syncpoint.workers.state.checkpoint_engine import install

    streaming = install(engine)
    full = local_path(fetched.local_dir, FULL_OPTIMIZER_FILE)
    cross = other_world_size and engine.zero_optimization_stage() in (1, 2, 3) and optimizer and not module_only
    if fetched.verified is not None and (cross or module_only):  # these read files by name (elastic_state, ZeRO-3)
        raise ValueError(
            "a state read in place loads only through the checkpoint engine: fetch a copy "
            "(in_place=False) for a module-only or other-world-size load"
        )
    served = _served(fetched) if not cross and not module_only else None
    if served is not None:  # DeepSpeed reads only the verified files
        with streaming.serving(fetched.local_dir, served, fetched.preloads, fetched.mapped):
            engine.load_checkpoint(
                fetched.local_dir,
                tag=ENGINE_TAG,
                load_module_strict=True,
                load_optimizer_states=optimizer,
                load_lr_scheduler_states=False,
            )
        if fetched.preloads is not None or fetched.mapped:  # files were mapped: the optimizer keeps none of it
            copy_mapped_optimizer_state(engine, fetched.local_dir)
        fetched.unchanged()
        return
    if cross:
        from syncpoint.workers.state.elastic_state import check_full_optimizer_state, prepare_resize

        check_full_optimizer_state(engine, full)
        prepare_resize(engine, fetched.local_dir, dist.get_rank())
    engine.load_checkpoint(
        fetched.local_dir,
        tag=ENGINE_TAG,
        load_module_strict=True,
        load_optimizer_states=optimizer and not module_only and not cross,
        load_lr_scheduler_states=False,
        load_module_only=module_only or cross,
    )
    if cross:
        from syncpoint.workers.state.elastic_state import load_full_optimizer_state

        with open(full, "rb") as f:
            load_full_optimizer_state(engine, f.read())


def _served(fetched: FetchedState) -> dict[str, str] | None:
    """What DeepSpeed is served (``StreamingCheckpointEngine.serving``): a state verified in place,
    its open descriptors; a downloaded copy with preloads, its files (the caller's load reads only
    them); else ``None``: DeepSpeed reads the copy's directory by name."""
    if fetched.verified is not None:
        return {rel: f.path for rel, f in fetched.verified.items()}
    if fetched.preloads is not None:
        return {rel: local_path(fetched.local_dir, rel) for rel in fetched.names}
    return None
