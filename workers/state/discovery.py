"""Discovery: turn a run directory into classified candidates, reading metadata only.

For each ``states/<name>/`` it lists files (sizes from the listing) and reads ``manifest.json`` and
``trainer.json``; it never opens engine shards, RNG files or data. The classification itself is a
plain function in ``syncpoint.policies.decisions.candidates``.

Storage may be hostile: both files are read with a bound (``MANIFEST_MAX_BYTES``,
``TRAINER_MAX_BYTES``), locally never through a link and only if regular, and whatever is refused
(a link, a FIFO, a file too large) becomes the candidate's reason, so selection falls back to an
older state instead of hanging or crashing. ``states/`` itself being a link refuses the run
(``RunDirectoryRefused``): every save, selection and retention would go through it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import overload

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.corpus_identity import (
    CORPUS_DIR,
    CORPUS_INDEX_MAX_BYTES,
    CorpusIdentity,
    index_file,
    parse_document,
)
from syncpoint.policies.contracts.errors import RunDirectoryRefused, UnsafeEntry
from syncpoint.policies.contracts.state_format import (
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    STATES_DIR,
    TRAINER_FILE,
    TRAINER_MAX_BYTES,
    Manifest,
    is_state_name,
)
from syncpoint.policies.decisions.candidates import Candidate, LiveJob, classify, newest_first
from syncpoint.policies.decisions.redact import redact_url
from syncpoint.workers.integrity.checksum import matches_entry
from syncpoint.workers.integrity.signing import trust_problem
from syncpoint.workers.storage import RunStorage


def _parse_object(data: bytes) -> tuple[JSONObject | None, str | None]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return None, f"not JSON ({e.__class__.__name__}: {str(e)[:200]})"
    return (obj, None) if isinstance(obj, dict) else (None, "not a JSON object")


def read_candidate(
    storage: RunStorage, name: str, signing_key: bytes | None = None, job_identity: str | None = None
) -> Candidate:
    """One state's metadata; with a signing key, its manifest's signature is checked too, and that it
    was signed for this run directory, this name and (when given) this job (``syncpoint.workers.integrity.signing``)."""
    if storage.is_link(STATES_DIR, name):
        return Candidate(name=name, symlink=True)  # never read through a link: it may point outside the run
    try:
        found = storage.listing(STATES_DIR, name)
    except UnsafeEntry as e:  # not a directory (a FIFO, a file), or swapped for a link since
        return Candidate(name=name, manifest_error=str(e))
    c = Candidate(name=name, listing=found.files, unsafe=found.unsafe)
    trainer_bytes = b""
    c.manifest_error = _unsafe(c, MANIFEST_FILE)
    if MANIFEST_FILE in c.listing:
        try:
            c.manifest, c.manifest_error = _parse_object(
                storage.read_bytes(STATES_DIR, name, MANIFEST_FILE, limit=MANIFEST_MAX_BYTES)
            )
        except UnsafeEntry as e:  # too large, or swapped for a link since the listing
            c.manifest_error = str(e)
    c.trainer_error = _unsafe(c, TRAINER_FILE)
    if TRAINER_FILE in c.listing:
        try:
            trainer_bytes = storage.read_bytes(STATES_DIR, name, TRAINER_FILE, limit=TRAINER_MAX_BYTES)
            c.trainer, c.trainer_error = _parse_object(trainer_bytes)
        except UnsafeEntry as e:
            c.trainer_error = str(e)
    c.parse()  # the one parse of both records: everything after reads c.state and c.record
    if c.trainer is not None and c.record is not None:
        c.trainer_error = _trainer_checksum_problem(c.record, trainer_bytes)
    if signing_key is not None and c.manifest is not None:  # over the object exactly as read
        c.trust_error = trust_problem(
            c.manifest, signing_key, run_url=storage.url, state=name, job_identity=job_identity
        )
    return c


def _unsafe(c: Candidate, rel: str) -> str | None:
    """Why a metadata file the listing found is not read at all (a link, a FIFO), or None."""
    kind = c.unsafe.get(rel)
    return None if kind is None else f"{STATES_DIR}/{c.name}/{rel} is {kind}, not a regular file: never read"


def _trainer_checksum_problem(manifest: Manifest, trainer_bytes: bytes) -> str | None:
    """trainer.json is read anyway, so selection verifies it against the manifest: an edited
    position is refused before any tensor is read (a malformed manifest is classification's to name)."""
    entry = manifest.files.get(TRAINER_FILE)
    if entry is None or matches_entry(entry, trainer_bytes):
        return None
    return "does not match its checksum in the manifest (changed after commit)"


CorpusIndexes = dict[str, tuple[CorpusIdentity | None, str | None]]


def attach_corpus_index(storage: RunStorage, c: Candidate, live: LiveJob | None, read: CorpusIndexes) -> None:
    """A state trained on another corpus than the live run's: its index (``corpus/<digest>.json``,
    read once per digest, bounded, and checked to hash to its name) goes with the candidate, so the
    reason names the shard they differ in."""
    state = c.parse().state
    corpus = state.data.corpus if state is not None else None
    digest = corpus.digest if corpus is not None else None
    live_corpus = live.identity.data.corpus if live is not None else None
    if (
        live_corpus is None
        or digest is None
        or digest == live_corpus.digest
        or not digest.isalnum()
        or len(digest) > 64
    ):
        return
    if digest not in read:
        read[digest] = _read_corpus_index(storage, digest)
    c.corpus_index, c.corpus_index_error = read[digest]


def _read_corpus_index(storage: RunStorage, digest: str) -> tuple[CorpusIdentity | None, str | None]:
    try:
        raw = storage.read_bytes(CORPUS_DIR, index_file(digest), limit=CORPUS_INDEX_MAX_BYTES)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:  # a link, too large, unreadable: never fatal, the digest still refuses
        return None, str(e)[:200]
    obj, problem = _parse_object(raw)
    return parse_document(obj, digest) if obj is not None else (None, problem)


def discover(storage: RunStorage, live: LiveJob | None = None, signing_key: bytes | None = None) -> list[Candidate]:
    """Every candidate, newest first, all read now; classified when a live job is given."""
    identity = live.identity.job_identity if live is not None else None
    cands = [read_candidate(storage, name, signing_key, identity) for name in state_names(storage)]
    if live is not None:
        indexes: CorpusIndexes = {}
        for c in cands:
            attach_corpus_index(storage, c, live, indexes)
            classify(c, live)
    return newest_first(cands)


def state_names(storage: RunStorage) -> list[str]:
    """The entries of ``states/`` that syncpoint could have written (12-digit names). Anything else
    (a README, a notes folder) is not ours: selection and retention never look at it."""
    return [n for n in states_entries(storage) if is_state_name(n)]


def states_entries(storage: RunStorage) -> list[str]:
    """Every entry name of ``states/``; ``RunDirectoryRefused`` when ``states/`` itself is a link (or
    no directory): every selection, save and retention pass would go through it."""
    try:
        return storage.list_names(STATES_DIR)
    except UnsafeEntry as e:
        raise RunDirectoryRefused(
            f"{redact_url(storage.url_of(STATES_DIR))} cannot be used: {e}. A link there would take selection, saves "
            f"and retention outside the run directory. Replace it with a real directory (move what it points to into "
            f"{STATES_DIR}/ in its place, or remove it to start without states), then re-submit."
        ) from None


def state_order(name: str) -> tuple[int, int, str]:
    """Newest-first order from the directory name alone (our names are zero-padded micro-steps)."""
    return (1, int(name), name) if name.isdigit() else (0, -1, name)


class LazyCandidates(Sequence[Candidate]):
    """Newest-first candidates whose metadata is read (and classified) only when looked at.

    Selection walks newest-first and usually stops at the first resumable state, so choosing
    among 10^4 states reads one or two manifests, not 10^4 (bench/p5_selection.py).
    """

    def __init__(self, storage: RunStorage, live: LiveJob | None, signing_key: bytes | None = None) -> None:
        self.storage, self.live, self.signing_key = storage, live, signing_key
        self.names = sorted(state_names(storage), key=state_order, reverse=True)
        self._loaded: dict[int, Candidate] = {}
        self._indexes: CorpusIndexes = {}

    def __len__(self) -> int:
        return len(self.names)

    def _load(self, i: int) -> Candidate:
        if i not in self._loaded:
            identity = self.live.identity.job_identity if self.live is not None else None
            c = read_candidate(self.storage, self.names[i], self.signing_key, identity)
            attach_corpus_index(self.storage, c, self.live, self._indexes)
            self._loaded[i] = classify(c, self.live) if self.live else c
        return self._loaded[i]

    @overload
    def __getitem__(self, i: int) -> Candidate: ...
    @overload
    def __getitem__(self, i: slice) -> list[Candidate]: ...

    def __getitem__(self, i: int | slice) -> Candidate | list[Candidate]:
        if isinstance(i, slice):
            return [self._load(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._load(i)

    def inspected(self) -> list[Candidate]:
        """The candidates read so far, newest first (what the event log reports)."""
        return [self._loaded[i] for i in sorted(self._loaded)]


def discover_lazy(storage: RunStorage, live: LiveJob | None = None, signing_key: bytes | None = None) -> LazyCandidates:
    """The run's candidates, newest first, each read and classified only when a policy reaches it."""
    return LazyCandidates(storage, live, signing_key)
