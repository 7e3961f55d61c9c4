"""What the loop asks of a job's dataset before it trains: how its data is ordered (``corpus.shuffle``
resolved against the dataset, the cache bound checked) and, on rank 0 holding the lease, the
corpus's identity and index published in the run directory.

Why a module of its own: both kinds of corpus dataset take part (a ``ShardedCorpus`` and the
``TokenWindows`` built on one), so it sits above both rather than inside the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from syncpoint.policies.contracts.corpus_identity import CORPUS_DIR, CorpusIdentity, index_file
from syncpoint.policies.contracts.errors import JobConfigError
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.contracts.state_format import SAMPLER_VERSION, SHARD_WINDOW_SAMPLER, json_bytes
from syncpoint.workers.data.corpus import ShardedCorpus
from syncpoint.workers.data.corpus_index import index_key, listing_bytes, listing_file
from syncpoint.workers.data.windows import TokenWindows
from syncpoint.workers.storage import RunStorage


@dataclass(frozen=True)
class DataPlan:
    """How a job orders its data: the sampler a new run uses, its window, and the corpus's identity."""

    sampler: str = SAMPLER_VERSION
    window_shards: int | None = None
    identity: CorpusIdentity | None = None


def plan_for(spec: JobSpec, dataset: Any) -> DataPlan:
    """``corpus.shuffle`` resolved against the task's dataset; a cache too small for the window is
    refused here, before the lease and the resume."""
    c = spec.corpus
    if not isinstance(dataset, ShardedCorpus):
        if c.shuffle == "shard-window":
            raise JobConfigError(
                f"corpus.shuffle shard-window needs the task's dataset to be a "
                f"syncpoint.ShardedCorpus; it is a {type(dataset).__name__}. Set corpus.shuffle: "
                "auto or global, or return a ShardedCorpus"
            )
        if isinstance(dataset, TokenWindows):  # one token file: its identity, the global order
            dataset.check_cache()
            return DataPlan(identity=dataset.identity())
        return DataPlan()
    window = None if c.shuffle == "global" else c.window_shards
    dataset.check_cache(window, c.prefetch)
    return DataPlan(SHARD_WINDOW_SAMPLER if window else SAMPLER_VERSION, window, dataset.identity())


def publish_index(storage: RunStorage, dataset: Any, identity: CorpusIdentity | None) -> None:
    """Rank 0, holding the lease: the corpus's identity in the run directory (once per digest), so a
    later selection can name the shard another corpus differs in, and its index with paths and
    stamps (when it changed), so a node that joins later need not read the corpus to index it."""
    if isinstance(dataset, TokenWindows):
        dataset = dataset.corpus  # its one-file index; the identity (with the windows) is its own
    if identity is None or not isinstance(dataset, ShardedCorpus):
        return
    if not storage.exists(CORPUS_DIR, index_file(identity.digest)):
        storage.commit_bytes(json_bytes(identity.document()), CORPUS_DIR, index_file(identity.digest))
    name = listing_file(index_key(dataset._process().fs, dataset.patterns, dataset.params))
    data = listing_bytes(dataset.params, dataset.shards)
    try:
        same = storage.read_bytes(CORPUS_DIR, name, limit=len(data)) == data
    except OSError:  # missing, larger, or unreadable: written anew
        same = False
    if not same:
        storage.commit_bytes(data, CORPUS_DIR, name)
