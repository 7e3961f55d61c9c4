"""This node's copy of the newest committed state, in host shared memory, so a restart restores it
without reading the object store.

Why: restoring a state from S3 costs a download of every file (seconds per GB) on every restart,
although the node that wrote the state still holds its bytes; a restart after a crash of the
training process (the node survives, as most failures leave it) can read them from memory instead,
as DLRover's flash checkpoint does. Each rank writes its own files twice while it saves: to
storage, as always, and into ``<base>/syncpoint-memory-<uid>/<run>/<state>/`` on its node
(``/dev/shm``: tmpfs, outside the training process, so a crash of the process does not lose it).
After a commit every rank drops the node's older copies, so a node holds at most the newest
committed state (plus a save in progress) per run.

Trust: none of its own. The copy is bytes like any other; the manifest (read from storage by
selection, signature checked) says what each file must be, and the reader verifies every file
against it where it lies, through the same descriptors it then loads
(``syncpoint.workers.integrity.verified_files``), exactly as an in-place local restore. A copy that
is missing a file, stale (another state's) or fails verification is not used: the restore reads
storage and says why. Directories are created 0700, owned by this user, and opened without following
links; files are created exclusively (``nofollow.create_new``).

Lifetime: a finished run removes its copy; the driver of a local run removes it whatever the
outcome (``remove_for``). A copy left by a job that failed on a remote cluster lasts until the node's
next run of the same run directory commits a state, or the node reboots (tmpfs).

When: ``checkpoint.memory_copy`` (``auto``: when storage is not a local filesystem, where the
state already lies on this node and restores in place). Every save writes it; a restore that reads
files by name rather than through the checkpoint engine (another world size, ZeRO-3 module-only
loads, ``resume.reset_optimizer``) reads storage.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator

from syncpoint.policies.contracts.errors import UnsafeEntry
from syncpoint.policies.contracts.state_format import is_state_name
from syncpoint.workers.storage import RunStorage, nofollow
from syncpoint.workers.storage.protocol import CHUNK

MEMORY_DIR_ENV = "SYNCPOINT_MEMORY_DIR"  # where copies live (default /dev/shm); tests point it at a temp dir
DEFAULT_BASE = "/dev/shm"


def base_dir() -> str | None:
    """The node's shared-memory directory, or ``None`` when it has none."""
    base = os.environ.get(MEMORY_DIR_ENV) or DEFAULT_BASE
    return base if os.path.isdir(base) else None


def run_key(run_url: str) -> str:
    """The run directory's name among this node's copies (its URL hashed: no path or secret shown)."""
    return hashlib.sha256(run_url.encode()).hexdigest()[:24]


class MemoryCopy:
    """One run's copies on this node. Every method is safe to call from several ranks of the node at
    once (each writes only its own files; deletions ignore what another rank deleted first)."""

    def __init__(self, base: str, run_url: str) -> None:
        self.base, self.key = base, run_key(run_url)
        self.user_dir = f"syncpoint-memory-{os.getuid()}"
        self.shown = os.path.join(base, self.user_dir, self.key)

    # ---- directories: created 0700, ours, never through a link
    def _user_dir(self, create: bool) -> int:
        """A new descriptor of this user's directory of copies, checked on it: ours and private, else
        ``UnsafeEntry`` (never entered: another account's directory holds nothing of ours)."""
        top = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return nofollow.open_private(top, self.user_dir, f"{self.base}/{self.user_dir}", create=create)
        finally:
            os.close(top)

    @contextlib.contextmanager
    def _run_dir(self, create: bool) -> Iterator[int]:
        try:
            user = self._user_dir(create)
        except UnsafeEntry as e:
            raise UnsafeEntry(f"{e}: no memory copy") from None
        try:
            run = nofollow.open_dirs(user, [self.key], create=create, shown=[self.base, self.user_dir])
        finally:
            os.close(user)
        try:
            yield run
        finally:
            os.close(run)

    def _state_dir(self, name: str, create: bool) -> int:
        """A new descriptor of this run's copy of state ``name``."""
        if not is_state_name(name):
            raise ValueError(f"{name!r} is not a state name")
        with self._run_dir(create) as run:
            return nofollow.open_dirs(run, [name], create=create, shown=[self.shown])

    # ---- writing (every rank, while it saves)
    @contextlib.contextmanager
    def file(self, name: str, rel: str) -> Iterator[int]:
        """A new file ``<name>/<rel>`` opened for writing (its directories made as needed)."""
        state = self._state_dir(name, create=True)
        try:
            *dirs, leaf = rel.split("/")
            parent = nofollow.open_dirs(state, dirs, create=True, shown=[self.shown, name])
            try:
                fd = nofollow.create_new(parent, leaf, f"{self.shown}/{name}/{rel}")
            finally:
                os.close(parent)
        finally:
            os.close(state)
        try:
            yield fd
        finally:
            os.close(fd)

    def write_bytes(self, name: str, rel: str, data: bytes) -> None:
        """The copy of a file whose bytes are in memory."""
        with self.file(name, rel) as fd:
            nofollow.write_all(fd, data)

    def copy_file(self, name: str, rel: str, path: str) -> None:
        """The copy of a local file (a save's staged file, as it was uploaded)."""
        with self.file(name, rel) as fd, open(path, "rb") as src:
            while chunk := src.read(CHUNK):
                nofollow.write_all(fd, chunk)

    def discard(self, name: str, rel: str) -> None:
        """Remove one file's copy (its write failed): the restore then reads that file from storage."""
        with contextlib.suppress(OSError, ValueError, UnsafeEntry):
            state = self._state_dir(name, create=False)
            try:
                *dirs, leaf = rel.split("/")
                parent = nofollow.open_dirs(state, dirs, shown=[self.shown, name])
                try:
                    os.unlink(leaf, dir_fd=parent)
                finally:
                    os.close(parent)
            finally:
                os.close(state)

    # ---- reading (a restore)
    def open_state(self, name: str) -> int | None:
        """A descriptor of the copy of state ``name`` (the caller closes it), ``None`` when this node
        holds none."""
        try:
            return self._state_dir(name, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def path_of(self, name: str) -> str:
        return os.path.join(self.shown, name)

    # ---- lifetime
    def keep_only(self, newest: str) -> None:
        """Drop every copy older than ``newest`` (just committed); newer ones (a save in progress) stay."""
        with contextlib.suppress(OSError, UnsafeEntry):  # best effort: a copy is never worth a failed save
            with self._run_dir(create=False) as run:
                for entry in os.listdir(run):
                    if is_state_name(entry) and entry < newest:
                        with contextlib.suppress(OSError, UnsafeEntry):
                            nofollow.delete_tree(run, entry, f"{self.shown}/{entry}")

    def remove(self) -> None:
        """Remove this run's copies on this node (the run is over). A directory that is not this
        user's private one is neither entered nor removed (said once on stderr)."""
        try:
            user = self._user_dir(create=False)
        except UnsafeEntry as e:
            nofollow.warn(f"{e}; nothing removed there")
            return
        except OSError:
            return
        try:
            with contextlib.suppress(OSError, UnsafeEntry):
                nofollow.delete_tree(user, self.key, self.shown)
        finally:
            os.close(user)


def keeps_copies(setting: bool | str, storage: RunStorage) -> bool:
    """Whether a run keeps memory copies (``checkpoint.memory_copy``: false never; ``auto`` not
    where the states already live on the node: a local filesystem or ``memory://``)."""
    node_local = storage.local_path() is not None or storage.url.startswith("memory://")
    return setting is not False and not (setting == "auto" and node_local)


def memory_copy_for(setting: bool | str, storage: RunStorage) -> MemoryCopy | None:
    """The run's memory copy on this node, or ``None`` (:func:`keeps_copies` says no, or this node
    has no shared-memory directory)."""
    if not keeps_copies(setting, storage):
        return None
    base = base_dir()
    return MemoryCopy(base, storage.url) if base is not None else None


def remove_for(run_url: str) -> None:
    """Remove a run's copies on this node, if any (the driver, when a local run ends)."""
    base = base_dir()
    if base is not None:
        MemoryCopy(base, run_url).remove()
