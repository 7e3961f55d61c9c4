"""Nothing a driver started outlives it, however it ends (SIGKILL included).

Why a watchdog process: an embedded Ray's processes, a node's warm server and its fork server, the
store agents and reapers are started by the driver, by Ray's raylet or by each other; some re-parent
away (a warm server starts its own session, Ray's agents outlive a killed raylet by a minute), so no
process group or parent-death signal reaches them all. What they share is their environment: the
driver puts ``MARK_ENV=<a new id>`` into its own before it starts anything, and everything started from
it inherits the mark. This process (stdlib only, started by ``ensure`` in its own session) holds the
read end of a pipe whose write end only the driver holds; when the driver ends, by any means, the pipe
reads EOF, and it ends every process of its user carrying the mark: SIGTERM, then SIGKILL what is still
there ``TERM_WAIT_S`` later. A process that renames itself (``setproctitle``: Ray's workers) may
overwrite the environment ``/proc`` shows, so every ``SCAN_S`` while the driver lives it also notes the
descendants of marked processes (by pid and start time, so a reused pid is never taken for one).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

MARK_ENV = "SYNCPOINT_RUN_MARK"
SCAN_S = 1.0
TERM_WAIT_S = 3.0
KILL_ROUNDS = 5
# How long ``ensure`` waits for the watchdog to say it ignores the signals (a Python start: milliseconds,
# seconds on a starved machine); past it the driver goes on, its watchdog still starting.
READY_WAIT_S = 30.0
READY = b"ignoring signals\n"

_started: subprocess.Popen[bytes] | None = None


def ensure() -> str:
    """Start this driver's watchdog once per process and return the mark every process the driver
    starts from now on inherits (set in this process's environment)."""
    global _started
    mark = os.environ.get(MARK_ENV)
    if _started is not None and _started.poll() is None and mark:
        return mark
    mark = f"sp-run-{uuid.uuid4().hex}"
    os.environ[MARK_ENV] = mark
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}  # the watchdog never ends itself
    _started = subprocess.Popen(
        [sys.executable, "-S", os.path.abspath(__file__), mark, str(os.getpid())],
        stdin=subprocess.PIPE,  # the driver's end: non-inheritable, so only the driver's death closes it
        stdout=subprocess.PIPE,  # one line once it ignores the signals, then nothing
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # a Ctrl-C to the terminal's process group does not end it early
    )
    _wait_until_it_ignores_signals(_started)
    return mark


def _wait_until_it_ignores_signals(watchdog: subprocess.Popen[bytes]) -> None:
    """Return once the watchdog ignores SIGTERM, SIGINT and SIGHUP (it says so), at most ``READY_WAIT_S``.

    Why: a signal sent to the driver's children (`ray job stop`) or to every process (a VM's shutdown)
    while the watchdog's interpreter still started ended it with the default action, before it ignored
    them; the processes it should have ended then outlived the driver (seen beside a busy process).
    Nothing of the job is started before this returns, so no such signal finds it unprotected."""
    assert watchdog.stdout is not None
    fd = watchdog.stdout.fileno()
    try:
        ready, _, _ = select.select([fd], [], [], READY_WAIT_S)
        if ready:
            os.read(fd, len(READY))
    finally:
        watchdog.stdout.close()


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else None  # field 22: start time in clock ticks


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _ours(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _carries(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read()
    except OSError:
        return False


def scan(mark: str, known: dict[int, str]) -> dict[int, str]:
    """Every live process of this user carrying ``mark``, every descendant of one, and every process in
    ``known`` still alive with the same start time: {pid: start time}."""
    needle = f"\0{MARK_ENV}={mark}\0".encode()
    me = os.getpid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    ours = [p for p in pids if _ours(p)]
    found = {p for p in ours if _carries(p, needle)}
    found |= {p for p, start in known.items() if _start_time(p) == start}
    children: dict[int, list[int]] = {}
    for p in ours:
        parent = _parent(p)
        if parent is not None:
            children.setdefault(parent, []).append(p)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child != me:
                found.add(child)
                todo.append(child)
    return {p: s for p in found if (s := _start_time(p)) is not None}


def end_all(mark: str, known: dict[int, str]) -> None:
    """SIGTERM every process of the mark, then SIGKILL whatever is still there."""
    targets = scan(mark, known)
    _signal(targets, signal.SIGTERM)
    deadline = time.monotonic() + TERM_WAIT_S
    while targets and time.monotonic() < deadline:
        time.sleep(0.1)
        targets = {p: s for p, s in targets.items() if _start_time(p) == s and not _zombie(p)}
    for _ in range(KILL_ROUNDS):
        targets = scan(mark, targets)
        targets = {p: s for p, s in targets.items() if not _zombie(p)}
        if not targets:
            return
        _signal(targets, signal.SIGKILL)
        time.sleep(0.2)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"Z"
    except OSError:
        return True


def _signal(targets: dict[int, str], sig: int) -> None:
    for pid, start in targets.items():
        if _start_time(pid) == start:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def watch(mark: str, driver: int) -> None:
    """Until the driver's pipe reads EOF (or this process is no longer its child): note the marked
    processes every ``SCAN_S``; then end them all."""
    known: dict[int, str] = {}
    stdin = sys.stdin.buffer
    while os.getppid() == driver:
        ready, _, _ = select.select([stdin], [], [], SCAN_S)
        if ready and not os.read(stdin.fileno(), 4096):
            break
        known = scan(mark, known)
    end_all(mark, known)


if __name__ == "__main__":
    # what signals the driver signals this too (a VM's shutdown: every process; `ray job stop`: the
    # entrypoint's children; a terminal's Ctrl-C or hang-up): it ends when the driver has, not before
    for ignored in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(ignored, signal.SIG_IGN)
    try:  # the driver waits for this line before it starts anything; then nothing more is written
        os.write(1, READY)
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    watch(sys.argv[1], int(sys.argv[2]))
