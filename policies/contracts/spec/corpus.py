"""The spec's ``corpus`` section: how a sharded corpus is ordered, windowed and cached."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    StrictInt,
    field_validator,
)

from syncpoint.policies.contracts.spec.bounds import (
    MAX_CACHE_BYTES,
    MAX_FETCH_CONCURRENCY,
    MAX_PATH_CHARS,
    MAX_WINDOW_SHARDS,
    Strict,
)

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def _byte_count(v: Any) -> Any:
    """``17179869184``, ``"16GiB"``, ``"500 MB"`` -> bytes; anything else is left to the int check."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v)
        if not m or m.group(2).lower() not in _BYTE_UNITS:
            raise ValueError("write a number of bytes, optionally with a unit: 17179869184, '16 GiB', '500 MB'")
        return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    return v


class CorpusSpec(Strict):
    """How syncpoint reads a sharded corpus (``syncpoint.ShardedCorpus``, returned by the task as
    its dataset): the epoch order, and the node-local cache the shards are fetched into."""

    shuffle: Literal["auto", "global", "shard-window"] = Field(
        "auto",
        description=(
            "auto: shard-window when the task's dataset is a ShardedCorpus, else global | global: one keyed "
            "permutation of every sample per epoch (random access over the whole corpus) | shard-window: the "
            "shard order permuted per epoch, then the rows within each window of window_shards shards (reads "
            "window_shards shards at a time)."
        ),
    )
    window_shards: StrictInt = Field(
        8,
        ge=1,
        le=MAX_WINDOW_SHARDS,
        description=(
            "shard-window: consecutive shards (of the epoch's shard order) whose rows are shuffled together; "
            "a micro-batch draws from one window. More mixes better and needs a larger cache."
        ),
    )
    prefetch_shards: StrictInt | None = Field(
        None,
        ge=0,
        le=MAX_WINDOW_SHARDS,
        description=("Shards fetched ahead of the window in use (default: window_shards, one window ahead)."),
    )
    fetch_concurrency: StrictInt = Field(
        4, ge=1, le=MAX_FETCH_CONCURRENCY, description="Shards downloaded at the same time per process."
    )
    cache_dir: str | None = Field(
        None,
        max_length=MAX_PATH_CHARS,
        description=(
            "Local directory of the shard cache and the corpus index (shared by the ranks of a node); default "
            "$SYNCPOINT_CORPUS_CACHE, else <tmp>/syncpoint-corpus-<uid>. Private to the job's user: created 0700 "
            "and refused if another account owns it or others can write it. Shards on a local filesystem are read "
            "in place."
        ),
    )
    cache_bytes: StrictInt = Field(
        16 << 30,
        ge=1,
        le=MAX_CACHE_BYTES,
        description=(
            "Bound of the shard cache per node (bytes, or '16 GiB'): it must hold window_shards + prefetch_shards "
            "of the largest shard; least recently used shards are evicted beyond it."
        ),
    )

    @field_validator("cache_bytes", mode="before")
    @classmethod
    def _units(cls, v: Any) -> Any:
        return _byte_count(v)

    @field_validator("cache_dir")
    @classmethod
    def _local_dir(cls, v: str | None) -> str | None:
        if v is not None and "://" in v and not v.startswith("file://"):
            raise ValueError(
                "must be a local directory (the cache holds shards next to the ranks that read them), not a URL"
            )
        return v.removeprefix("file://") if v else v

    @property
    def prefetch(self) -> int:
        return self.window_shards if self.prefetch_shards is None else self.prefetch_shards
