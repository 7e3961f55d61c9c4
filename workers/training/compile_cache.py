"""Where ``train.compile``'s compiled graphs are kept on a node: this user's private directory.

Why not torch's default: inductor keeps its caches (generated C++/Triton source, shared libraries it
loads, pickled graphs) in ``<tmp>/torchinductor_<user>``, a name any other account on the node can
create first, with open permissions or links inside, and whatever it plants there is loaded and run
by the next training process. syncpoint makes the directory itself (0700, this user's, checked on
its descriptor, never through a link) and points inductor and Triton at it, so a restart on the node
reads the compiled graphs back (seconds) instead of compiling from nothing (tens of seconds on two
cores, minutes for a large model), and nothing another account wrote is ever loaded. A directory the
user named (``TORCHINDUCTOR_CACHE_DIR`` set in the job's environment) is theirs and used as it is.

Why by hand: torch offers the variable, not a check of what is behind it.
"""

from __future__ import annotations

import os
import stat
import tempfile

from syncpoint.policies.contracts.errors import JobConfigError

INDUCTOR = "TORCHINDUCTOR_CACHE_DIR"
TRITON = "TRITON_CACHE_DIR"


def private_compile_cache(environ: dict[str, str] | None = None) -> str:
    """Point inductor (and Triton, under it) at this user's private compile cache on the node, made
    0700 if absent; returns the directory. Refuses (``JobConfigError``, with the fix) one that is a
    link, another account's, or open to others: compiled code from there would run in this job."""
    env = os.environ if environ is None else environ
    given = env.get(INDUCTOR)
    if given:
        env.setdefault(TRITON, os.path.join(given, "triton"))
        return given
    path = os.path.join(tempfile.gettempdir(), f"syncpoint-compile-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # a link (ELOOP) or not a directory (ENOTDIR)
        raise _refused(path, "a link or not a directory") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISDIR(st.st_mode):
        raise _refused(path, f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}")
    env[INDUCTOR] = path
    env[TRITON] = os.path.join(path, "triton")
    return path


def _refused(path: str, what: str) -> JobConfigError:
    return JobConfigError(
        f"train.compile: the compile cache {path} is not a private directory of this user ({what}): compiled "
        f"code another account put there would run in this job. Remove it (syncpoint makes it again, 0700), or "
        f"set {INDUCTOR} in scaling.env to a directory of your own"
    )
