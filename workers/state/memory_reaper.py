"""Remove this node's memory copy of a run when the process that started the reaper dies without
saying "keep": the copy must not outlive the job, also when a supervisor is killed outright.

Why a process of its own: a process killed with SIGKILL (an OOM kill, Ray tearing a worker group
down) runs no cleanup of its own, and tmpfs keeps its files until the node reboots. The reaper
holds the read end of a pipe whose write end only its starter has; the kernel closes that end
whatever way the starter ends, so the reaper's read returns then. A starter that hands the failure
to Ray Train writes ``keep`` first: a new worker group on this node may restore from the copy (and
the driver removes its own node's copy when the job ends, ``memory_copy.remove_for``).

Protocol on the reaper's stdin: the run's URL on the first line (never on the command line, where
``ps`` shows it), then ``keep`` or nothing before end of file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import IO

KEEP = b"keep"
URL_LIMIT = 1 << 16  # a run URL is short; a longer first line is not ours


class Reaper:
    """The starter's side: ``keep()`` before handing a failure to Ray Train, ``close()`` otherwise."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def _end(self, data: bytes) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            if data:
                stdin.write(data)
            stdin.close()
        except OSError:  # the reaper is gone already: nothing to tell it
            pass

    def keep(self) -> None:
        """Leave the copy for the next worker group on this node."""
        self._end(KEEP)

    def close(self) -> None:
        """Remove the copy now (the run finished here, or failed in a way no restart here follows)."""
        self._end(b"")


def start(run_url: str) -> Reaper | None:
    """Start the reaper of ``run_url``'s copy on this node; None where the node has no shared memory."""
    from syncpoint.workers.state.memory_copy import base_dir

    if base_dir() is None:
        return None
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncpoint.workers.state.memory_reaper"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a signal to the starter's process group (Ctrl-C, a kill of the group) spares it
        close_fds=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(run_url.encode() + b"\n")
    proc.stdin.flush()
    return Reaper(proc)


def main() -> int:
    """The reaper: wait for the starter's word or its end, then remove the copy unless told to keep it."""
    stdin = sys.stdin.buffer
    url = stdin.readline(URL_LIMIT)
    if not url.endswith(b"\n"):
        return 2
    word = stdin.read(len(KEEP) + 1)  # returns at end of file: the starter closed it, or died
    if word == KEEP:
        return 0
    from syncpoint.workers.state.memory_copy import remove_for

    remove_for(url[:-1].decode())
    return 0


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
