"""The supervisors' store, held by a small process that has torch, on a supervisor's behalf.

Why: a supervisor (one per rank, the Ray Train worker with ``failure.in_place``) never trains, and
importing torch was 3.5 s of every Ray Train worker group's start on two cores (measured: a
no-op train function's group started in 4.0-4.4 s without torch against 7.3-8.6 s with it). Its
coordination store must still be torch's ``TCPStore``: the training processes form their process
group on it. So each supervisor starts one agent the way it starts its training processes (forked
from the node's warm server, or from its own), and the agent holds the store, served by rank 0's,
and answers the supervisor's few operations (add, set, get, check) over a pipe. It ends when the
pipe closes, that is when its supervisor ends or drops it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

OPS = ("add", "set", "get", "check")
# how long a client waits for rank 0's store (its agent may wait for its fork server's imports first)
MIN_TIMEOUT_S = 60.0


class AgentError(RuntimeError):
    """The agent could not do an operation, or is gone."""


def serve(conn: Any, host: str, port: int | None, timeout_s: float) -> None:
    """The agent's body: serve a ``TCPStore`` on ``host`` (``port`` None: this is rank 0's, on a free
    port, sent first) or join the one at ``host:port``, then answer until the pipe closes."""
    from datetime import timedelta

    import torch.distributed as dist

    from syncpoint.workers.supervisor import _die_with_parent

    _die_with_parent()
    try:
        timeout = timedelta(seconds=max(MIN_TIMEOUT_S, timeout_s))
        if port is None:
            store = dist.TCPStore(host, 0, None, is_master=True, timeout=timeout, wait_for_workers=False)
        else:
            store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
        reply: tuple[str, Any] = ("ok", store.port)
    except Exception as e:  # noqa: BLE001 - said to the supervisor, which raises it
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"[:2000]))
        os._exit(1)
    while True:
        try:
            conn.send(reply)
            op, args = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the supervisor is gone or done: so is its store (rank 0's serves nobody now)
        try:
            reply = ("ok", getattr(store, op)(*args) if op in OPS else None)
        except Exception as e:  # noqa: BLE001 - a store error is the supervisor's to raise
            reply = ("error", f"{type(e).__name__}: {e}"[:2000])


class AgentStore:
    """The supervisor's side: ``TCPStore``'s operations that the supervisors use, each one a round
    trip to the agent (thread-safe: one at a time)."""

    def __init__(self, proc: Any, conn: Any) -> None:
        self.proc, self.conn = proc, conn
        self._lock = threading.Lock()
        self.port: int = self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise AgentError(f"the supervisors' store agent ended ({self._exit()})") from e
        if status != "ok":
            raise AgentError(f"the supervisors' store: {value}")
        return value

    def _exit(self) -> str:
        self.proc.join(5)
        return f"exit code {self.proc.exitcode}"

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            try:
                self.conn.send((op, args))
            except OSError as e:
                raise AgentError(f"the supervisors' store agent ended ({self._exit()})") from e
            return self._reply()

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def close(self) -> None:
        """End the agent (its pipe closes) and reap it."""
        self.conn.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
