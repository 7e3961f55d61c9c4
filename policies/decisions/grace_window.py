"""Saves inside a preemption notice's grace window: the notice's own save, then, when the node's
deadline is known, one more at the last boundary that can still commit before it.

Why not a save at every boundary of the window: once the notice's state is committed, saving at
every later boundary keeps each step of the window, but pays a save per step. Where a save costs
about a step (the example: 0.04 s against 0.06 s), 40% of the window goes to saves, and a notice
30 s ahead loses 11 s of it. When the deadline is known, the window trains without saving and
saves again at the last boundary from which a save commits before the deadline. Ray's drain
notice carries one; a SIGTERM does when ``checkpoint.sigterm_grace_s`` says how long the platform
waits before its SIGKILL. Without a deadline the node may go at any moment, so every boundary
saves.

The margin is deliberately wide: ``SAFETY`` times (the longest recent step plus the last save's
start-to-commit time), plus ``SLACK_S``. From the boundary where the next one might be too late,
every boundary saves again, so a slow step or a slow save costs at most the work after the last
commit, never the notice's own state. Pure functions (no clock): the loop passes the times in.
"""

from __future__ import annotations

import math
from typing import TypeAlias

# A preemption notice as it travels from its source to the loop (a pipe, a Ray actor call) and into
# its ``PreemptionNotice`` event: ``source`` always; Ray's drain adds ``deadline_ms``, ``nodes`` and
# ``ranks``, the driver's own ``signal``. A plain dict, not a TypedDict: the loop unpacks it into the event.
NoticeValue: TypeAlias = "str | int | float | list[str] | list[int] | None"
Notice: TypeAlias = "dict[str, NoticeValue]"

SAFETY = 2.0  # the next step and the save after it may each take twice the longest one measured
SLACK_S = 1.0  # and a second more: clocks, a collective, the commit's own write


def notice_deadline(notice: Notice, *, sigterm_at: float | None, sigterm_grace_s: float | None) -> float | None:
    """When the node goes, in UNIX seconds, or None when the notice does not say.

    Ray's drain notice gives ``deadline_ms`` (UNIX milliseconds; 0 or absent: none). A SIGTERM gives
    its arrival time, and the spec may say how long the platform's grace is."""
    deadline_ms = notice.get("deadline_ms")
    if isinstance(deadline_ms, int | float) and not isinstance(deadline_ms, bool):
        if math.isfinite(deadline_ms) and deadline_ms > 0:
            return float(deadline_ms) / 1000.0
    if notice.get("source") == "sigterm" and sigterm_at is not None and sigterm_grace_s is not None:
        return sigterm_at + sigterm_grace_s
    return None


def margin_s(step_s: float, commit_s: float) -> float:
    """How long before the deadline the last planned save must start."""
    return SAFETY * (step_s + commit_s) + SLACK_S


def save_due(now: float, deadline: float | None, step_s: float | None, commit_s: float | None) -> bool:
    """Whether this boundary (after the notice's own save) saves: yes without a deadline, or until a
    step and a save were measured; else only once the next boundary could be too late."""
    if deadline is None or step_s is None or commit_s is None:
        return True
    return now + margin_s(step_s, commit_s) >= deadline


def kept_in_window(window_s: float, step_s: float, commit_s: float, save_blocked_s: float, deadline: bool) -> float:
    """Seconds of training kept from a grace window of ``window_s`` after the notice's commit (the
    goodput simulator's model of this policy): without a deadline every boundary saves, so each step
    costs a step plus a save; with one, the window up to the margin trains without saves, and the
    margin's boundaries save. The last step before the node goes is lost either way."""
    per_save = step_s / (step_s + save_blocked_s) if step_s > 0 else 0.0
    if not deadline:
        return max(0.0, window_s - step_s) * per_save
    margin = margin_s(step_s, commit_s)
    if window_s <= margin:
        return max(0.0, window_s - step_s) * per_save
    return (window_s - margin) + max(0.0, margin - commit_s - step_s) * per_save
