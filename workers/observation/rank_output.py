"""Whose prints reach the user: every line once, not once per rank (``train.prints``).

Why at the source: every rank runs the same task code, so a ``print`` in it (a model summary, a
loss) reached the driver once per rank, interleaved. Only the rank itself knows its rank (Ray's log
stream names a process, not a rank), so each training process wraps its own ``sys.stdout`` and
``sys.stderr`` as it starts:

- ``train.prints: rank0`` (the default): rank 0's stdout as it is; the other ranks' stdout dropped,
  except syncpoint's own lines (``[syncpoint] ...``, ``syncpoint: ...``: a rank's own diagnostics);
- ``train.prints: all``: every rank's stdout, each line prefixed ``[rank N]``;
- stderr (warnings, errors) of every rank always shows, prefixed ``[rank N]`` on ranks other than 0
  (``all``: on every rank), so a warning one rank alone gives is never lost.

A failure's traceback is not printed per rank: the in-place decision prints the failing rank's once
(``syncpoint.workers.supervision.supervisor``).
"""

from __future__ import annotations

import sys
from typing import Any, Literal, TextIO

Prints = Literal["rank0", "all"]
SYNCPOINT_LINES = ("[syncpoint]", "syncpoint:")  # how syncpoint's own lines begin (a rank's, a lease's)
# Ray's markers for its log monitor (the actor or task a worker's next lines belong to): written as they
# are, never prefixed or dropped, or the driver would name the lines wrongly and print the marker itself.
RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:", ":event_summary:", ":info_message:")
HEAD = max(len(s) for s in (*SYNCPOINT_LINES, *RAY_MARKERS))


class RankStream:
    """A text stream over ``target`` that prefixes each line with ``prefix`` (``keep``) or drops
    each line that is not syncpoint's own (not ``keep``). Lines are judged at their start, so a line
    written in pieces (``print`` writes its text, then the newline) is kept or dropped whole; a kept
    line goes to ``target`` whole, in one write, at its end (or at a flush), because ranks share the
    driver's pipe and an unbuffered target (``PYTHONUNBUFFERED``) would interleave their pieces."""

    def __init__(self, target: TextIO, prefix: str, keep: bool) -> None:
        self.target, self.prefix, self.keep = target, prefix, keep
        self._head = ""  # the start of a line not yet judged (shorter than HEAD)
        self._line: bool | None = None  # the current line: kept (True), dropped (False), not yet judged (None)
        self._kept = ""  # the kept line's text not yet written (its prefix included)

    def write(self, s: str) -> int:
        out: list[str] = []
        for piece in s.splitlines(keepends=True):
            self._piece(piece, out)
        if out:
            self.target.write("".join(out))
        return len(s)

    def _piece(self, piece: str, out: list[str]) -> None:
        """One piece of at most one line (its newline, if any, at its end)."""
        if self._line is None:
            self._head += piece
            ended = self._head.endswith(("\n", "\r"))
            undecided = len(self._head) < HEAD and any(
                s.startswith(self._head) for s in (*SYNCPOINT_LINES, *RAY_MARKERS)
            )
            if not ended and undecided:
                return  # not yet known whether it is syncpoint's line or Ray's marker
            self._judge()  # the whole piece was its start
        elif self._line:
            self._kept += piece
        if piece.endswith(("\n", "\r")):
            self._end_line(out)

    def _judge(self) -> None:
        """The pending start of a line decides the whole line: kept (prefixed unless Ray's marker) or dropped."""
        as_is = self._head.startswith(RAY_MARKERS)
        self._line = self.keep or as_is or self._head.startswith(SYNCPOINT_LINES)
        if self._line:
            self._kept = self._head if as_is or not self.keep else self.prefix + self._head
        self._head = ""

    def _end_line(self, out: list[str]) -> None:
        if self._line and self._kept:
            out.append(self._kept)
        self._kept, self._line = "", None

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self.keep and self._line is None and self._head:  # a kept line's start is due now (a prompt, a bar)
            self._judge()
        if self._line and self._kept:  # the kept line so far; the rest of it follows unprefixed
            self.target.write(self._kept)
            self._kept = ""
        self.target.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the real stream's
        return getattr(self.target, name)


def own_output(rank: int, prints: Prints) -> None:
    """In a training process, before the task is built: its stdout and stderr as ``train.prints`` says
    (see the module docstring). Again in the same process (a new rank): the streams are rewrapped."""
    everyone = prints == "all"
    prefix = f"[rank {rank}] "
    out, err = (s.target if isinstance(s, RankStream) else s for s in (sys.stdout, sys.stderr))
    if rank == 0 and not everyone:
        sys.stdout, sys.stderr = out, err
        return
    sys.stdout = RankStream(out, prefix, keep=everyone)
    sys.stderr = RankStream(err, prefix, keep=True)
