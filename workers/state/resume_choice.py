"""What rank 0 decides an attempt starts from, as every rank receives it: the chosen state with its
parsed records, or the refusal every rank raises.

Why its own module: both the negotiation among committed states and a run's origin (``init_from``)
hand their choice to every rank in this one record.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.state_format import (
    Manifest,
    TrainState,
)
from syncpoint.policies.decisions.candidates import Candidate
from syncpoint.workers.integrity.signing import legacy_unbound
from syncpoint.workers.state.node_share import NodePeers

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class ResumeChoice:
    """What rank 0 decided, the same object on every rank (``dist.broadcast_object_list``).

    Pickled, and only between this job's own ranks (the process group's own trust): the typed
    records arrive as rank 0 validated them, so no rank parses a manifest of up to
    ``MANIFEST_MAX_FILES`` entries again, and no text format of them is needed beside the files'.
    Rank 0 checked the signature over the manifest exactly as read; ``legacy_signature`` is what
    the other ranks need of it.
    """

    state: str | None = None  # the state to load; None: start without one (or ``error``)
    reason: str = ""
    record: Manifest | None = None  # its manifest.json
    record_problem: str | None = None  # init_from: why its manifest.json does not parse (every rank's fetch refuses)
    train_state: TrainState | None = None  # its trainer.json
    legacy_signature: bool = False  # signed before signatures carried a binding (``legacy_unbound``)
    error: str | None = None  # rank 0 refused: every rank raises ``ResumeRefused`` with it

    @classmethod
    def of(cls, name: str | None, c: Candidate | None, reason: str) -> ResumeChoice:
        """The choice of state ``name`` (None: none), with the records of its candidate ``c``."""
        if c is None:
            return cls(state=name, reason=reason)
        c.parse()
        return cls(
            state=name,
            reason=reason,
            record=c.record,
            record_problem=c.record_problem,
            train_state=c.state,
            legacy_signature=c.manifest is not None and legacy_unbound(c.manifest),
        )

    def candidate(self) -> Candidate:
        """The chosen state as fetching reads it (its records already parsed)."""
        assert self.state is not None
        return Candidate(
            name=self.state,
            record=self.record,
            record_problem=self.record_problem,
            state=self.train_state,
            parsed=True,
        )

    def broadcast(self) -> ResumeChoice:
        """Rank 0's choice on every rank (the others pass whatever they hold)."""
        box: list[ResumeChoice] = [self]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def node_peers() -> NodePeers | None:
    """The ranks of this node that share a restore's reads (``syncpoint.workers.state.node_share``);
    none alone."""
    return NodePeers() if dist.get_world_size() > 1 else None


def manifest_sha256(manifest: JSONObject) -> str:
    """A state's content digest from its manifest alone: the manifest lists every file's size and
    checksum, so equal canonical manifests mean equal states (no tensor read)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
