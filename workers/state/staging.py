"""Where a save stages what it writes before its upload, and the removal of what a killed rank left there.

Why by hand: ``tempfile.mkdtemp`` names a directory but cannot say whose it is once its process is
gone; a staging name here carries its owner (pid namespace and pid), so a later attempt on the node
can tell a dead rank's leftovers from a live save's, as no library does for tmpfs.
"""

from __future__ import annotations

import os
import stat
import tempfile

from syncpoint.policies.contracts.errors import UnsafeEntry
from syncpoint.workers.storage import nofollow


def staging_root() -> str | None:
    """Where snapshots are staged: ``SYNCPOINT_STAGING_DIR``, else /dev/shm (host memory) when it
    has room, else the system temp directory."""
    env = os.environ.get("SYNCPOINT_STAGING_DIR")
    if env:
        return env
    try:
        st = os.statvfs("/dev/shm")
        if os.access("/dev/shm", os.W_OK) and st.f_bavail * st.f_frsize > 2 << 30:
            return "/dev/shm"
    except OSError:
        pass
    return None


STAGING = "syncpoint-save-"  # a snapshot's staging directory: STAGING + its process's owner tag + "-" + random


def _owner() -> str:
    """This process as staging names carry it: its pid namespace (a pid means nothing outside it) and pid."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{namespace}.{os.getpid()}"


def staging_prefix() -> str:
    """The name a new staging directory starts with: it says which process owns it."""
    return f"{STAGING}{_owner()}-"


def sweep_stale_staging(root: str | None = None) -> list[str]:
    """Remove the staging directories of this user's processes that died in a save: a rank killed
    mid-save (SIGKILL, an OOM kill) runs no clean-up, and in /dev/shm its staging (elastic ZeRO's
    gathered optimizer state, a state's size) would hold memory until the node reboots. Every attempt
    sweeps once, at its start. Only a directory named by a process of this pid namespace that no longer
    exists, owned by this user and entered without following a link, is removed; names without an
    owner (an older syncpoint's) and anything else are left alone. Returns the names removed."""
    roots = [root] if root else sorted({os.environ.get("SYNCPOINT_STAGING_DIR") or "/dev/shm", tempfile.gettempdir()})
    return [name for r in roots for name in _sweep(r)]


def _sweep(root: str) -> list[str]:
    namespace = _owner().split(".")[0]
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        owner = name[len(STAGING) :].split("-", 1)[0] if name.startswith(STAGING) else ""
        ns, _, pid = owner.partition(".")
        if ns != namespace or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            st = os.lstat(os.path.join(root, name))
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                nofollow.delete_tree(fd, name, os.path.join(root, name))
            finally:
                os.close(fd)
            removed.append(name)
        except (OSError, UnsafeEntry):
            continue  # another rank of the job removed it first, or it is not ours to remove
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
