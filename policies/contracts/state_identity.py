"""Which run a state continues (``StateIdentity``) and the records it is made of.

Why apart from ``syncpoint.policies.contracts.state_format``: the identity is what both sides of a
resume hold, a state's ``trainer.json`` and the live job (``syncpoint.policies.decisions.live_job``);
the state's position, provenance and file layout are the state format's alone. Pure data, no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from syncpoint.policies.contracts.bounded_json import JSONObject

# The epoch order's algorithm (``syncpoint.workers.data.sampler.epoch_order``). A state records the one it was written
# with, and a run continues with its state's: new runs use SAMPLER_VERSION; a state that records
# LEGACY_SAMPLER (the materialised permutation) resumes with it, to the same samples.
SAMPLER_VERSION = "feistel/v1"
LEGACY_SAMPLER = "global-permutation/v1"
# A stream dataset has no epoch order: each rank's position is its stream's own state
# (``syncpoint.workers.data.stream``), in the rank's stream file, and ``data.stream`` says which stream it is.
STREAM_SAMPLER = "stream/v1"
# A sharded corpus's locality shuffle (``syncpoint.workers.data.sampler.ShardWindowOrder``): the shard order permuted,
# then the rows within each window of ``data.window_shards`` consecutive shards of that order.
SHARD_WINDOW_SAMPLER = "shard-window/v1"
# Task.stateful names: short, plain, sorted and unique in a state (they name objects, not paths)
MAX_USER_STATE_OBJECTS = 64
USER_STATE_NAME = r"^[A-Za-z0-9_.-]{1,64}$"

Count = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[StrictInt, Field(ge=1)]


class _Record(BaseModel):
    """Strict (a string is no integer, a bool no count); unknown keys kept, so a record reads back whole."""

    model_config = ConfigDict(strict=True, extra="allow")


class ScheduleShape(_Record):
    """The schedule's type, phase order and unit: a state's position continues only a schedule of
    this shape (``resume.reset_schedule`` opts out); the live spec supplies every value."""

    type: str
    phases: list[str]
    unit: str


class ParamGroupRecord(_Record):
    """One optimizer param group as the state's moments are laid out: DeepSpeed flattens and
    partitions each group on its own, so another split cannot load them."""

    params: Count  # parameters in the group
    numel: Count  # their elements, all together
    names: str | None = None  # a short hash of the parameters' names in group order (None: unnamed)


class OptimizerRecord(_Record):
    """The optimizer's type and param-group layout as saved: selection compares them with the live job's."""

    type: str | None = None  # None: not recorded (states before the field), not compared
    # None: not recorded (states before the field: one group, which the live layout must then be)
    param_groups: list[ParamGroupRecord] | None = None
    # per group: the keys the optimizer itself changed since it was built (running state, which the
    # state supplies on resume), each with its as-built value (None: not JSON); None: not recorded
    # (states before the field: every group key comes from the live run). ``syncpoint.workers.training.param_groups``
    running: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_running_record_per_group(self) -> OptimizerRecord:
        if self.running is not None and self.param_groups is not None and len(self.running) != len(self.param_groups):
            raise ValueError(
                f"optimizer.running has {len(self.running)} group(s), optimizer.param_groups {len(self.param_groups)}"
            )
        return self


class BufferRecord(_Record):
    """One buffer of the model's state dict: a state loads only into buffers of these names and
    shapes, and exactly only into these dtypes."""

    name: str
    shape: list[Count]
    dtype: str


class ParameterDtypes(_Record):
    """The parameters' dtypes: the most common one, and every parameter of another dtype by name."""

    common: str
    others: dict[str, str] = {}


class StreamRecord(_Record):
    """Which stream a stream dataset's state continues (``syncpoint.workers.data.stream.identity``): a state of
    another stream, or read by another number of DataLoader workers or another shuffle buffer,
    cannot continue it exactly. Each rank's position lies in its own stream file."""

    source: str  # "huggingface" (a datasets.IterableDataset) or "custom" (a stateful IterableDataset)
    identity: dict[str, Any]  # what the stream is made of: its files, its pipeline, its class
    dataloader_workers: Count  # every worker keeps its own shard position
    shuffle_buffer: Count  # train.stream_shuffle_buffer


class StreamFields(TypedDict):
    """``StreamRecord``'s fields as the live run builds them (``syncpoint.workers.data.stream.prepare``),
    before they are validated into a state's record."""

    source: str
    identity: JSONObject
    dataloader_workers: int
    shuffle_buffer: int


class CorpusRecord(_Record):
    """The sharded corpus a state was trained on (``syncpoint.policies.contracts.corpus_identity``): its digest and
    size; the whole index lies in the run directory under ``corpus/<digest>.json``."""

    digest: str
    shards: Positive
    rows: Count


class DataIdentity(_Record):
    """What a state's data position is counted in: the dataset (its size, corpus or stream), the
    epoch order and the batch, in samples (world-size independent, so elastic runs resume by it)."""

    sampler: str = LEGACY_SAMPLER  # what a record without it was written with
    corpus: CorpusRecord | None = None  # None: the dataset was no sharded corpus (and every state before it)
    window_shards: Positive | None = None  # the shard-window sampler's window; None for the others
    num_samples: Count | None = None  # None: not recorded, not compared
    samples_per_epoch: Count
    global_batch: Count
    # a stream dataset's (sampler STREAM_SAMPLER); absent from map-style records, which stay as they were
    stream: StreamRecord | None = Field(None, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _stream_has_its_sampler(self) -> DataIdentity:
        if (self.stream is not None) != (self.sampler == STREAM_SAMPLER):
            raise ValueError(
                f"data.sampler {self.sampler!r} with{'out' if self.stream is None else ''} data.stream: "
                f"a stream dataset's state records both (sampler {STREAM_SAMPLER}), any other neither"
            )
        return self

    @model_serializer(mode="wrap")
    def _corpus_fields_only_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A run on any other dataset writes the record it wrote before the corpus fields existed."""
        out: dict[str, Any] = handler(self)
        for key in ("corpus", "window_shards"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class StateIdentity(_Record):
    """Which run a state continues and how it was laid out: every field selection compares with the
    live job's (``syncpoint.policies.decisions.compatibility``), one model for both sides.

    Why one model: a state's ``trainer.json`` holds these fields (``TrainState`` extends this model,
    so they lie at its top level, as in every state before it), and the live job builds its own
    (``syncpoint.policies.decisions.live_job``); the two cannot drift apart field by field. ``None``
    in an optional field means "not recorded, not compared" (states written before the field).
    """

    job_identity: str
    world_size: Positive
    micro_batch_size: Positive
    grad_accum: Positive
    micro_batches_per_epoch: Positive
    zero_stage: Annotated[StrictInt, Field(ge=0, le=3)]
    precision: str | None = None  # None: not recorded, not compared
    model_fingerprint: str
    # None: not recorded (states before the fields), not compared (the fingerprint still is)
    model_buffers: list[BufferRecord] | None = None
    parameter_dtypes: ParameterDtypes | None = None
    seed: StrictInt
    elastic: StrictBool | None = None
    optimizer: OptimizerRecord = OptimizerRecord()
    scheduler: ScheduleShape | None = None  # None: not recorded, the schedule restarts (with a warning)
    data: DataIdentity
    # the task's own train-side generators, path -> kind, whose states the RNG files hold (None:
    # not recorded, states before they were captured; not compared)
    task_generators: dict[str, str] | None = None
    # the names of the task's Task.stateful objects, sorted, whose states every rank's user file holds
    # (None: none, or a state before user state was saved)
    user_state: list[Annotated[str, Field(pattern=USER_STATE_NAME)]] | None = Field(
        None, max_length=MAX_USER_STATE_OBJECTS
    )

    @field_validator("user_state")
    @classmethod
    def _user_state_sorted_and_unique(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and names != sorted(set(names)):
            raise ValueError("user_state must list unique names in sorted order")
        return names
