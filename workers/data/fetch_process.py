"""Shard downloads in a process of their own, beside the process that reads the shards.

Why a process and not threads: a download is Python work between its system calls (the HTTP
client's event loop, the response's chunks, the writes and the checksum), and it holds the GIL
meanwhile. On the reading process's own threads it slowed the reader's batches: in P11 a cold
epoch's batches took 2.7 times the CPU time they take alone, beside four download threads. The
child runs the same :class:`~syncpoint.workers.data.shard_cache.Prefetcher` over the same node
cache, so the locks, the bound and the checksums are unchanged. The reader still fetches a shard
itself when it gets there first, and that is also how a failed download reaches the reader.

How it talks: JSON lines on its stdin (the configuration, then each new plan); one line back on
stdout once it can download (``ready``). It ends when its stdin closes (its reader ended), when its
parent changes, or after ``IDLE_S`` with nothing to do; the reader starts another with its next
plan. Where a child cannot serve (an in-process ``memory://`` filesystem, settings that do not
travel as JSON, a child that failed), the reader's own threads download, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from syncpoint.workers.data.shard_cache import Prefetcher, RemoteShard, ShardCache

IDLE_S = 60.0  # a child with no plan and no download for this long ends
READY_TIMEOUT_S = 60.0
PARENT_POLL_S = 1.0


def travels(fs: Any) -> bool:
    """Whether a child process reaches the same storage: not for a filesystem that lives in this
    process (``memory://``), nor when fsspec's settings do not travel as JSON."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "memory" in protocol or "file" in protocol:
        return False
    try:
        _fsspec_conf()
    except (TypeError, ValueError):
        return False
    return True


def _fsspec_conf() -> str:
    import fsspec.config

    return json.dumps(fsspec.config.conf)


class FetchProcess:
    """The reader's side: starts the child, hands it each plan, restarts it after an idle exit, and
    answers ``False`` from :meth:`want` when the caller must download itself."""

    def __init__(self, url: str, directory: str, bound: int, concurrency: int, idle_s: float = IDLE_S) -> None:
        self.config = {
            "url": url,
            "directory": directory,
            "bound": int(bound),
            "concurrency": int(concurrency),
            "idle_s": float(idle_s),
            "fsspec": _fsspec_conf(),
        }
        self._child: subprocess.Popen[str] | None = None
        self._plan: list[RemoteShard] = []
        self.failed: str | None = None  # why the reader's threads download instead (said once on stderr)
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen[str]:
        package = sys.modules[__name__.split(".")[0]]  # syncpoint: the child imports it from the same place
        root = os.path.dirname(os.path.dirname(os.path.abspath(package.__file__ or "")))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        child = subprocess.Popen(
            [sys.executable, "-m", "syncpoint.workers.data.fetch_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert child.stdin is not None
        child.stdin.write(json.dumps(self.config) + "\n")
        child.stdin.flush()
        return child

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    def _running(self) -> subprocess.Popen[str] | None:
        """The child, started (again, after an idle exit) if need be; ``None`` once it failed."""
        if self.failed is not None:
            return None
        child = self._child
        if child is not None and child.poll() is not None:
            if child.returncode != 0:
                self.failed = f"the shard fetch process ended with exit code {child.returncode}"
                return None
            child = None  # it ended idle: start another
        if child is None:
            try:
                child = self._child = self._start()
            except OSError as e:
                self.failed = f"the shard fetch process did not start ({e})"
                return None
            self._plan = []
        return child

    def start(self) -> None:
        """Start the child now, so that it imports its client while the reader sets up."""
        with self._lock:
            self._running()

    def want(self, plan: list[RemoteShard]) -> bool:
        """Hand the child this plan; ``False`` when no child can take it (``failed`` says why, on
        stderr the first time). A child that ended idle just as the plan came is started again once."""
        with self._lock:
            said = self.failed is not None
            taken = self._hand(plan)
        if not taken and not said:
            print(f"[syncpoint] WARNING: {self.failed}; this process downloads the shards itself", file=sys.stderr)
        return taken

    def _hand(self, plan: list[RemoteShard]) -> bool:
        """``want``'s part under the lock."""
        for _ in range(2):
            child = self._running()
            if child is None:
                return False
            if plan == self._plan:
                return True
            assert child.stdin is not None
            try:
                child.stdin.write(json.dumps({"plan": [asdict(s) for s in plan]}) + "\n")
                child.stdin.flush()
            except (BrokenPipeError, ValueError):
                child.wait()  # it ended: idle (start another) or failed (``_running`` says)
                continue
            self._plan = list(plan)
            return True
        self.failed = self.failed or "the shard fetch process ended as it was started"
        return False

    def ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Wait until the child can download (it has imported its client); for a caller that wants
        the start-up behind it, as a long job has."""
        with self._lock:
            child = self._child
        if child is None or child.stdout is None:
            return False
        readable, _, _ = select.select([child.stdout], [], [], timeout)
        return bool(readable) and child.stdout.readline().strip() == "ready"

    def close(self) -> None:
        """End the child now (its downloads in flight are abandoned; the cache removes their parts)."""
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return
        with contextlib.suppress(OSError, ValueError):
            assert child.stdin is not None
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# ------------------------------------------------------------------ the child


class _Lines:
    """Lines from a file descriptor, read unbuffered so that ``select`` sees every byte still to come."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffered = fd, b""
        self.complete: list[bytes] = []

    def read(self, timeout: float | None) -> bytes | None:
        """The next line (without its newline); ``b""`` at the end of the input; ``None`` after
        ``timeout`` seconds with no complete line."""
        while not self.complete:
            readable, _, _ = select.select([self.fd], [], [], timeout)
            if not readable:
                return None
            data = os.read(self.fd, 1 << 20)
            if not data:
                return b""
            *lines, self.buffered = (self.buffered + data).split(b"\n")
            self.complete.extend(lines)
        return self.complete.pop(0)


def _serve(lines: _Lines, say: Callable[[str], None]) -> None:
    import fsspec
    import fsspec.config

    from syncpoint.workers.storage import backend_for

    parent = os.getppid()
    first = lines.read(READY_TIMEOUT_S)
    if not first:
        return
    config = json.loads(first)
    fsspec.config.conf.update(json.loads(config["fsspec"]))
    fs, _ = fsspec.core.url_to_fs(config["url"])
    backend = backend_for(fs, "")
    cache = ShardCache(
        config["directory"],
        config["bound"],
        lambda src, dst, limit: backend.download_file(dst, src, "xxh3_128", limit),
    )

    prefetcher = Prefetcher(cache.fetch, lambda s: s.key, cache.has, config["concurrency"])
    say("ready")
    idle = 0.0
    while os.getppid() == parent:
        line = lines.read(PARENT_POLL_S)
        if line == b"":
            return  # the reader closed the pipe, or ended
        if line is None:
            idle = 0.0 if prefetcher.busy() else idle + PARENT_POLL_S
            if idle >= config["idle_s"]:
                return
            continue
        idle = 0.0
        while lines.complete:  # only the newest plan counts
            line = lines.complete.pop(0)
        prefetcher.want([RemoteShard(**s) for s in json.loads(line)["plan"]])


def main() -> None:
    """The child: downloads until its reader goes away. Ctrl-C is the reader's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        _serve(_Lines(sys.stdin.fileno()), say)
    except Exception as e:  # noqa: BLE001 - one line for the reader's log, then its own downloads go on
        print(f"[syncpoint] the shard fetch process stopped: {type(e).__name__}: {e}", file=sys.stderr)
        os._exit(1)
    os._exit(0)  # downloads in flight are abandoned; the cache removes their parts


if __name__ == "__main__":
    main()
