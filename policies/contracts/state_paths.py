"""Which names a manifest may give its files: normalized relative POSIX paths inside the state.

Why: a manifest is data from storage, and whoever can write storage can write a manifest. Its
file names become local paths when a state is fetched (``join(tmp, rel)``) and object keys when it
is read, so a name like ``engine/../../../x`` or ``/etc/cron.d/x`` would make syncpoint write or
read outside the state. One pure function decides, so classification (``syncpoint.policies.decisions.candidates``)
and fetching (``syncpoint.workers.state.reader``) and ``digest`` apply exactly the same rule. A leaf module:
it imports nothing of the project.
"""

from __future__ import annotations

# The longest name syncpoint itself writes is well under this; anything longer is not ours.
MAX_PATH_CHARS = 512


def path_problem(rel: object) -> str | None:
    """``None`` when ``rel`` is a safe name of a file inside a state, else why not (one phrase).

    Safe means: a non-empty ``str`` of ``/``-separated segments, none empty, ``.`` or ``..``; not
    absolute; no backslash (a separator on Windows, and never in a name syncpoint writes); no NUL
    or other control character (a NUL truncates paths in C APIs, a newline forges log lines).
    Exactly the names that ``posixpath.normpath`` leaves unchanged and that stay below the state.
    """
    if not isinstance(rel, str):
        return f"is a {type(rel).__name__}, not a path"
    if not rel:
        return "is empty"
    if len(rel) > MAX_PATH_CHARS:
        return f"is longer than {MAX_PATH_CHARS} characters"
    bad = next((c for c in rel if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        return f"contains the control character {bad!r}"
    if "\\" in rel:
        return "contains a backslash"
    if rel.startswith("/"):
        return "is absolute"
    for segment in rel.split("/"):
        if segment == "":
            return "has an empty segment (// or a trailing /)"
        if segment in (".", ".."):
            return f"has a {segment!r} segment"
    return None
