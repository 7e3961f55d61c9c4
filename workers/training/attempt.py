"""What every part of one attempt shares, set up once by ``run_worker``.

Why one object: resume negotiation, the training loop, saving and retention all need the same
dozen facts about the attempt (the spec, the run's storage, which rank this is, the layout, the
lease...). Passed one by one they made every signature a dozen parameters long; grouped, each
function names only the attempt and what is really its own.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.candidates import LiveJob
from syncpoint.policies.decisions.elastic import Layout
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import RunLease
from syncpoint.workers.supervision.faults import Faults
from syncpoint.workers.training.position import RunLength

if TYPE_CHECKING:
    from syncpoint.workers.state.memory_copy import MemoryCopy
    from syncpoint.workers.state.pretrained import PretrainedInit


@dataclass(frozen=True)
class Attempt:
    """Everything one rank knows about the attempt it runs: spec, storage, rank, layout, lease and keys."""

    spec: JobSpec
    storage: RunStorage
    events: EventLog | None  # rank 0 writes the event log; the other ranks hold None
    faults: Faults
    rank: int
    world_size: int
    number: int  # 1 for a submission's first attempt, counted from the event log
    submission_id: str  # one per `syncpoint run`: restarts inside it continue their own states
    live: LiveJob  # what a state must match to resume in this attempt (and what this attempt's states record)
    layout: Layout
    lease: RunLease | None  # rank 0's hold on the run directory; None on the other ranks
    signing_key: bytes | None = None
    restart: bool = False  # rank 0: an earlier attempt of this submission already started
    stateful: Mapping[str, Any] = field(default_factory=dict)  # Task.stateful: saved and restored with every state
    # resume.init_from as a pretrained directory, loaded before DeepSpeed (syncpoint.workers.state.pretrained)
    pretrained: PretrainedInit | None = None
    # this node's copy of the newest committed state in shared memory (checkpoint.memory_copy)
    memory_copy: MemoryCopy | None = None

    @property
    def run_length(self) -> RunLength:
        return RunLength.of(self.spec.train, self.layout)

    def say(self, message: str) -> None:
        """One line for the user, printed once (by rank 0), not once per rank."""
        if self.rank == 0:
            print(f"[syncpoint] {message}", flush=True)

    def warn(self, message: str) -> None:
        """A warning, printed once (by rank 0) on stderr."""
        if self.rank == 0:
            print(f"[syncpoint] WARNING: {message}", file=sys.stderr, flush=True)
