"""A sharded corpus's identity: what its samples are, as a digest selection compares, and the one
rule that names the shard two corpora differ in.

Why content, not location: a corpus copied to another bucket holds the same samples and resumes;
a shard whose bytes, row count or place in the list changed holds other samples, so a state
trained on the old corpus is refused at selection, by the shard's name (``first_difference``),
before anything is loaded. The identity is each shard's name (its path below the corpus root),
size, content checksum (xxh3_128) and row count, in list order, plus the parameters that turn
bytes into rows (format, sequence length, token dtype). ``trainer.json`` records only the digest
and two counts (``syncpoint.policies.contracts.state_format.CorpusRecord``); the whole index lies once per digest in
the run directory (``corpus/<digest>.json``), so the reason can name the shard.

Pure data: nothing here does I/O (``syncpoint.workers.data.corpus`` builds the index, discovery reads the file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from syncpoint.policies.contracts.bounded_json import JSONObject

INDEX_FORMAT = "syncpoint-corpus-index/1"
CORPUS_DIR = "corpus"  # under the run directory: one index per corpus digest
CORPUS_INDEX_MAX_BYTES = 64 << 20  # ~100 bytes a shard: 600,000 shards
MAX_SHARDS = 1_000_000


@dataclass(frozen=True)
class ShardRecord:
    """One shard as its samples depend on it."""

    name: str  # its path below the corpus root
    size: int
    checksum: str  # xxh3_128 of its bytes
    rows: int


@dataclass(frozen=True)
class CorpusSummary:
    """What ``trainer.json`` records of a corpus: enough to compare, small at any size."""

    digest: str
    shards: int
    rows: int


@dataclass(frozen=True)
class CorpusIdentity:
    """A corpus's whole index: the parameters that turn bytes into rows, and every shard in order."""

    params: tuple[tuple[str, Any], ...]  # (format, seq_len, dtype, ...), sorted by name
    shards: tuple[ShardRecord, ...]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self._canonical(), sort_keys=True).encode()).hexdigest()[:32]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    def summary(self) -> CorpusSummary:
        return CorpusSummary(self.digest, len(self.shards), self.rows)

    def _canonical(self) -> JSONObject:
        return {"params": dict(self.params), "shards": [[s.name, s.size, s.checksum, s.rows] for s in self.shards]}

    def document(self) -> JSONObject:
        """The run directory's ``corpus/<digest>.json``."""
        return {
            "format": INDEX_FORMAT,
            "digest": self.digest,
            "params": dict(self.params),
            "shards": [{"name": s.name, "size": s.size, "xxh3_128": s.checksum, "rows": s.rows} for s in self.shards],
        }


def index_file(digest: str) -> str:
    """The name of a corpus index under ``corpus/`` in the run directory, by its identity's digest."""
    return f"{digest}.json"


def parse_document(raw: Any, digest: str) -> tuple[CorpusIdentity | None, str | None]:
    """(the identity, None) from a ``corpus/<digest>.json`` as read, or (None, why it is unusable):
    it must be well formed and hash to the digest it is filed under (storage may be hostile)."""
    if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT:
        return None, f"not a corpus index ({INDEX_FORMAT})"
    params, shards = raw.get("params"), raw.get("shards")
    if not isinstance(params, dict) or not isinstance(shards, list) or len(shards) > MAX_SHARDS:
        return None, "malformed params or shards"
    records = []
    for s in shards:
        if not isinstance(s, dict):
            return None, "a shard entry is not an object"
        name, size, checksum, rows = s.get("name"), s.get("size"), s.get("xxh3_128"), s.get("rows")
        if not (isinstance(name, str) and isinstance(checksum, str) and _count(size) and _count(rows)):
            return None, f"malformed shard entry {str(s)[:80]}"
        records.append(ShardRecord(name, size, checksum, rows))  # type: ignore[arg-type]  # _count checked
    identity = CorpusIdentity(tuple(sorted(params.items())), tuple(records))
    if identity.digest != digest:
        return None, f"its contents hash to {identity.digest}, not {digest} (changed after it was written)"
    return identity, None


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def first_difference(state: CorpusIdentity, live: CorpusIdentity) -> str:
    """The first thing that makes ``live`` another corpus than ``state``, in one phrase naming the
    parameter or the shard: parameters, then each live shard in order (new, or changed rows, size,
    contents), then shards gone, then the order."""
    have, want = dict(state.params), dict(live.params)
    for key in sorted(set(have) | set(want)):
        if have.get(key) != want.get(key):
            return f"{key} is {have.get(key)!r} in the state's corpus, {want.get(key)!r} in this run's"
    old = {s.name: s for s in state.shards}
    for s in live.shards:
        changed = _shard_change(old.get(s.name), s)
        if changed:
            return changed
    now = {s.name for s in live.shards}
    gone = [s.name for s in state.shards if s.name not in now]
    if gone:
        more = f" (+{len(gone) - 1} more)" if len(gone) > 1 else ""
        return f"shard {gone[0]}{more} is gone (the state's corpus has it, this run's does not)"
    for i, (a, b) in enumerate(zip(state.shards, live.shards, strict=True)):
        if a.name != b.name:
            return f"the shard order differs at position {i}: {a.name} in the state's corpus, {b.name} now"
    return "the corpora differ"  # unreachable: equal fields give equal digests


def _shard_change(before: ShardRecord | None, s: ShardRecord) -> str | None:
    """How a live shard differs from the state's shard of its name (None: it does not)."""
    if before is None:
        return f"shard {s.name} is new (the state's corpus has no such shard)"
    if before.rows != s.rows:
        return f"shard {s.name} changed: {before.rows} rows in the state's corpus, {s.rows} now"
    if before.size != s.size:
        return f"shard {s.name} changed: {before.size} bytes in the state's corpus, {s.size} now"
    if before.checksum != s.checksum:
        return f"shard {s.name} changed contents (same size, xxh3_128 {before.checksum} then, {s.checksum} now)"
    return None
