"""A rank's stream (``syncpoint.workers.observation.rank_output.RankStream``) writes each kept line whole, in one
write to its target: ranks share the driver's pipe, and a target that writes through (an unbuffered
stdout, ``PYTHONUNBUFFERED``) would otherwise interleave one rank's text with another's newline."""

from __future__ import annotations

import contextlib
import io

from syncpoint.workers.observation.rank_output import RankStream


class Writes(io.StringIO):
    """A target that records each write call, as an unbuffered pipe sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_a_printed_line_reaches_the_target_in_one_write_with_its_prefix():
    target = Writes()
    stream = RankStream(target, "[rank 1] ", keep=True)
    with contextlib.redirect_stdout(stream):
        print("task built:", 49, "parameters")
        print("two\nlines")
    assert target.calls == ["[rank 1] task built: 49 parameters\n", "[rank 1] two\n", "[rank 1] lines\n"]


def test_a_flush_writes_the_line_so_far_and_its_rest_follows_unprefixed():
    target = Writes()
    stream = RankStream(target, "[rank 1] ", keep=True)
    stream.write("step 3 ")
    assert target.calls == []  # not yet a whole line
    stream.flush()
    stream.write("loss 1.5\n")
    assert target.getvalue() == "[rank 1] step 3 loss 1.5\n"


def test_dropped_lines_write_nothing_and_syncpoints_own_pass_whole():
    target = Writes()
    stream = RankStream(target, "[rank 1] ", keep=False)
    with contextlib.redirect_stdout(stream):
        print("a user's print")
        print("[syncpoint] rank 1 saved")
    assert target.calls == ["[syncpoint] rank 1 saved\n"]
