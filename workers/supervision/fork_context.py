"""How a rank's processes are started: forked from a preloaded fork server, or spawned.

Why a module of its own (``syncpoint.workers.supervision.launch`` uses it, and so does a supervisor): nothing
here imports torch, so a supervisor, which never trains, starts its training processes without
paying torch's import, seconds of every Ray Train worker group's start.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
from collections.abc import Iterator, Mapping
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.workers.supervision.zygote import PRELOAD


def start_method(spec: JobSpec) -> str:
    """``forkserver`` (ranks forked from one process that already imported torch and DeepSpeed) when
    the ranks run on CPU, ``spawn`` otherwise.

    Why: importing torch and DeepSpeed costs each spawned rank ~3 s of CPU, a large share of every run in the
    equivalence grids (measured here: a 2-rank tiny run 8.9 s spawned vs 5.8 s forked from a
    preloaded server). Only on CPU: DeepSpeed fixes its accelerator when it is imported, so a server
    preloaded for CPU must not fork CUDA ranks; and a fork server imports nothing that touches a GPU.
    """
    if os.environ.get("DS_ACCELERATOR") == "cpu" and not spec.scaling.use_gpu:
        return "forkserver"
    return "spawn"


def context(method: str, hash_seed: str) -> ForkServerContext | SpawnContext:
    """The context to start a rank's processes with: this process's fork server (started with the
    job's hash seed) for ``forkserver`` when it can be, else spawn."""
    if method == "forkserver" and fork_server_with(hash_seed):
        return mp.get_context("forkserver")
    return mp.get_context("spawn")


# The PYTHONHASHSEED this process started its fork server with (None: not started here).
_fork_server_hash_seed: str | None = None

# Fork servers this process started for other hash seeds, kept: (address, alive fd, pid) by seed, oldest first.
_parked: dict[str, tuple[str, int, int]] = {}
KEEP_PARKED = 2


def fork_server_with(hash_seed: str) -> bool:
    """Whether this process's fork server runs with ``PYTHONHASHSEED=hash_seed``, starting it so.

    Why: a forked rank keeps its fork server's hash secret, fixed when the server started, whatever
    its environment says. A server started here for another seed is parked, not stopped (up to
    ``KEEP_PARKED`` of them, the oldest stopped first), and taken back when its seed comes again:
    starting one imports torch and DeepSpeed (~5 s of CPU), and a process that launches runs of
    several seeds in turn (a test worker, a bench's grid) restarted its server at every switch
    (measured: 14 servers started in one `make test`'s half without Ray, 6 would have done). A server
    started elsewhere (or that cannot be stopped) is left alone and the ranks are spawned instead."""
    global _fork_server_hash_seed
    server = forkserver._forkserver
    running = getattr(server, "_forkserver_pid", None) is not None
    if running and _fork_server_hash_seed == hash_seed:
        return True
    if running:
        if _fork_server_hash_seed is None or not hasattr(server, "_stop"):
            return False
        _park(server, _fork_server_hash_seed)
    if not _unpark(server, hash_seed):
        forkserver.set_forkserver_preload(PRELOAD)
        with environ(PYTHONHASHSEED=hash_seed):
            forkserver.ensure_running()
    _fork_server_hash_seed = hash_seed
    return True


def _park(server: Any, hash_seed: str) -> None:
    """Set the running server aside under its seed (the one parked longest stopped past the limit)."""
    with server._lock:
        _parked.pop(hash_seed, None)
        _parked[hash_seed] = (server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid)
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    while len(_parked) > KEEP_PARKED:
        _stop_parked(_parked.pop(next(iter(_parked))))


def _unpark(server: Any, hash_seed: str) -> bool:
    """Make the server parked for this seed the running one again, if it is still alive."""
    parked = _parked.pop(hash_seed, None)
    if parked is None:
        return False
    address, alive_fd, pid = parked
    try:
        ended = os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped by someone else: gone all the same
        ended = True
    if ended:  # it died while parked: its socket and our end go too
        _stop_parked((address, alive_fd, None))
        return False
    with server._lock:
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_fd, pid
    return True


def _stop_parked(parked: tuple[str, int, int | None]) -> None:
    """What ``ForkServer._stop`` does for a parked server: closing our end of its alive pipe ends it."""
    address, alive_fd, pid = parked
    os.close(alive_fd)
    if pid is not None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        os.unlink(address)


def parked_seeds() -> list[str]:
    """The hash seeds of the servers this process keeps parked, oldest first."""
    return list(_parked)


def fork_server_running(hash_seed: str) -> bool:
    """Whether this process has a fork server with ``PYTHONHASHSEED=hash_seed``, running or parked (forking
    from it costs nothing more; starting one imports torch and DeepSpeed first)."""
    running = getattr(forkserver._forkserver, "_forkserver_pid", None) is not None
    return (running and _fork_server_hash_seed == hash_seed) or hash_seed in _parked


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """These environment variables for the block (a started interpreter keeps them), then the ones it had."""
    with environ_kept(*values):
        os.environ.update(values)
        yield


@contextlib.contextmanager
def environ_kept(*names: str) -> Iterator[None]:
    """The block may set these environment variables; after it they are what they were."""
    before = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def adopt_environment(values: Mapping[str, str]) -> None:
    """Make ``values`` this forked process's whole environment, and forget what was read from the old one.

    Why: a process forked from a fork server (this module's, or the node's warm server) starts with
    the server's environment and with what its imports read from it then: fsspec's
    ``FSSPEC_<PROTOCOL>_<KWARG>`` variables (an S3 endpoint, credentials), ``tempfile``'s temp dir
    and multiprocessing's (the server's own ``pymp-*`` dir, which a child only borrows).
    A server outlives the caller that started it, so both may name what is gone: a rank that made a
    temp dir under a removed ``TMPDIR`` failed (``make test``, a server started by an earlier test
    under its own private temp dir); one that kept the old endpoint reached another S3 than its job
    named. A variable the caller dropped (a ``scaling.env`` entry removed between attempts) is gone too.
    """
    import tempfile

    import fsspec.config

    os.environ.clear()
    os.environ.update(values)
    tempfile.tempdir = None  # found again from TMPDIR on first use
    mp.current_process()._config.pop("tempdir", None)  # type: ignore[attr-defined]  # made again, the child's own
    fsspec.config.conf.clear()
    fsspec.config.set_conf_files(fsspec.config.conf_dir, fsspec.config.conf)
    fsspec.config.set_conf_env(fsspec.config.conf)


def die_with_parent() -> None:
    """SIGKILL this process when the process that forked it ends (Linux), so a training process or a
    store agent never outlives its supervisor (its fork server exits with the supervisor)."""
    import ctypes
    import signal

    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
