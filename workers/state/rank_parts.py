"""What each per-rank part of a state does, and the one registry the writer, the reader, saving,
resume negotiation and the digest iterate.

The layout (``syncpoint.policies.contracts.state_format.RANK_PARTS``) says where a part's files lie
and when a state carries them; here each part says how it is captured at a boundary, which saved
rank's file a rank reads, how that file is checked while fetching (before DeepSpeed touches the
engine, so a refusal falls back with nothing half-loaded), how it is put back, and what of it the
digest hashes. Why one registry (TorchTitan's ``states={...}``, Composer's ``serialized_attributes``):
a kind of state was an if-branch in five modules; now it is its own module (the encoding: ``rng``,
``buffers``, ``stream_state``, ``user_state``), one adapter and one entry in ``PARTS``.

The RNG and the stream position are not put back here: the loop restores them where they belong
(the stream first, the RNG after the data skip, before the first fetch); resume negotiation hands
them over as the fetched values of ``RNG`` and ``STREAM``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from safetensors.torch import load as st_load

from syncpoint.policies.contracts.state_format import BUFFERS, RNG, STREAM, USER, RankPart, TrainState
from syncpoint.workers.data import stream_state
from syncpoint.workers.state import user_state
from syncpoint.workers.training import buffers, rng

if TYPE_CHECKING:
    import torch


@dataclass
class LiveRank:
    """What a part captures from and puts back into on this rank."""

    rank: int
    module: torch.nn.Module | None = None  # the engine's module (its buffers)
    stateful: Mapping[str, Any] = field(default_factory=dict)  # the task's Task.stateful objects
    stream: Callable[[], bytes] | None = None  # a stream dataset's position, as its file's bytes


class PartBehaviour(Protocol):
    """One per-rank kind of state; ``PARTS`` lists every one."""

    layout: RankPart
    # a listed file is read when the state has it; a state without it is still resumable (RNG:
    # the caller then re-derives or keeps the fresh streams)
    optional: bool

    def capture(self, live: LiveRank, trainer: TrainState) -> bytes | None:
        """This rank's file at a boundary, for a save whose record (``trainer``) carries the part;
        ``TaskError`` naming the value a file cannot hold."""
        ...

    def source(self, rank: int, state: TrainState) -> int | None:
        """The saved rank whose file ``rank`` reads from ``state`` (None: none)."""
        ...

    def parse(self, data: bytes, rel: str) -> Any:
        """The verified file read back whole while fetching (``StateRefused`` when it is not one)."""
        ...

    def prepare(self, parsed: Any, rel: str, state: TrainState, live: LiveRank) -> Any:
        """Checked against the live job before the engine's load (``StateMismatch``: incompatible)."""
        ...

    def apply(self, prepared: Any, live: LiveRank, state_name: str) -> str | None:
        """After the engine's load (``prepared`` None: the state has no file for this rank); a
        warning to say, or None. Runs for every part, so a part can say what it did not restore."""
        ...

    def digest(self, rank: int, data: bytes, rel: str) -> list[Any]:
        """What the digest hashes of one rank's file, in order."""
        ...


class _Part:
    """Defaults: the rank's own file, read back as bytes, nothing to put back after the load."""

    layout: RankPart
    optional = False

    def source(self, rank: int, state: TrainState) -> int | None:
        return rank if self.layout.carried_by(state) else None

    def parse(self, data: bytes, rel: str) -> Any:
        return data

    def prepare(self, parsed: Any, rel: str, state: TrainState, live: LiveRank) -> Any:
        return parsed

    def apply(self, prepared: Any, live: LiveRank, state_name: str) -> str | None:
        return None


class RngPart(_Part):
    """Every RNG the rank draws from (``syncpoint.workers.training.rng``), tried on this process at the
    fetch so the restore after the data skip cannot fail on a state already accepted."""

    layout, optional = RNG, True

    def capture(self, live: LiveRank, trainer: TrainState) -> bytes | None:
        return rng.capture()

    def source(self, rank: int, state: TrainState) -> int | None:
        return rank

    def parse(self, data: bytes, rel: str) -> Any:
        return rng.verify(data, rel)

    def digest(self, rank: int, data: bytes, rel: str) -> list[Any]:
        return [st_load(data), rng.safetensors_metadata(data)]


class BuffersPart(_Part):
    """The module's buffers of every rank (``syncpoint.workers.training.buffers``); a rank added by an
    elastic resume takes those of saved rank r mod the saved world size."""

    layout = BUFFERS

    def capture(self, live: LiveRank, trainer: TrainState) -> bytes | None:
        return buffers.capture(live.module) if live.module is not None else None

    def source(self, rank: int, state: TrainState) -> int | None:
        return buffers.source_rank(rank, state.world_size) if self.layout.carried_by(state) else None

    def prepare(self, parsed: Any, rel: str, state: TrainState, live: LiveRank) -> Any:
        assert live.module is not None, "buffers are checked against the live module"
        return buffers.read(parsed, rel, live.module)

    def apply(self, prepared: Any, live: LiveRank, state_name: str) -> str | None:
        if prepared is not None and live.module is not None:
            buffers.apply(live.module, prepared)
        return None

    def digest(self, rank: int, data: bytes, rel: str) -> list[Any]:
        return [rank, st_load(data)]


class UserPart(_Part):
    """The task's ``Task.stateful`` objects (``syncpoint.workers.state.user_state``); selection admitted
    the state at this world size only, so every rank reads its own."""

    layout = USER

    def capture(self, live: LiveRank, trainer: TrainState) -> bytes | None:
        return user_state.capture(live.stateful)

    def prepare(self, parsed: Any, rel: str, state: TrainState, live: LiveRank) -> Any:
        return user_state.parse(parsed, rel, tuple(state.user_state or ()))

    def apply(self, prepared: Any, live: LiveRank, state_name: str) -> str | None:
        if prepared is None and not live.stateful:
            return None
        fresh, dropped = user_state.restore(live.stateful, prepared or {})
        if not (fresh or dropped):
            return None
        return (
            f"resume.allow_user_state_change: state {state_name} did not save Task.stateful "
            f"{fresh or 'none'} (they start from the task's own state) and saved {dropped or 'none'} "
            "that this task lacks (dropped)"
        )

    def digest(self, rank: int, data: bytes, rel: str) -> list[Any]:
        tree = stream_state.parse_tree(data, rel, user_state.META_KEY, ("objects",), "user state")
        return [[rank, tree["objects"]]]


class StreamPart(_Part):
    """A stream dataset's position (``syncpoint.workers.data.stream_state``), parsed whole at the fetch;
    the data source restores it first."""

    layout = STREAM

    def capture(self, live: LiveRank, trainer: TrainState) -> bytes | None:
        return live.stream() if live.stream is not None else None

    def parse(self, data: bytes, rel: str) -> Any:
        return stream_state.parse(data, rel)

    def digest(self, rank: int, data: bytes, rel: str) -> list[Any]:
        saved = stream_state.parse(data, rel)
        return [[rank, saved.pass_number, stream_state.settled_stream(saved.loader)]]


# Every per-rank part, in the layout's order (``RANK_PARTS``); registering a kind is one entry here.
PARTS: tuple[PartBehaviour, ...] = (RngPart(), BuffersPart(), UserPart(), StreamPart())


def capture_all(live: LiveRank, trainer: TrainState) -> dict[str, bytes]:
    """This rank's file of every part this save's record carries (what ``required_files`` will ask
    the manifest for), by its path in the state."""
    files = {}
    for part in PARTS:
        if not part.layout.carried_by(trainer):
            continue
        data = part.capture(live, trainer)
        if data is not None:
            files[part.layout.file(live.rank)] = data
    return files


def sources(rank: int, state: TrainState) -> dict[str, int]:
    """Which saved rank's file of each part ``rank`` reads from ``state``, by part name."""
    out = {}
    for part in PARTS:
        source = part.source(rank, state)
        if source is not None:
            out[part.layout.name] = source
    return out


def behaviour(name: str) -> PartBehaviour:
    """The registered part of that name."""
    return next(p for p in PARTS if p.layout.name == name)
