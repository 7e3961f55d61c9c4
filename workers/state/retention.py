"""Retention after a commit (rank 0): planned on the training thread, its deletes in a thread of their own.

Why a thread: deleting a state is unlinking its files, and a filesystem frees a large file's blocks
as it unlinks it: 110-140 ms per 0.5 GB state here, which the loop waited for after every commit
once ``keep_last`` states existed (rank 0, and so every rank at its next collective). The plan (a
listing of ``states/`` and the lease confirmed, milliseconds) stays on the loop, where it sees the
states as they are at the commit; the deletes follow in the background, one pass at a time, as
torchtitan's checkpointer purges in a thread of its own. The lease's confirmation renews it for a
full TTL, so no other run can take the directory while the pass deletes. A pass ends before the
next save's claim (``SaveCoordinator.at_boundary`` waits for it; usually long done), so it never
deletes a directory being written: a torn state it deletes can have the name the loop saves next
(a crash's debris, newer than the resumed state, older than another trajectory's newest). A pass's
error (an injected fault's included) is raised on the loop at the next save or when the run ends; a
failing attempt waits for its pass too, and says its error.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from syncpoint.policies.contracts.state_format import STATES_DIR
from syncpoint.policies.decisions.retention import plan_retention
from syncpoint.workers.state.discovery import discover
from syncpoint.workers.state.writer import delete_state

if TYPE_CHECKING:
    from syncpoint.workers.training.attempt import Attempt


class Retention:
    """One attempt's retention passes (rank 0): at most one deleting at a time."""

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def after_commit(self, keep: str | None) -> None:
        """Plan a pass now and start its deletes. ``keep`` (the state this run just committed) is never
        deleted, even when newer states of another trajectory (a run resumed from an older pin)
        outnumber it: a restart of this submission continues from it."""
        self.wait()
        names = planned_deletes(self.attempt, keep)
        if names:
            self.thread = threading.Thread(target=self._delete, args=(names,), name="syncpoint-retention")
            self.thread.start()

    def wait(self) -> None:
        """The last pass's deletes are done; its error, if any, raised here (on the loop)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error

    def settle(self) -> None:
        """At the attempt's failure: the last pass's deletes end with it, as they did on the loop (its
        lease is handed on next, and a rerun may save a state of a name the pass deletes); the pass's
        own error, if any, is said, not raised: the attempt's failure is what counts."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            print(f"[syncpoint] retention's last pass failed too: {type(error).__name__}: {error}", file=sys.stderr)

    def _delete(self, names: list[str]) -> None:
        try:
            for i, name in enumerate(names):
                delete_state(self.attempt.storage, name)
                if i == 0:
                    self.attempt.faults.at_phase("during_retention")
        except BaseException as e:  # noqa: BLE001 - raised on the loop by wait()
            self.error = e


def planned_deletes(attempt: Attempt, keep: str | None) -> list[str]:
    """The states a retention pass deletes now (none when the lease was lost: every rank stops at the
    next boundary), saying which unsafe ones it keeps."""
    checkpoint = attempt.spec.checkpoint
    if checkpoint.keep_last == 0 and not checkpoint.prune_unsafe:
        return []  # keep everything (torn debris included): no need to read every state after each save
    if attempt.lease is not None and attempt.lease.confirm() is not None:
        return []
    storage = attempt.storage
    plan = plan_retention(
        discover(storage, attempt.live, attempt.signing_key),
        checkpoint.keep_last,
        checkpoint.prune_unsafe,
        kinds=storage.entry_kinds(STATES_DIR),
    )
    for line in plan.reported:
        print(f"[syncpoint] retention kept unsafe state {line}", file=sys.stderr, flush=True)
    return [n for n in plan.delete if n != keep]
