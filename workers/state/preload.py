"""A restore's DeepSpeed files unpickled on a second thread while the next files are still fetched.

Why: a restore from an object store downloaded and checksummed every file, and only then did
DeepSpeed unpickle them one by one (``torch.load`` into fresh tensors: 1-2.7 s per rank for a
0.9 GB share, bench P10), so the load waited for the last byte of the last file, and the network
sat idle during the load. Files are verified one after another, so each downloaded file is
unpickled here, through the same weights-only loader DeepSpeed's reads go through
(``syncpoint.workers.integrity.safe_load``), while the next one downloads; DeepSpeed's read of it
(``syncpoint.workers.state.checkpoint_engine``) then takes the result instead of reading the file.

The unpickling maps the file's storages instead of copying them (``torch.load(mmap=True)``, the
fetch's weights-only check itself, so that check is not made twice): unpickling into fresh
tensors cost 2-2.7 s of CPU per rank beside the downloads, and on two cores that slowed the
downloads more than it saved (P10, 2026-12-03: S3 restore 0.76x the raw download, 1.12x with
mapped storages). DeepSpeed then copies from the page cache into its own tensors; the optimizer
state it would keep as views of the file is copied after the load
(``syncpoint.workers.state.mapped_state``), so no mapping outlives the fetch's cleanup.
Not for a state verified in place, whose reads take seconds, not tens of seconds (the second
thread's unpickling measured slower there than DeepSpeed's own read). Of those, DeepSpeed's own
read maps the node's memory copy (``FetchedState.mapped`` in ``syncpoint.workers.state.reader``),
and never a local state: that file is storage, which may change or shrink under a mapping after
its check.

What it keeps:

* **only verified bytes**: a file is handed here after its size and checksum matched and it was
  renamed into the rank's private directory, where nobody else writes, and nobody ever rewrites or
  truncates it (the cleanup only unlinks it);
* **nothing touches the engine early**: results are plain tensors in host memory until DeepSpeed
  asks for them, after every rank fetched, verified and agreed; a state refused meanwhile leaves
  only these objects, dropped with :meth:`Preloads.close`;
* **the same placement**: DeepSpeed's reads of these files ask for host memory (``'cpu'``, or
  ``lambda storage, loc: storage``); a read that asks for anything else loads the file itself;
* **no more memory than DeepSpeed's own load**: mapped storages are the page cache the download
  filled, and only the files DeepSpeed reads are preloaded: the caller asks for this only when the
  load reads exactly this rank's fetched files (``own_shard`` in ``syncpoint.workers.state.reader``).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from syncpoint.workers.integrity.safe_load import load_state_file


class Preloads:
    """Verified files being unpickled (storages mapped) in order on one thread; each result is taken once."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future[Any]] = {}

    def add(self, rel: str, path: str) -> None:
        """Start unpickling ``rel`` (its name in the state) from ``path``, a file already verified."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncpoint-preload")
        self._pending[rel] = self._pool.submit(load_state_file, path, rel, map_location="cpu", mmap=True)

    def checked(self, rel: str) -> bool:
        """Wait for ``rel``'s unpickling, which is the fetch's weights-only check of it (the same load,
        bounds and refusal as ``check_state_file``): its ``StateRefused`` is raised here. ``False``:
        ``rel`` is not preloaded (or was taken), so the caller checks it itself."""
        future = self._pending.get(rel)
        if future is None:
            return False
        future.result()
        return True

    def take(self, rel: str) -> Future[Any] | None:
        """The unpickling of ``rel``, handed out once (``None``: not preloaded, or taken already)."""
        return self._pending.pop(rel, None)

    @property
    def names(self) -> list[str]:
        """What is preloaded and not taken yet (tests)."""
        return sorted(self._pending)

    def close(self) -> None:
        """Drop what was not taken, after the running load ended (it reads a descriptor or a file
        the caller closes or removes next)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def host_placement(map_location: Any) -> bool:
    """Whether a load asked for tensors in host memory, as a preload makes them: ``'cpu'``,
    ``torch.device('cpu')``, or a function that keeps the storage it is given (DeepSpeed's
    ``lambda storage, loc: storage``: storages are unpickled into host memory first)."""
    if isinstance(map_location, str):
        return map_location == "cpu"
    if callable(map_location) and getattr(map_location, "__closure__", True) is None:
        marker = object()
        try:
            return map_location(marker, "cuda:0") is marker
        except Exception:  # noqa: BLE001 - any other function decides placement itself: load the file
            return False
    return str(map_location) == "cpu" and type(map_location).__name__ == "device"
