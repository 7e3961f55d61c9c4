"""DeepSpeed's checkpoint-engine hook: each file DeepSpeed saves goes where the save wants it.

Why: DeepSpeed's own engine ``torch.save``-s every shard to a path, and the state writer then had
to read it back to checksum it and copy it into storage: two full copies and a full read per
save. DeepSpeed routes every shard through ``engine.checkpoint_engine.save(state_dict, path)``
(the hook Nebula and its fast/decoupled engines use), so this engine serializes each shard
straight into a sink chosen per save, checksumming as the bytes pass:

* a synchronous save streams into storage itself (``RunStorage.open_durable``): one write;
* an asynchronous save only copies the shard's tensors into reusable host buffers
  (``syncpoint.workers.state.snapshot_arena``: the one part that blocks training) and keeps the copied structure;
  the background thread then serializes it into storage the same way (:func:`write_captured`).

DeepSpeed still gets a local directory for everything else it writes (its recovery scripts),
which the writer ignores.

Loading goes through the same engine: DeepSpeed 0.19.8's ``load_checkpoint`` reads the model
file, the non-ZeRO optimizer file, every ZeRO-1/2 (and bf16) optimizer shard and MoE expert files
with ``self.checkpoint_engine.load`` (engine.py ``_load_checkpoint``, ``_get_all_zero_checkpoint_
state_dicts``, ``load_moe_state_dict``; the state-dict loader in state_dict_factory.py), never
``torch.load`` itself; ``stage_1_and_2.py`` loads nothing from disk. ZeRO-3 (``stage3.py``) reads
its shards the same way: ``_load_zero_checkpoint`` hands it the state dicts the engine loaded, and
``_rigid_load_state_dict`` only copies tensors.

Every ``torch.load(weights_only=False)`` in DeepSpeed 0.19.8 that a stage-3 (or 1/2) load could
reach, found by reading the load path (``grep -n "torch.load" runtime/``):

* ``TorchCheckpointEngine.load`` (torch_checkpoint_engine.py:37): replaced by :meth:`StreamingCheckpointEngine.load`;
* ``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`` (stage3.py:3660,
  ``zero/optimizer_state.pt``) and ``load_hp_checkpoint_state`` (stage3.py:3770, one file per
  parameter), reached only through ``_load_universal_checkpoint`` when ``load_universal`` is set;
* ``ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir`` (base_optimizer.py:337), the same
  path at ZeRO 1/2;
* ``get_fp32_state_dict_from_zero_checkpoint`` (utils/zero_to_fp32.py:146/153/204), which
  ``_load_checkpoint`` (engine.py:4614) calls at ZeRO-3 whenever optimizer states are *not* loaded:
  ``resume.init_from`` without ``init_optimizer``, ``resume.reset_optimizer``. It would read a
  ``latest`` file and unpickle every shard with ``weights_only=False``. :func:`install` replaces the
  name ``deepspeed.runtime.engine`` resolves at that call (the only caller on a load path) with
  :func:`safe_fp32_state_dict_from_zero_checkpoint`: the same consolidation, through the
  weights-only loader, from syncpoint's ``engine`` tag (never a ``latest`` file).

:func:`install` refuses ``checkpoint.load_universal`` and, as a second line, replaces those three
methods on this engine's optimizer instance (not the class: scoped to syncpoint's engine) with a
refusal, so no configuration DeepSpeed might grow can reach them. The other ``torch.load`` calls
in DeepSpeed (inference, ``zero_to_fp32``, NVMe swapping, which the spec does not allow) are not on
any path syncpoint drives. So overriding ``load`` with the weights-only loader
(``syncpoint.workers.integrity.safe_load``) covers every file DeepSpeed unpickles for us.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import IO, Any, cast

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from syncpoint.policies.contracts.errors import JobConfigError, StateRefused
from syncpoint.policies.contracts.state_format import ENGINE_TAG, ManifestEntry
from syncpoint.workers.integrity.checksum import ChecksummingWriter
from syncpoint.workers.integrity.safe_load import load_state_file
from syncpoint.workers.state.preload import Preloads, host_placement
from syncpoint.workers.state.snapshot_arena import SnapshotArena

# rel path (as under the staging directory, e.g. "engine/mp_rank_00_model_states.pt") -> writer
Sink = Callable[[str], AbstractContextManager[ChecksummingWriter]]


class StreamingCheckpointEngine(TorchCheckpointEngine):
    """Serialize DeepSpeed's shards into a per-save sink; ``files`` records what was written."""

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        self.name = "SyncpointStreamingCheckpointEngine"
        self.root: str | None = None
        self.sink: Sink | None = None
        self.files: dict[str, ManifestEntry] = {}
        # async saves: the host buffers (kept for the engine's life, reused save after save) and,
        # within ``capturing``, each shard's rel path -> its copied structure, in save order
        self.arena = SnapshotArena()
        self.captured: dict[str, Any] | None = None
        self.now: Callable[[Any], bool] | None = None  # within ``capturing``: which tensors are copied at once
        # a load of a verified state: rel path -> the verified file's path (``serving``)
        self.served: tuple[str, dict[str, str]] | None = None
        # and the files already unpickled on the fetch's second thread (``syncpoint.workers.state.preload``)
        self.preloads: Preloads | None = None
        self.mapped = False  # the served files' storages are mapped, not read (``serving``)
        # the last file served, handed out once more if DeepSpeed asks for it again at once: its
        # ``SDLoaderBase.check_ckpt_list`` loads the model file only to read one key, then ``load``
        # loads it again (0.19.8, state_dict_factory.py); the first read of a state file is its cost
        self.repeat: tuple[tuple[str, Any], Any] | None = None

    @contextlib.contextmanager
    def serving(
        self, root: str, files: dict[str, str], preloads: Preloads | None = None, mapped: bool = False
    ) -> Iterator[None]:
        """Within the block, DeepSpeed's reads under ``root`` get only these verified files (rel path
        -> the path that opens the verified descriptor, ``syncpoint.workers.integrity.verified_files``,
        or a verified download); any other file it asks for is refused (``StateRefused``): in place,
        the state directory may hold files nobody verified (another rank's shard), and a name there
        may be swapped after verification. A file in ``preloads`` is taken from there when the read
        asks for host memory (``syncpoint.workers.state.preload``). ``mapped``: the files are this
        node's memory copy, whose storages are mapped rather than read (``FetchedState.mapped``)."""
        self.served, self.preloads, self.repeat, self.mapped = (root, files), preloads, None, mapped
        try:
            yield
        finally:
            self.served, self.preloads, self.repeat, self.mapped = None, None, None, False

    @contextlib.contextmanager
    def streaming(self, root: str, sink: Sink) -> Iterator[dict[str, ManifestEntry]]:
        """Within the block, shards DeepSpeed saves under ``root`` go to ``sink`` instead."""
        self.root, self.sink, self.files = root, sink, {}
        try:
            yield self.files
        finally:
            self.root, self.sink = None, None

    @contextlib.contextmanager
    def capturing(self, root: str, now: Callable[[Any], bool] = lambda t: True) -> Iterator[dict[str, Any]]:
        """Within the block, shards DeepSpeed saves under ``root`` are only copied into the arena
        (an async save's snapshot); the block's value maps each rel path to its copy, to serialize
        later with :func:`write_captured`. A tensor for which ``now`` is false is staged
        (``syncpoint.workers.state.snapshot_arena``): its copy is made by ``arena.end_copies``,
        which the caller runs before serializing and training waits for (``arena.copied``) before
        it changes such a tensor. The caller releases the arena (``self.arena.release()``) once the
        copies are written."""
        self.arena.begin()
        self.root, self.captured, self.now = root, {}, now
        try:
            yield self.captured
        except BaseException:
            self.arena.end_copies()
            self.arena.release()
            raise
        else:
            self.arena.copies_queued()
        finally:
            self.root, self.captured, self.now = None, None, None

    def save(self, state_dict: Any, path: str) -> None:
        if self.root is not None and self.captured is not None:
            rel = os.path.relpath(path, self.root).replace(os.sep, "/")
            self.captured[rel] = self.arena.capture(state_dict, self.now or (lambda t: True))
            return None
        if self.sink is None or self.root is None:
            return super().save(state_dict, path)
        rel = os.path.relpath(path, self.root).replace(os.sep, "/")
        with self.sink(rel) as writer, _without_zip_crc32():
            # torch.save only writes and flushes a buffer it did not open: the writer is the file it needs
            torch.save(state_dict, cast(IO[bytes], writer), _use_new_zipfile_serialization=self.zipfile_serialization)
        self.files[rel] = writer.entry()

    def load(self, path: str, map_location: Any = None) -> Any:
        """DeepSpeed's every read of a state file: weights-only, with syncpoint's allowlist, never
        ``weights_only=False``; a file needing another class raises ``StateRefused`` naming it.
        While ``serving``, only the verified files are read, each through its open descriptor."""
        if self.served is None:
            return load_state_file(path, _name_in_state(path), map_location=map_location)
        root, files = self.served
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if rel not in files:
            raise StateRefused(
                f"{rel}: DeepSpeed asked for a file this rank did not verify against the manifest: refused"
            )
        key = (rel, _placement(map_location))
        if self.repeat is not None and self.repeat[0] == key:  # DeepSpeed reads the model file twice in a row
            loaded, self.repeat = self.repeat[1], None
            return loaded
        preloaded = self.preloads.take(rel) if self.preloads is not None and host_placement(map_location) else None
        if preloaded is not None:
            loaded = preloaded.result()
        else:
            loaded = load_state_file(files[rel], rel, map_location=map_location, mmap=self.mapped)
        self.repeat = (key, loaded)
        return loaded


def write_captured(
    captured: dict[str, Any], sink: Sink, zipfile_serialization: bool = True
) -> dict[str, ManifestEntry]:
    """Serialize an async save's copied shards (:meth:`StreamingCheckpointEngine.capturing`)
    into ``sink``, checksumming on the way, exactly as a sync save writes them; returns their
    manifest entries. Runs in the background thread: the copies are no longer training's tensors."""
    files: dict[str, ManifestEntry] = {}
    with _without_zip_crc32():
        for rel, state_dict in captured.items():
            with sink(rel) as writer:
                torch.save(state_dict, cast(IO[bytes], writer), _use_new_zipfile_serialization=zipfile_serialization)
            files[rel] = writer.entry()
    return files


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
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


def _placement(map_location: Any) -> Any:
    """What decides where a load puts tensors, comparable between calls: DeepSpeed passes a fresh
    ``lambda storage, loc: storage`` each time, so a function without closure is keyed by its code."""
    if callable(map_location) and getattr(map_location, "__closure__", True) is None:
        code = map_location.__code__
        return ("code", code.co_code, code.co_consts, code.co_names)
    return map_location if isinstance(map_location, (str, type(None))) else repr(map_location)


def _name_in_state(path: str) -> str:
    """How a refusal names a file: as in the manifest (``engine/<file>``), not a temp path."""
    parts = os.path.normpath(path).split(os.sep)
    return "/".join(parts[-2:])


def install(engine: Any) -> StreamingCheckpointEngine:
    """Swap DeepSpeed's default engine for the streaming one (same serialization settings).

    Also refuses the universal-checkpoint load path: DeepSpeed reads those files with its own
    ``torch.load(weights_only=False)``, past any checkpoint engine, and syncpoint never writes them."""
    ce = engine.checkpoint_engine
    if isinstance(ce, StreamingCheckpointEngine):
        return ce
    if type(ce) is not TorchCheckpointEngine:
        raise JobConfigError(
            f"deepspeed.config: selects DeepSpeed's {type(ce).__name__}, but syncpoint streams "
            "shards through the default torch checkpoint engine (it checksums them and commits "
            "the manifest itself); remove the checkpoint-engine keys from deepspeed.config"
        )
    _refuse_universal_load(engine)
    seal_unsafe_loaders(engine.optimizer)
    route_zero3_module_load()
    streaming = StreamingCheckpointEngine(engine._config)  # DeepSpeed's own config: same serialization
    engine.checkpoint_engine = streaming
    return streaming


def _refuse_universal_load(engine: Any) -> None:
    if engine.load_universal_checkpoint():
        raise JobConfigError(
            "deepspeed.config: checkpoint.load_universal makes DeepSpeed unpickle universal-"
            "checkpoint files itself with weights_only=False (code from storage would run), and "
            "syncpoint's states are not universal checkpoints; remove checkpoint.load_universal"
        )


# DeepSpeed optimizer methods that unpickle files with torch.load(weights_only=False) themselves
UNSAFE_LOADERS = (
    "load_hp_checkpoint_state_from_checkpoint_dir_stage3",
    "load_hp_checkpoint_state",
    "load_hp_checkpoint_state_from_checkpoint_dir",
)


def seal_unsafe_loaders(optimizer: Any) -> list[str]:
    """Replace, on this optimizer instance only, each DeepSpeed method that would ``torch.load``
    with ``weights_only=False`` (universal-checkpoint loading) by one that refuses. Returns the
    names sealed (for the test). Instance attributes shadow the class's methods; nothing global
    changes, and an optimizer without them (ZeRO 0's torch optimizer) is left as it is."""
    sealed = []
    for name in UNSAFE_LOADERS:
        if callable(getattr(optimizer, name, None)):
            setattr(optimizer, name, _refusing(name))
            sealed.append(name)
    return sealed


def _refusing(name: str) -> Callable[..., Any]:
    def refuse(*_: Any, **__: Any) -> Any:
        raise JobConfigError(
            f"DeepSpeed's {name} unpickles checkpoint files with weights_only=False (code from "
            "storage would run); syncpoint loads state files only through its weights-only loader"
        )

    return refuse


def safe_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, torch.Tensor]:
    """DeepSpeed's ZeRO-3 module-only load, weights-only: the whole model (fp32) put together from
    the partitions under ``<checkpoint_dir>/<tag>`` (syncpoint's tag is ``engine``; no ``latest``
    file is read), every file through :func:`load_state_file`. Same signature as DeepSpeed's."""
    from syncpoint.workers.state.zero3_consolidate import consolidate_zero3

    directory = os.path.join(checkpoint_dir, tag or ENGINE_TAG)
    names = sorted(f"{ENGINE_TAG}/{n}" for n in os.listdir(directory))

    def load(rel: str) -> Any:
        return load_state_file(os.path.join(directory, rel.split("/", 1)[1]), rel)

    full = consolidate_zero3(names, load)
    return {k: v.float() if v.is_floating_point() else v for k, v in full.items()}


# a marker, checked below before DeepSpeed's loader is trusted (a function attribute mypy does not model)
safe_fp32_state_dict_from_zero_checkpoint.syncpoint_safe = True  # type: ignore[attr-defined]


def route_zero3_module_load() -> None:
    """Point ``deepspeed.runtime.engine``'s ``get_fp32_state_dict_from_zero_checkpoint`` (imported
    there by name, called only from ``_load_checkpoint``) at the weights-only version. The one
    process-wide change syncpoint makes to DeepSpeed; idempotent;
    ``tests/integration/workers/training/test_engine_zero3.py``
    checks it."""
    import deepspeed.runtime.engine as ds_engine

    if not getattr(ds_engine.get_fp32_state_dict_from_zero_checkpoint, "syncpoint_safe", False):
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = safe_fp32_state_dict_from_zero_checkpoint
