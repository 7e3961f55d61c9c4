"""DeepSpeed's checkpoint-engine hook: each file DeepSpeed saves goes where the save wants it.

Why: DeepSpeed's own engine ``torch.save``-s every shard to a path, and the state writer then had
to read it back to checksum it and copy it into storage: two full copies and a full read per
save. DeepSpeed routes every shard through ``engine.checkpoint_engine.save(state_dict, path)``
(the hook Nebula and its fast/decoupled engines use), so this engine serializes each shard
straight into a sink chosen per save, checksumming as the bytes pass:

* a synchronous save streams into storage itself (``RunStorage.open_durable``): one write;
* an asynchronous save streams into local staging (host memory) and records the checksum, so
  the background upload is a plain copy with no second read.

DeepSpeed still gets a local directory for everything else it writes (its recovery scripts),
which the writer ignores. Loading is DeepSpeed's own ``torch.load`` (unchanged).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, ContextManager

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from workers.checksum import ChecksummingWriter
from workers.task import JobConfigError

# rel path (as under the staging directory, e.g. "engine/mp_rank_00_model_states.pt") -> writer
Sink = Callable[[str], ContextManager[ChecksummingWriter]]


class StreamingCheckpointEngine(TorchCheckpointEngine):
    """Serialize DeepSpeed's shards into a per-save sink; ``files`` records what was written."""

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = "SyncpointStreamingCheckpointEngine"
        self.root: str | None = None
        self.sink: Sink | None = None
        self.files: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def streaming(self, root: str, sink: Sink):
        """Within the block, shards DeepSpeed saves under ``root`` go to ``sink`` instead."""
        self.root, self.sink, self.files = root, sink, {}
        try:
            yield self.files
        finally:
            self.root, self.sink = None, None

    def save(self, state_dict: Any, path: str) -> None:
        if self.sink is None or self.root is None:
            return super().save(state_dict, path)
        rel = os.path.relpath(path, self.root).replace(os.sep, "/")
        with self.sink(rel) as writer, _without_zip_crc32():
            torch.save(state_dict, writer, _use_new_zipfile_serialization=self.zipfile_serialization)
        self.files[rel] = writer.entry()


@contextlib.contextmanager
def _without_zip_crc32():
    """torch.save's per-record zip crc32 is computed over each whole tensor before any byte is
    written (no overlap with the write) and duplicates the manifest checksum that covers the whole
    file; torch.load does not need it. Off for our saves only, restored afterwards."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None:
        yield
        return
    before = get()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def install(engine: Any) -> StreamingCheckpointEngine:
    """Swap DeepSpeed's default engine for the streaming one (same serialization settings)."""
    ce = engine.checkpoint_engine
    if isinstance(ce, StreamingCheckpointEngine):
        return ce
    if type(ce) is not TorchCheckpointEngine:
        raise JobConfigError(f"deepspeed.config: selects DeepSpeed's {type(ce).__name__}, but syncpoint streams "
                             "shards through the default torch checkpoint engine (it checksums them and commits "
                             "the manifest itself); remove the checkpoint-engine keys from deepspeed.config")
    streaming = StreamingCheckpointEngine(engine._config)  # DeepSpeed's own config: same serialization
    engine.checkpoint_engine = streaming
    return streaming


def local_sink(root: str, algo: str) -> Sink:
    """Write into a local directory (staging), checksumming; no fsync (host memory, not durable)."""

    @contextlib.contextmanager
    def open_local(rel: str):
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            yield ChecksummingWriter(f, algo)

    return open_local
