"""Whether a lease's holder is provably dead: the same kernel and pid namespace as this process, and
its process gone (or its pid now another process's).

Why: a driver killed outright (SIGKILL, a closed laptop's shell) leaves its lease young, and a rerun
on the same machine waited out the whole TTL for a holder that could never renew it. Proof needs
more than a host name (containers on other machines share names) or a pid (pids are reused): the
holder records the kernel's boot id, its pid namespace, its pid and that process's start time, and
only a reader in that same boot and namespace, finding no process with that pid and start time,
calls it dead. Anything else (another host, another container, a record without these fields, a
``/proc`` that cannot be read) proves nothing, and the lease is waited for as before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypedDict

FIELDS = ("boot_id", "pid_ns", "pid", "pid_start", "uid")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _boot_id() -> str | None:
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return f.read(64).strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field), or
    None if there is no such process. Parsed after the command's closing parenthesis: a command name
    may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(4096)
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


class HolderProcess(TypedDict, total=False):
    """What proves a lease's holder dead to a successor on its host (all or nothing)."""

    boot_id: str
    pid_ns: str
    pid: int
    pid_start: int
    uid: int


def this_process() -> HolderProcess:
    """This process's fields for its lease record (an empty dict where ``/proc`` cannot tell)."""
    boot, namespace = _boot_id(), _pid_namespace()
    try:
        start = _start_ticks(os.getpid())
    except (OSError, ValueError, IndexError):
        start = None
    if boot is None or namespace is None or start is None:
        return {}
    return {"boot_id": boot, "pid_ns": namespace, "pid": os.getpid(), "pid_start": start, "uid": os.getuid()}


def provably_dead(record: Mapping[str, object]) -> bool:
    """The holder named by ``record`` ran as this user in this process's kernel boot and pid namespace,
    and no process with its pid and start time exists now. (As this user: ``/proc`` mounted with
    ``hidepid`` shows another user's processes as absent.)"""
    pid, start = record.get("pid"), record.get("pid_start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not isinstance(start, int):
        return False
    if record.get("uid") != os.getuid():
        return False
    boot, namespace = _boot_id(), _pid_namespace()
    if boot is None or namespace is None or record.get("boot_id") != boot or record.get("pid_ns") != namespace:
        return False
    try:
        now = _start_ticks(pid)
    except (OSError, ValueError, IndexError):
        return False  # a process is there and unreadable: alive as far as anyone can tell
    return now is None or now != start
