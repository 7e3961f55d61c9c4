"""Reusable host buffers for an asynchronous save's snapshot, and when its copies are made.

Why: an async save must capture a consistent state before training changes it, but the training
thread need not serialize it. As in DCP's async save and CheckFreq's snapshot/persist split, every
tensor is copied once into host memory, and ``torch.save``, checksum and upload run in the
background on the copy (``syncpoint.workers.state.writer``). The copy itself need not block either
(DCP's asynchronous staging): a parameter or an optimizer moment changes only at the next
optimizer step, so its copy is *staged*: made by the upload thread (CPU: a memcpy) or queued
(CUDA: a ``non_blocking`` device-to-host copy into pinned memory, which the stream orders before
any later kernel), and the loop waits for it only before that step (``wait_staged``). What a
forward pass changes in place, the module's buffers (BatchNorm statistics), is copied at once.

The buffers are an arena of large chunks allocated once and reused save after save: the same
sequence of tensor sizes lands at the same offsets of the same chunks, so a steady-state save
touches no fresh memory (on this VM a fresh page is a host page fault) and the memory does not
grow. It grows (one more chunk) only when the state grows. Each tensor is a view with its *own*
storage (``torch.from_numpy`` of a slice of the chunk), so ``torch.save`` writes each tensor's
bytes only, never the whole chunk.

One save at a time: :meth:`SnapshotArena.begin` asserts the previous snapshot was released (its
background serialization finished) before any byte is overwritten.

Why by hand: torch's DCP async save stages into its own format and process group; DeepSpeed hands
its checkpoint engine a nested ``state_dict`` of its own objects to ``torch.save`` as one file,
which is what syncpoint's manifest, checksums and weights-only loader expect. This module only
replaces the tensors of that structure by arena-backed copies (``copy.deepcopy`` with the copies
pre-seeded in its memo), so everything else (dicts, lists, ints, DeepSpeed's config objects) is an
independent deep copy that later training cannot mutate.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from syncpoint.workers.training.finite import all_finite

ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's element size
CHUNK = 256 << 20  # bytes per arena chunk (a bigger tensor gets a chunk of its own size)


@dataclass
class _Chunk:
    owner: torch.Tensor  # uint8, pinned when it receives device-to-host copies
    array: np.ndarray  # the same memory, sliced into views with their own storages
    pinned: bool

    @property
    def nbytes(self) -> int:
        return int(self.owner.numel())


class SnapshotArena:
    """Host buffers reused across saves; :meth:`capture` copies one ``state_dict`` into them."""

    def __init__(self, chunk_bytes: int = CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self.chunks: list[_Chunk] = []
        self.busy = False
        self.used = 0  # bytes filled by the current (or last) save, alignment padding included
        self._cursor = (0, 0)  # (chunk index, offset) of the next slot
        self._device_copies = False
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (slot, source) copies not made yet
        self._device_done: Any = None  # a CUDA event recorded after this snapshot's device-to-host copies
        self.checked: list[torch.Tensor] = []  # the copies whose finiteness a commit needs (``finite``)
        self.copied = threading.Event()  # every copy of the current snapshot is made (set: none pending)
        self.copied.set()

    @property
    def capacity(self) -> int:
        """Bytes of host memory held by the arena (its peak: chunks are never freed)."""
        return sum(c.nbytes for c in self.chunks)

    def begin(self) -> None:
        """Start a save's snapshot at the arena's start (the previous one must be released)."""
        assert not self.busy, "snapshot arena reused while the previous save is still being written"
        self.busy, self.used, self._cursor, self._device_copies = True, 0, (0, 0), False
        self._staged, self._device_done = [], None
        self.checked = []
        self.copied.clear()

    def copies_queued(self) -> None:
        """The training thread, when the snapshot is taken: its device-to-host copies are queued on
        the stream (an event marks their end, which the upload thread waits for)."""
        if self._device_copies:
            self._device_done = torch.cuda.Event()
            self._device_done.record()

    def end_copies(self) -> None:
        """Make the staged copies and wait for the device-to-host ones (their event): after it the
        snapshot is consistent (``copied`` is set) and training may change the tensors. The upload
        thread calls it before serializing; an error leaves ``copied`` set all the same, so the loop
        never waits for a snapshot that will not come (the upload raises it at the commit)."""
        try:
            with torch.no_grad():
                for slot, source in self._staged:
                    slot.copy_(source)
            if self._device_done is not None:
                self._device_done.synchronize()
            elif self._device_copies:
                torch.cuda.synchronize()
        finally:
            self._staged, self._device_copies, self._device_done = [], False, None
            self.copied.set()

    def finite(self) -> bool:
        """Whether the snapshot's parameters and optimizer state are finite (every copied tensor but
        the module's buffers, as ``syncpoint.workers.training.finite.tensors_finite`` reads them on the
        training thread). The upload thread asks after :meth:`end_copies`, so the check of a state's
        every byte costs the loop nothing (``syncpoint.workers.state.writer.upload_snapshot``)."""
        return all_finite(self.checked)

    def release(self) -> None:
        """The snapshot was serialized: the next save may overwrite the buffers."""
        self.busy, self.checked = False, []

    def drop(self) -> None:
        """Let go of the chunks when the run ends: DeepSpeed's engine can outlive the run in this
        process (a test, a Python API caller), and an arena's untouched 256 MiB chunks then add up to
        tens of GiB of address space that make the next ``fork`` fail with ENOMEM. A snapshot still
        being written keeps its chunk alive through its own views until the write is done."""
        self.chunks, self.busy, self.used, self._cursor, self.checked = [], False, 0, (0, 0), []

    def capture(self, obj: Any, now: Callable[[torch.Tensor], bool] = lambda t: True) -> Any:
        """A deep copy of ``obj`` whose tensors (found in dicts, lists and tuples) live in the
        arena; the same tensor (or view of the same memory) appearing twice shares its copy. A CPU
        tensor for which ``now`` is false is staged: its slot holds its bytes only after
        :meth:`end_copies`, and it must not change before then. Must be between :meth:`begin` and
        :meth:`release`."""
        assert self.busy, "capture outside begin()/release()"
        memo: dict[int, Any] = {}
        slots: dict[tuple[Any, ...], torch.Tensor] = {}
        for t in _tensors(obj):
            if id(t) in memo:
                continue
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            base = slots.get(key)
            if base is None:
                changed_by_forward = now(t)
                base = slots[key] = self._copy(t, staged=not t.is_cuda and not changed_by_forward)
                memo[id(t)] = base
                if not changed_by_forward and t.is_floating_point():
                    self.checked.append(base)
            else:  # another tensor object over the same memory: its own tensor, sharing the storage
                memo[id(t)] = base.detach()
            if isinstance(t, torch.nn.Parameter):
                memo[id(t)] = torch.nn.Parameter(memo[id(t)], requires_grad=t.requires_grad)
        return copy.deepcopy(obj, memo)

    def _copy(self, t: torch.Tensor, staged: bool = False) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        target, alias = self._slot(nbytes, pin=t.is_cuda)
        # into a view of the chunk's own (pinned) tensor, so torch's pinned-memory bookkeeping of
        # a non_blocking device-to-host copy sees its allocation; the alias is the same bytes
        slot = target.view(t.dtype).view(t.shape)
        if staged:  # detached now: the memory the tensor has at the boundary, whatever points at it later
            self._staged.append((slot, t.detach()))
        else:
            with torch.no_grad():
                slot.copy_(t.detach(), non_blocking=t.is_cuda)
        self._device_copies |= t.is_cuda
        return alias.view(t.dtype).view(t.shape)

    def _slot(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``nbytes`` of the arena, twice: a view of the chunk's tensor (to copy into) and
        a uint8 tensor over the same bytes with a storage of its own (to serialize). The same sizes
        in the same order give the same slots every save."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        i, off = self._cursor
        while i < len(self.chunks) and off + size > self.chunks[i].nbytes:
            i, off = i + 1, 0  # the tail that did not fit stays unused (and untouched)
        if i == len(self.chunks):
            self.chunks.append(_new_chunk(max(size, self.chunk_bytes), pin))
        self._cursor = (i, off + size)
        self.used += size
        chunk = self.chunks[i]
        return chunk.owner[off : off + nbytes], torch.from_numpy(chunk.array[off : off + nbytes])


def _new_chunk(nbytes: int, pin: bool) -> _Chunk:
    pin = pin and torch.cuda.is_available()
    owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return _Chunk(owner, owner.numpy(), pin)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The plain strided tensors of a nested structure of dicts, lists and tuples. Anything else
    (a tensor subclass, a sparse tensor, a tensor inside another object) is left to deepcopy,
    which clones it: correct, only not in the arena."""
    if isinstance(obj, torch.Tensor):
        if (
            type(obj) in (torch.Tensor, torch.nn.Parameter)
            and obj.layout == torch.strided
            and obj.device.type in ("cpu", "cuda")
            and not obj.is_quantized
        ):
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
