"""Local file writes that bypass the page cache (O_DIRECT), with a queue of reused buffers.

Why: a buffered write of a new 400 MB file first has to find 400 MB of page cache, and on a
virtual machine whose free memory is handed back to the host (virtio balloon / free page
reporting) every such page is a host page fault: measured here, buffered writes of new files ran
at 0.4-0.5 GB/s against 1.9 GB/s for the same bytes with O_DIRECT (``dd oflag=direct``). A save
also should not push 400 MB of training data out of the page cache. So local saves copy into four
reused, page-aligned 16 MiB buffers and a helper thread writes each full buffer with O_DIRECT while
the caller fills the next ones (``os.write`` releases the GIL; with two buffers the disk idled
whenever serialization stalled, 1.5-1.8 GB/s; with four, 1.9-2.2 GB/s inside a training process).
The unaligned tail is written through the page cache, then the file is fsync'd. Where O_DIRECT is
refused (tmpfs, some network filesystems, macOS), the same writer falls back to buffered writes.
The file is a new one: whatever entry held the name is unlinked (never followed) and the file
created exclusively (``syncpoint.workers.storage.nofollow.create_new``), so a planted link is never written through.
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from syncpoint.workers.storage.nofollow import create_new, write_all

BLOCK = 16 << 20  # per buffer; a multiple of every logical block size (16 MiB: 2.7 GB/s here, 8 MiB: 1.7)
ALIGN = 4096
BUFFERS = 4  # one being filled, up to three queued for the writer thread
O_DIRECT = getattr(os, "O_DIRECT", 0)

_free_buffers: list[mmap.mmap] = []  # page-aligned, already resident: reused across files and saves
_lock = threading.Lock()


def _take_buffer() -> mmap.mmap:
    with _lock:
        return _free_buffers.pop() if _free_buffers else mmap.mmap(-1, BLOCK)


def _give_back(buf: mmap.mmap) -> None:
    with _lock:
        if len(_free_buffers) < BUFFERS:  # 64 MiB stay resident for the next file
            _free_buffers.append(buf)
            return
    try:
        buf.close()
    except BufferError:  # a view still exists somewhere: the garbage collector frees it later
        pass


class DirectFileWriter:
    """A write-only file object for one local file; ``close()`` makes it durable (fsync)."""

    def __init__(self, path: str, *, dir_fd: int | None = None, shown: str | None = None) -> None:
        """``path``: the file (relative to ``dir_fd`` when given); ``shown``: its name in messages."""
        import fcntl

        self.fd = create_new(dir_fd, path, shown or path)
        self.direct = False
        if O_DIRECT:
            try:  # refused (EINVAL) where the filesystem cannot bypass the page cache
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | O_DIRECT)
                self.direct = True
            except OSError:
                pass
        self.buffers = [_take_buffer() for _ in range(BUFFERS)]
        self.current, self.fill = 0, 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="syncpoint-direct-write")
        self.pending: deque[Future] = deque()  # writes in flight, oldest first (one thread: in order)
        self.closed = False

    # ---- the file-object surface torch.save and shutil need
    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, pos = len(view), 0
        while pos < n:
            take = min(BLOCK - self.fill, n - pos)
            self.buffers[self.current][self.fill : self.fill + take] = view[pos : pos + take]
            self.fill += take
            pos += take
            if self.fill == BLOCK:
                self._submit()
        return n

    def fill_from(self, src: io.RawIOBase | io.BufferedIOBase, on_chunk: Any = None) -> int:
        """Copy a whole readable file in, reading straight into the aligned buffers (no extra copy).
        ``on_chunk(memoryview)`` sees every chunk (a checksum)."""
        total = 0
        while True:
            buf = memoryview(self.buffers[self.current])[self.fill :]
            n = src.readinto(buf)
            if not n:
                return total
            if on_chunk is not None:
                on_chunk(buf[:n])
            self.fill += n
            total += n
            if self.fill == BLOCK:
                self._submit()

    def flush(self) -> None:
        """Nothing to do: full buffers are already on their way, the rest goes out at close."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    # ---- internals
    def _submit(self) -> None:
        view = memoryview(self.buffers[self.current])[: self.fill]
        self.pending.append(self.pool.submit(write_all, self.fd, view))
        self.current, self.fill = (self.current + 1) % len(self.buffers), 0
        if len(self.pending) == len(self.buffers):  # the next buffer to fill is still being written
            self.pending.popleft().result()

    def _wait(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def close(self, durable: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._wait()
            view = memoryview(self.buffers[self.current])[: self.fill]
            aligned = (len(view) // ALIGN) * ALIGN if self.direct else len(view)
            write_all(self.fd, view[:aligned])
            if aligned < len(view):  # the unaligned tail goes through the page cache
                import fcntl

                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
                write_all(self.fd, view[aligned:])
            if durable:
                os.fsync(self.fd)
        finally:
            self.pool.shutdown(wait=True)
            os.close(self.fd)
            for buf in self.buffers:
                _give_back(buf)
            self.buffers = []

    def __enter__(self) -> DirectFileWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(durable=exc_type is None)
