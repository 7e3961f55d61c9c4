"""Local files below a trusted directory: reached without following a link, read only when regular, bounded.

Why: whoever can write the run directory can plant a symbolic link (``final/model.safetensors`` pointing at
an executable script: the export would overwrite it), a FIFO (``manifest.json``: a read that never returns)
or a link to ``/dev/zero`` (a read that never ends). So, on local storage:

* the anchor (the run directory, named by the user: it and its ancestors are the user's choice) is opened
  by its path; every component below it is opened relative to its parent's descriptor with ``O_NOFOLLOW``,
  so a link anywhere below is never followed, not even one swapped in between a check and a use;
* a read opens the file ``O_NONBLOCK`` (a FIFO cannot block the open), accepts only a regular file
  (``fstat`` of that very descriptor) and reads at most its bound plus one byte, refusing a larger file;
* a write never opens an existing name: a whole file is written under a fresh name created with
  ``O_EXCL|O_NOFOLLOW`` and renamed over the final one (a rename replaces a planted link, never its
  target); a write-once file (a shard) unlinks whatever is at its name (``unlink`` never follows) and is
  created exclusively; a link where a directory belongs is unlinked (never its target) and a real
  directory made in its place. Each replacement prints one WARNING line naming what was replaced.

Refusals raise ``syncpoint.policies.contracts.errors.UnsafeEntry`` (``OversizedEntry`` for a bound), naming the entry
by its
path below the anchor. Linux semantics (``O_NOFOLLOW``, ``dir_fd``); the storage layer uses this only for
local filesystems, which are the only stores with links.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import sys
import threading
from collections.abc import Iterator, Sequence

from syncpoint.policies.contracts.errors import OversizedEntry, UnsafeEntry

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
READ_CHUNK = 1 << 30  # one read(2) returns at most ~2 GiB on Linux
MAX_DEPTH = 32  # a listing goes no deeper (a state is 2 levels deep; a planted tree can be any depth)
TRIES = 4  # a directory that other ranks create or replace at the same time is looked at again
NEVER = "syncpoint never reads or writes through links and reads only regular files"


def what(mode: int) -> str:
    """What an ``lstat`` mode is, in words for a message."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def kind_at(dir_fd: int | None, name: str) -> str | None:
    """What the entry ``name`` is, never following it (``None``: there is none)."""
    try:
        return what(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return None


def warn(message: str) -> None:
    """A one-line warning on stderr (a planted entry replaced, never followed)."""
    print(f"[syncpoint] WARNING: {message}", file=sys.stderr, flush=True)


def _missing(shown: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), shown)


class Tree:
    """A directory trusted by its path (the anchor) and everything below it, reached without links.

    Paths come from the storage layer (``<anchor>/a/b``); each is split into components below the
    anchor, none of which may be empty, ``.`` or ``..``."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"

    def parts(self, path: str) -> list[str]:
        if path.rstrip("/") == self.root:
            return []
        prefix = self.root if self.root.endswith("/") else self.root + "/"
        if not path.startswith(prefix):
            raise ValueError(f"{path} does not lie below {self.root}")
        rel = path[len(prefix) :]
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise UnsafeEntry(f"{rel}: an empty, '.' or '..' component would leave or repeat a directory: refused")
        return parts

    def open_root(self, *, create: bool = False) -> int:
        """The anchor itself, followed as the user named it (created for a write)."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    @contextlib.contextmanager
    def directory(self, parts: Sequence[str], *, create: bool = False) -> Iterator[int]:
        """The directory ``parts`` below the anchor, open for the block (created for a write)."""
        root = self.open_root(create=create)
        try:
            fd = open_dirs(root, parts, create=create)
        finally:
            os.close(root)
        try:
            yield fd
        finally:
            os.close(fd)


def open_dirs(top: int, parts: Sequence[str], *, create: bool = False, shown: Sequence[str] = ()) -> int:
    """A new descriptor of ``top/parts...``, each component opened relative to the one before with
    ``O_NOFOLLOW``; ``create``: missing ones are made and a planted link is replaced (a WARNING), else a
    link is refused (``UnsafeEntry``). ``shown``: the components above ``top`` for messages."""
    fd = os.dup(top)
    try:
        for i, name in enumerate(parts):
            nxt = _open_dir(fd, name, "/".join([*shown, *parts[: i + 1]]), create)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_dir(parent: int, name: str, shown: str, create: bool) -> int:
    for _ in range(TRIES):
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise _missing(shown) from None
            with contextlib.suppress(FileExistsError):  # another rank made it first
                os.mkdir(name, dir_fd=parent)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            kind = kind_at(parent, name)
            if kind in (None, "a directory"):
                continue  # changed since the open: look again
            if kind == "a regular file":  # not hostile, just no directory (a plain file named as one)
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), shown) from None
            if not (create and kind == "a symbolic link"):
                raise UnsafeEntry(f"{shown} is {kind}, not a directory: never followed ({NEVER})") from None
            replace_planted(parent, name, shown, kind, "a real directory")
    raise UnsafeEntry(f"{shown} kept changing while it was being opened (replaced again and again): refused")


def replace_planted(parent: int | None, name: str, shown: str, kind: str, by: str) -> None:
    """Unlink a planted entry (a link itself, never its target) and say so; someone else may have
    replaced it first (then nothing is said)."""
    try:
        os.unlink(name, dir_fd=parent)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return
    warn(f"{shown} was {kind}; replaced by {by} (syncpoint never writes through a link: its target was not touched)")


# ---------------------------------------------------------------- reads


def open_regular(dir_fd: int | None, name: str, shown: str) -> int:
    """``name`` opened for reading without following it and without blocking (a FIFO), refused
    (``UnsafeEntry``) unless it is a regular file."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _missing(shown) from None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP, errno.ENODEV):
            raise
        raise UnsafeEntry(_not_regular(shown, kind_at(dir_fd, name) or "not a regular file")) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeEntry(_not_regular(shown, what(mode)))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(shown: str, kind: str) -> str:
    return f"{shown} is {kind}, not a regular file: never read ({NEVER})"


def read_fd(fd: int, limit: int, shown: str) -> bytes:
    """At most ``limit`` bytes of an open regular file from its current offset; ``OversizedEntry``
    when it holds more (one byte past the bound is read to tell)."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise OversizedEntry(f"{shown} is {size} bytes, more than the {limit} it can hold: not read")
    chunks, total = [], 0
    while total <= limit:
        chunk = os.read(fd, min(limit + 1 - total, READ_CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > limit:
        raise OversizedEntry(f"{shown} grew past the {limit} bytes it can hold while being read: not read")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_file(dir_fd: int, name: str, limit: int, shown: str) -> bytes:
    """A regular file's bytes below a directory descriptor, never through a link, at most ``limit``."""
    fd = open_regular(dir_fd, name, shown)
    try:
        return read_fd(fd, limit, shown)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- writes


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte to ``fd`` (``os.write`` may write less than it was given)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def write_replacing(
    dir_fd: int, name: str, data: bytes, shown: str, *, sync_dir: bool = False, mode: int = 0o644
) -> None:
    """Write a whole file durably under a fresh exclusive name, then rename it over ``name``: readers
    see all of it or none, and a planted link at ``name`` is replaced, never written through."""
    tmp = f".{name[:120]}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, NEW_FLAGS, mode, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        kind = kind_at(dir_fd, name)
        if kind == "a directory":
            raise UnsafeEntry(f"{shown} is a directory where a file belongs: not replaced")
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if kind not in (None, "a regular file"):
        warn(
            f"{shown} was {kind}; replaced by a regular file (syncpoint never writes through a link: its "
            "target was not touched)"
        )
    if sync_dir:
        os.fsync(dir_fd)


def create_new(dir_fd: int | None, name: str, shown: str, *, mode: int = 0o644) -> int:
    """A write-once file: whatever entry is at ``name`` is unlinked (never followed) and the file is
    created exclusively, so no link, FIFO or other process's file is ever opened for writing."""
    kind = kind_at(dir_fd, name)
    if kind == "a directory":
        raise UnsafeEntry(f"{shown} is a directory where a file belongs: not replaced")
    if kind == "a regular file":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
    elif kind is not None:
        replace_planted(dir_fd, name, shown, kind, "a regular file")
    try:
        return os.open(name, NEW_FLAGS, mode, dir_fd=dir_fd)
    except FileExistsError:
        raise UnsafeEntry(f"{shown} was created by someone else while syncpoint was writing it: refused") from None


def open_lock(dir_fd: int, name: str, shown: str, *, mode: int = 0o644, append: bool = False) -> int:
    """A lock file opened read-write (created if missing) without following it; a planted link, FIFO
    or socket is replaced by a regular file (a lock file holds nothing). ``append``: a log that is
    only appended to (one line per write, whoever else appends), which holds nothing worth a link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    for _ in range(TRIES):
        try:
            fd = os.open(name, flags, mode, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.EISDIR:
                raise UnsafeEntry(f"{shown} is a directory where a lock file belongs: remove it") from None
            if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP, errno.ENODEV):
                raise
            replace_planted(dir_fd, name, shown, kind_at(dir_fd, name) or "not a regular file", "a regular file")
            continue
        kind = os.fstat(fd).st_mode
        if stat.S_ISREG(kind):
            return fd
        os.close(fd)
        replace_planted(dir_fd, name, shown, what(kind), "a regular file")
    raise UnsafeEntry(f"{shown} kept being replaced by something that is not a regular file: refused")


def open_private(parent: int, name: str, shown: str, *, create: bool) -> int:
    """This user's private directory ``name`` below ``parent`` (made 0700 when missing and ``create``),
    opened without following a link and checked on that very descriptor: owned by this user, with no
    group or other permission bit. One of this user's that others could only read (an older syncpoint
    made its caches 755) is closed to 700 through the descriptor; anything else (another account's
    directory, one others can write, a link) is refused (``UnsafeEntry``) and never entered."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
    fd = _open_dir(parent, name, shown, create=False)
    st = os.fstat(fd)
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 and not stat.S_IMODE(st.st_mode) & 0o022:
        # ours, and nobody else could ever write into it (an older syncpoint's 755): closed, not refused
        os.fchmod(fd, 0o700)
        st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise UnsafeEntry(
            f"{shown} is not this user's private directory (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}; syncpoint keeps its node-local files only in a directory of mode 700 "
            f"owned by uid {os.getuid()})"
        )
    return fd


# ---------------------------------------------------------------- listings and deletion


def scan(dir_fd: int) -> dict[str, str]:
    """Each entry of an open directory as ``dir``, ``file``, ``link`` or ``other``, none followed."""
    out: dict[str, str] = {}
    with os.scandir(dir_fd) as it:
        for e in it:
            out[e.name] = (
                "link"
                if e.is_symlink()
                else "dir"
                if e.is_dir(follow_symlinks=False)
                else "file"
                if e.is_file(follow_symlinks=False)
                else "other"
            )
    return out


def walk_files(dir_fd: int, prefix: str = "", depth: int = 0) -> tuple[dict[str, int], dict[str, str]]:
    """Every regular file below an open directory (relative path -> size) and every other entry that
    is not a directory (relative path -> what it is): links are reported, never followed."""
    files: dict[str, int] = {}
    unsafe: dict[str, str] = {}
    with os.scandir(dir_fd) as it:
        for e in it:
            rel = prefix + e.name
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while listed
            if stat.S_ISREG(st.st_mode):
                files[rel] = st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                unsafe[rel] = what(st.st_mode)
            elif depth >= MAX_DEPTH:
                unsafe[rel] = f"a directory nested deeper than {MAX_DEPTH} levels (not listed)"
            else:
                try:
                    sub = os.open(e.name, DIR_FLAGS, dir_fd=dir_fd)
                except OSError:
                    unsafe[rel] = "a directory that changed while it was listed"
                    continue
                try:
                    more, bad = walk_files(sub, rel + "/", depth + 1)
                finally:
                    os.close(sub)
                files.update(more)
                unsafe.update(bad)
    return files, unsafe


def delete_tree(dir_fd: int, name: str, shown: str) -> None:
    """Delete ``name`` and everything below it, never through a link (``shutil.rmtree`` relative to
    the parent's descriptor, which opens each directory it descends into without following links)."""
    kind = kind_at(dir_fd, name)
    if kind is None:
        return
    if kind == "a symbolic link":
        raise UnsafeEntry(f"refusing to delete through a symbolic link: {shown}")
    if kind == "a directory":
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
