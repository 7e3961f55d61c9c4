"""The supervisors' store, held by a small process that has torch, on a supervisor's behalf.

Why: a supervisor (one per rank, the Ray Train worker with ``failure.in_place``) never trains, and
importing torch was 3.5 s of every Ray Train worker group's start on two cores (measured: a
no-op train function's group started in 4.0-4.4 s without torch against 7.3-8.6 s with it). Its
coordination store must still be torch's ``TCPStore``: the training processes form their process
group on it. So each supervisor starts one agent the way it starts its training processes (forked
from the node's warm server, or from its own), and the agent holds the store, served by rank 0's,
and answers the supervisor's few operations (add, set, get, check) over a pipe. It ends when the
pipe closes, that is when its supervisor ends or drops it.

Who can reach it: a ``TCPStore`` authenticates nobody, and anyone who reaches its port can read and
write any key it can name. So rank 0's store listens on the one address the job's ranks reach it at
(``serve_on``: not every interface), and every key the job uses (the supervisors' marks and each
generation's process group) lies under an unguessable namespace (``new_namespace``: 128 random
bits) that rank 0 hands to the other ranks over the launcher's own channel (Ray Train's broadcast,
or the spawning launcher's arguments): a stranger can neither read, forge nor delete a key of the
job's. What a stranger can still do is flood the port (hundreds of idle connections stop new
clients); that fails the generation as a fault of the node (``StoreFault``), never as the user's.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import threading
from typing import Any

from syncpoint.policies.decisions.failures import NODE_FAULT

OPS = ("add", "set", "get", "check")
# how long a client waits for rank 0's store (its agent may wait for its fork server's imports first)
MIN_TIMEOUT_S = 60.0


_NAMESPACE = re.compile(r"[0-9a-f]{32}")


class AgentError(RuntimeError):
    """The agent could not do an operation, or is gone."""


class StoreFault(AgentError):
    """The supervisors' store failed or did not answer: a fault of the node (its network, a process
    flooding or closing the store), not of the user's code; the failure policy charges it as one."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{NODE_FAULT} ({detail[:1500]}): a fault of the node (its network, or another process flooding or "
            "closing the store), not of your code"
        )


def new_namespace() -> str:
    """The job's secret prefix of every key in the store (rank 0 makes it; the launcher hands it out)."""
    return secrets.token_hex(16)


def valid_address(value: Any) -> tuple[str, int, str] | None:
    """Rank 0's (host, port, namespace) as the launcher's channel carried it, or None if it is not one."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        return None
    host, port, namespace = value
    ok = isinstance(host, str) and isinstance(port, int) and 0 < port < 65536 and isinstance(namespace, str)
    return (host, port, namespace) if ok and _NAMESPACE.fullmatch(namespace) else None


def serve_on(host: str, port: int = 0) -> socket.socket:
    """A listening socket on ``host`` alone (``port`` 0: a free one). Why by hand: ``TCPStore``'s own
    server listens on every interface whatever host it is given; handed this socket, it listens here only."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def open_store(host: str, port: int | None, namespace: str, timeout_s: float, serve: bool = False) -> Any:
    """The store under the job's namespace: served here on ``host`` alone (``serve``, or ``port``
    None: on a free port) or joined at ``host:port``. A store that does not answer is a ``StoreFault``."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if serve or port is None:
        sock = serve_on(host, port or 0)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host, port, None, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
        sock.detach()  # the store's server owns the descriptor now
    else:
        try:
            store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
        except (RuntimeError, OSError) as e:  # DistNetworkError, DistStoreError
            raise StoreFault(f"{host}:{port} did not answer: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    return store if not namespace else dist.PrefixStore(namespace, store)


def serve(conn: Any, host: str, port: int | None, timeout_s: float, namespace: str) -> None:
    """The agent's body: serve a ``TCPStore`` on ``host`` (``port`` None: this is rank 0's, on a free
    port, sent first) or join the one at ``host:port``, then answer until the pipe closes."""
    from syncpoint.workers.supervision.fork_context import die_with_parent

    die_with_parent()
    try:
        store = open_store(host, port, namespace, max(MIN_TIMEOUT_S, timeout_s))
        reply: tuple[str, Any] = ("ok", _server_port(store))
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


def _server_port(store: Any) -> int:
    """The port of the ``TCPStore`` under a ``PrefixStore`` (rank 0's, the one it serves)."""
    return int(store.underlying_store.port if hasattr(store, "underlying_store") else store.port)


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
            raise StoreFault(f"its store agent ended, {self._exit()}") from e
        if status != "ok":
            raise StoreFault(str(value))
        return value

    def _exit(self) -> str:
        self.proc.join(5)
        return f"exit code {self.proc.exitcode}"

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            try:
                self.conn.send((op, args))
            except OSError as e:
                raise StoreFault(f"its store agent ended, {self._exit()}") from e
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
