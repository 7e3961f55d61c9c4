"""The processes a test started, found by a marker in their environment, never by a pid diff.

Why a marker: `ray start` daemonizes (its GCS, raylet and agents are re-parented away from it), so a
test cannot find its cluster as descendants of what it ran, and a machine-wide diff of pids taken
around the start also catches whatever else began meanwhile: on a fresh clone's `make test` that
was the other half's DeepSpeed op build (`ninja`), which the fixture then killed. Every process a
test starts gets ``SYNCPOINT_TEST_OWNER=<unique mark>`` in its environment; everything it starts
in turn (Ray's daemons and workers, their children) inherits it, and nothing else on the machine has
it. ``/proc/<pid>/environ`` is the environment the process was started with, readable for our own
user's processes.
"""

from __future__ import annotations

import uuid

import psutil

MARK = "SYNCPOINT_TEST_OWNER"


def marked_env(env: dict[str, str], mark: str | None = None) -> tuple[dict[str, str], str]:
    """``env`` with a marker (a new one unless given) that every process started with it inherits."""
    mark = mark or f"sp-test-{uuid.uuid4().hex}"
    return {**env, MARK: mark}, mark


def carries(proc: psutil.Process, mark: str) -> bool:
    try:
        return proc.environ().get(MARK) == mark
    except psutil.Error:  # gone, or not ours to read: not ours to kill either
        return False


def marked_processes(mark: str) -> list[psutil.Process]:
    """Every live process started with this mark in its environment."""
    return [p for p in psutil.process_iter() if carries(p, mark)]


def owned(mark: str) -> set[psutil.Process]:
    """What a test started: every process carrying its mark and every descendant of one. A process
    that renames itself (``setproctitle``, as Ray's dashboard modules and workers do) overwrites the
    memory ``/proc/<pid>/environ`` shows, so its own mark can vanish: it is still a descendant."""
    found = set(marked_processes(mark))
    for p in list(found):
        try:
            found.update(p.children(recursive=True))
        except psutil.Error:
            pass
    return found


def not_marked(procs: list[psutil.Process], mark: str) -> list[psutil.Process]:
    """The processes of a kill list the test did not start (live ones only: a zombie has already
    exited, shows no environment, and no signal reaches it)."""
    ours = owned(mark)
    return [p for p in procs if _alive(p) and p not in ours]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_gone(pid: int, timeout: float = 20.0) -> bool:
    """Whether ``pid`` ends (or is a zombie, ended but not reaped) within ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False
