"""A warm training-process server for each node and submission (a zygote) that outlives worker groups.

Why: every new Ray Train worker group (a restart Ray Train does, a lost node's replacement) started a
fresh fork server in each worker, which imported torch and DeepSpeed again: 11.6 s of a 19.6 s
restart here (measured, P8's notice restart). Python's ``multiprocessing`` fork server already does
the forking, the pid and exit-code bookkeeping and the passing of pipes; what it lacks is a life of
its own (it ends with the process that started it, which Ray Train kills with the worker group).
So a *keeper* process, detached from the worker, starts one and holds it; supervisors (and the
driver, to warm the nodes that hold no rank yet) find it by a key on this node.

The keeper lives while someone holds it (a supervisor keeps a connection open for its whole life)
and for ``idle_s`` after the last one let go or the driver last warmed it; the driver stops it when
the job ends. A child forked from it cannot count on dying with the server, so it watches its
supervisor instead (``multiprocessing.parent_process``). Files live in a private directory of
this user (0700, checked, never through a link); anything unexpected there means "no warm server",
and the supervisor forks from one of its own, as before.

Protocol on the control socket: one line from the client (``hold``, ``touch`` or ``stop``), one JSON
line back (``{"address": <fork server socket>, "pid": <its pid>}``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing import context, forkserver, popen_forkserver, process, reduction, resource_tracker, spawn, util
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from syncpoint.policies.contracts.spec import JobSpec

# What a fork server imports once, so that each rank it forks starts with torch and DeepSpeed loaded.
PRELOAD = [
    "syncpoint.workers.training.deepspeed_import",  # first: DeepSpeed's import then skips MLflow
    "torch",
    "deepspeed",
    "syncpoint.workers.training.loop",
    "syncpoint.workers.supervision.launch",
    "syncpoint.workers.supervision.warm_ops",
]
# In a server's environment: the job compiles its model (``train.compile``), so the server also does
# what a compiled first step does once per process (``warm_ops.warm_compile``).
WARM_COMPILE_ENV = "SYNCPOINT_WARM_COMPILE"
IDLE_S = 180.0  # a keeper nobody holds or warms for this long ends (the driver warms every WARM_EVERY_S)
WARM_EVERY_S = 60.0
START_WAIT_S = 20.0  # a keeper's control socket appears within this (it imports nothing heavy)
STOP_WAIT_S = 10.0  # a stopped keeper removes its socket within this (milliseconds when the machine is idle)
LINE_LIMIT = 4096  # a request or an answer is one short line; anything longer is not ours


class Unavailable(RuntimeError):
    """No warm server here (a directory that is not ours, a keeper that did not start): fork from your own."""


@dataclass(frozen=True)
class Server:
    """A keeper's fork server, as its control socket describes it."""

    address: str  # the fork server's own listening socket
    pid: int
    started_here: bool = False  # this call started the keeper (a cold server: the imports are still ahead)


def server_env(spec: JobSpec) -> dict[str, str]:
    """What a job's warm server adds to its environment: the compile warm-up for a compiled model. Every
    starter of a submission's server passes it (whichever starts it first decides its imports)."""
    return {WARM_COMPILE_ENV: "1"} if spec.train.compile else {}


def key(submission_id: str, hash_seed: str) -> str:
    """One server per (user, submission, hash seed, interpreter): everything a forked rank keeps from it."""
    raw = "|".join((str(os.getuid()), submission_id, hash_seed, sys.executable))
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def base_dir() -> str:
    """This user's private directory of keepers' sockets, created 0700; refuses one that is not that."""
    path = os.path.join(tempfile.gettempdir(), f"syncpoint-warm-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise Unavailable(f"{path} is not a private directory of this user (a link, another owner, or open mode)")
    return path


SOCKET_PATH_LIMIT = 107  # bytes of a Unix socket's path (sun_path, less its NUL)


def _network_namespace() -> str:
    """This process's network namespace, as a suffix of its keeper's paths ("" where Linux has none).

    Why: a forked process lives in its fork server's network namespace. Ray nodes of one host in
    namespaces of their own (tests/netns.py's private network) share the temp dir, so without this
    they shared one keeper, and rank 0's store agent, forked in another node's namespace, could not
    bind its node's address (EADDRNOTAVAIL: the worker group failed to start until the keeper happened
    to be started on rank 0's node)."""
    try:
        return f"-n{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


def _socket_path(k: str) -> str:
    path = os.path.join(base_dir(), f"{k}{_network_namespace()}.sock")
    if len(path.encode()) > SOCKET_PATH_LIMIT:
        raise Unavailable(f"the temp dir's path is too long for a Unix socket ({path}); a shorter TMPDIR fixes it")
    return path


def _lock_path(k: str) -> str:
    return os.path.join(base_dir(), f"{k}{_network_namespace()}.lock")


def _ask(k: str, word: str, timeout_s: float = 5.0) -> tuple[socket.socket, Server]:
    """Send ``word`` to the keeper of ``k``; the open connection and its answer (raises OSError/Unavailable)."""
    path = _socket_path(k)
    st = os.lstat(path)  # FileNotFoundError when there is no keeper
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        raise Unavailable(f"{path} is not a keeper's socket of this user")
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        _check_peer(sock)
        sock.sendall(word.encode() + b"\n")
        line = _read_line(sock)
        data = json.loads(line)
        server = Server(address=str(data["address"]), pid=int(data["pid"]))
        sock.settimeout(None)
        return sock, server
    except BaseException:
        sock.close()
        raise


def _check_peer(sock: socket.socket) -> None:
    """The process at the other end runs as this user (SO_PEERCRED): a keeper of ours, not anyone's."""
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise Unavailable(f"the keeper's socket is served by uid {uid}, not this user's")


def _read_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(LINE_LIMIT - len(buf))
        if not chunk:
            raise Unavailable("the keeper closed the connection without an answer")
        buf += chunk
        if len(buf) >= LINE_LIMIT and not buf.endswith(b"\n"):
            raise Unavailable("the keeper's answer is too long")
    return buf


def ensure(
    k: str, hash_seed: str, word: str = "touch", env: dict[str, str] | None = None
) -> tuple[socket.socket, Server]:
    """Find this node's keeper of ``k`` or start it (one starter at a time: a lock file); ``word`` is
    ``touch`` (warm it, connection closed) or ``hold`` (the connection keeps it alive); ``env``: what
    a started server's environment adds to this process's (it imports torch and DeepSpeed with it)."""
    with contextlib.suppress(OSError, ValueError, KeyError, Unavailable):
        return _ask(k, word)
    fd = os.open(_lock_path(k), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError, KeyError, Unavailable):
            return _ask(k, word)  # another starter won the lock and started it meanwhile
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(_socket_path(k)).st_mode):
                raise Unavailable(f"{_socket_path(k)} is there and is not a socket: not a keeper's")
        _start_keeper(k, hash_seed, env or {})
        deadline = time.monotonic() + START_WAIT_S
        while True:
            try:
                sock, server = _ask(k, word)
                return sock, Server(server.address, server.pid, started_here=True)
            except (OSError, ValueError, KeyError) as e:
                if time.monotonic() > deadline:
                    raise Unavailable(f"the warm server did not start within {START_WAIT_S:.0f} s ({e})") from e
                time.sleep(0.05)
    finally:
        os.close(fd)


class KeeperConfig(TypedDict):
    """What a keeper reads from its stdin, one JSON line: where its socket and lock lie, the starter's
    import path, what its server preloads, how long it waits unheld."""

    socket: str
    lock: str
    sys_path: list[str]
    preload: list[str]
    idle_s: float


def _start_keeper(k: str, hash_seed: str, env: dict[str, str]) -> None:
    config: KeeperConfig = {
        "socket": _socket_path(k),
        "lock": _lock_path(k),
        "sys_path": list(sys.path),
        "preload": PRELOAD,
        "idle_s": IDLE_S,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncpoint.workers.supervision.zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, **env, "PYTHONHASHSEED": hash_seed},
        start_new_session=True,  # a signal to the starter's process group spares it
        close_fds=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(config).encode() + b"\n")
    proc.stdin.close()
    proc.wait(timeout=START_WAIT_S)  # the keeper forks away from it at once (see main)


def answers(k: str) -> bool:
    """Whether this node's keeper of ``k`` runs (asked, which also counts as a use: it stays warm)."""
    try:
        sock, _ = _ask(k, "touch")
    except (OSError, ValueError, KeyError, Unavailable):
        return False
    sock.close()
    return True


def stop(k: str, wait_s: float = STOP_WAIT_S) -> bool:
    """Ask this node's keeper of ``k`` to end (its server with it); False when there is none. Returns
    once the keeper removed its socket (at most ``wait_s``): a caller that exits next, a driver whose
    watchdog then ends every process it started, killed a keeper in the middle of its clean-up and
    left its socket and lock file behind (seen in make test, on a loaded machine)."""
    try:
        path = _socket_path(k)
        inode = os.lstat(path).st_ino
        sock, _ = _ask(k, "stop")
    except (OSError, ValueError, KeyError, Unavailable):
        return False
    sock.close()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if os.lstat(path).st_ino != inode:
                break  # a successor's socket: ours is gone
        except FileNotFoundError:
            break
        time.sleep(0.02)
    return True


class Holder:
    """A supervisor's hold on its node's warm server: forks training processes from it."""

    def __init__(self, sock: socket.socket, server: Server) -> None:
        self.sock, self.server = sock, server
        self._alive_r, self._alive_w = os.pipe()  # what a forked child takes for its own fork server's

    def process(self, **kwargs: Any) -> ZygoteProcess:
        proc = ZygoteProcess(**kwargs)
        proc._zygote = (self.server.address, self._alive_w)
        proc._stdio = (_InheritedFd(sys.stdout.fileno()), _InheritedFd(sys.stderr.fileno()))
        return proc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        for fd in (self._alive_r, self._alive_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def hold(k: str, hash_seed: str, env: dict[str, str] | None = None) -> Holder:
    """Hold this node's warm server of ``k`` (started if needed, with ``env`` as for ``ensure``) until
    ``Holder.close`` or this process ends."""
    sock, server = ensure(k, hash_seed, "hold", env)
    return Holder(sock, server)


class ZygoteProcess(process.BaseProcess):
    """A ``multiprocessing`` process forked by a keeper's server (picklable by name, as the child needs).

    The child takes its starter's stdout and stderr (the server's are the first starter's, whose
    worker may be gone, and Ray streams each worker's own), and ends when its starter ends."""

    _start_method = "forkserver"
    _zygote: tuple[str, int] = ("", -1)
    _stdio: tuple[Any, Any] = (None, None)

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _ZygotePopen(process_obj)

    def _bootstrap(self, parent_sentinel: Any = None) -> int:
        for fd, target in zip(self._stdio, (1, 2), strict=True):
            if isinstance(fd, int):
                os.dup2(fd, target)
                os.close(fd)
        if parent_sentinel is not None:
            threading.Thread(target=_end_with_starter, args=(parent_sentinel,), daemon=True).start()
        code: int = super()._bootstrap(parent_sentinel)  # type: ignore[misc]
        return code


def _end_with_starter(sentinel: int) -> None:
    """SIGKILL this process when its starter ends (the pipe's far end closes): the server it was
    forked from outlives the starter, so the kernel's parent-death signal does not fire then."""
    with contextlib.suppress(OSError, ValueError):
        select.select([sentinel], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


class _InheritedFd:
    """An fd that travels to the forked child (``reduction.DupFd`` at pickling time) and arrives as an int."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuilt_fd, (reduction.DupFd(self.fd),))


def _rebuilt_fd(dup: Any) -> int:
    fd: int = dup.detach()
    return fd


class _ZygotePopen(popen_forkserver.Popen):
    """``popen_forkserver.Popen`` against another process's server: only the connection differs
    (the standard one always asks this process's own server, starting it when it has none)."""

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        address, alive_fd = process_obj._zygote
        self.sentinel, w = _connect(address, alive_fd, self._fds)  # type: ignore[attr-defined]
        parent_w = os.dup(w)  # the child's sentinel of this process (it watches it: see the module doc)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def _connect(address: str, alive_fd: int, fds: list[int]) -> tuple[int, int]:
    """``ForkServer.connect_to_new_process`` for the server at ``address``."""
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(address)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            tracker_fd: int = resource_tracker.getfd()  # type: ignore[assignment]
            reduction.sendfds(client, [child_r, child_w, alive_fd, tracker_fd, *fds])
            return parent_r, parent_w
        except BaseException:
            os.close(parent_r)
            os.close(parent_w)
            raise
        finally:
            os.close(child_r)
            os.close(child_w)


# ---------------------------------------------------------------- the keeper
def _serve(config: KeeperConfig) -> None:
    """Start the fork server and hold it until stopped, idle, or the server dies."""
    path = str(config["socket"])
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # a dead keeper's socket (its starter held the lock: no live keeper answered)
    control = socket.socket(socket.AF_UNIX)
    control.bind(path)
    os.chmod(path, 0o600)
    inode = os.lstat(path).st_ino
    control.listen(16)
    sys.path[:] = [str(p) for p in config["sys_path"]]
    forkserver.set_forkserver_preload([str(m) for m in config["preload"]])
    forkserver.ensure_running()
    server: Any = forkserver._forkserver  # its address and pid are private, stable since Python 3.4
    answer = json.dumps({"address": server._forkserver_address, "pid": server._forkserver_pid})
    held: list[socket.socket] = []
    last_seen, idle_s = time.monotonic(), float(config["idle_s"])
    try:
        while _server_alive(server._forkserver_pid):
            ready, _, _ = select.select([control, *held], [], [], 1.0)
            for s in ready:
                if s is control:
                    if _answer(control, answer, held) == "stop":
                        return
                    last_seen = time.monotonic()
                elif not s.recv(LINE_LIMIT):  # a holder ended (closed, or died: the kernel closes it)
                    held.remove(s)
                    s.close()
            if held:
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > idle_s:
                return
    finally:
        _remove_own_files(path, inode, str(config["lock"]))
        # its last step unlinks the server's socket: gone already when the node's temp dir was cleaned
        with contextlib.suppress(OSError):
            server._stop()


def _remove_own_files(path: str, inode: int, lock_path: str) -> None:
    """The keeper's socket and lock file, under the lock (a starter holding it sees both or neither)."""
    with contextlib.suppress(OSError):
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(OSError):
                if os.lstat(path).st_ino == inode:  # still ours: a successor may have bound its own meanwhile
                    os.unlink(path)
            os.unlink(lock_path)
        finally:
            os.close(fd)


def _answer(control: socket.socket, answer: str, held: list[socket.socket]) -> str:
    conn, _ = control.accept()
    conn.settimeout(2.0)
    try:
        word = _read_line(conn).strip().decode()
    except (OSError, Unavailable, UnicodeDecodeError):
        conn.close()
        return ""
    with contextlib.suppress(OSError):
        conn.sendall(answer.encode() + b"\n")
        if word == "hold":
            conn.settimeout(None)
            held.append(conn)
            return word
    conn.close()
    return word


def _server_alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def main() -> int:
    """The keeper: read the config, leave the starter (double fork: a worker's exit kills its own
    children, Ray's ``kill_child_processes_on_worker_exit``), serve."""
    raw = sys.stdin.buffer.readline(LINE_LIMIT * 16)
    if not raw.endswith(b"\n"):
        return 2
    config = json.loads(raw)
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    _serve(config)
    return 0


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
