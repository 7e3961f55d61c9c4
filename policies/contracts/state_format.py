"""The state format in one place: where a state's files lie and what its two metadata files hold.

A committed state is ``<run>/states/<name>/`` (``name``: the global micro-step, 12 ASCII digits)::

    trainer.json                  TrainState: position, identity, metrics, provenance (rank 0)
    engine/...                    DeepSpeed's files under the tag ``engine`` (``required_files``)
    optim/full.safetensors        the gathered optimizer state of elastic ZeRO 1-3 runs
    <part>/rank_<r:05d>.safetensors   every rank's file of each per-rank part the state carries
                                  (``RANK_PARTS``: rng always; buffers, user and stream where recorded)
    manifest.json                 Manifest: every file with size and checksum; written last, it commits

Why models: the writer, classification, discovery, the reader, digest and the CLI all read these
files; one definition means one parse that names the bad field (``problem_of``) instead of a
``.get()`` fallback per reader, and the one conversion of older states happens here, in
``TrainState``'s validator. Every field and default below is what states on disk hold today; the
bytes written do not change (``json_bytes`` is the one encoding of both files). Pure data: nothing
here does I/O, so classification (a policy) can use it. ``syncpoint.policies.contracts.state_paths`` stays its own
module:
the one rule for which names a manifest may give its files, shared with fetch and ``digest``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import (
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.spec import SchedulerSpec
from syncpoint.policies.contracts.state_identity import (
    LEGACY_SAMPLER as LEGACY_SAMPLER,
)
from syncpoint.policies.contracts.state_identity import (
    MAX_USER_STATE_OBJECTS as MAX_USER_STATE_OBJECTS,
)
from syncpoint.policies.contracts.state_identity import (
    SAMPLER_VERSION,
    SHARD_WINDOW_SAMPLER,
    STREAM_SAMPLER,
    Count,
    DataIdentity,
    Positive,
    ScheduleShape,
    StateIdentity,
    _Record,
)
from syncpoint.policies.contracts.state_identity import (
    USER_STATE_NAME as USER_STATE_NAME,
)
from syncpoint.policies.contracts.state_paths import path_problem

STATES_DIR = "states"  # under the run directory
STATE_NAME_DIGITS = 12
TRAINER_FILE = "trainer.json"
MANIFEST_FILE = "manifest.json"
ENGINE_TAG = "engine"  # DeepSpeed's checkpoint tag: its files lie under engine/
FULL_OPTIMIZER_FILE = "optim/full.safetensors"
LOCAL_DIRS = (ENGINE_TAG, "optim")  # DeepSpeed and the elastic state write and read these on local disk
MODEL_FILE = f"{ENGINE_TAG}/mp_rank_00_model_states.pt"  # ZeRO 0-2: the whole module
ZERO3_MODEL = re.compile(rf"^{ENGINE_TAG}/zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
ZERO_OPTIM = re.compile(rf"^{ENGINE_TAG}/(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")

TRAINER_SCHEMA_VERSION = 1
MANIFEST_FORMAT = "syncpoint-state/1"
KNOWN_SAMPLERS = (SAMPLER_VERSION, LEGACY_SAMPLER, SHARD_WINDOW_SAMPLER, STREAM_SAMPLER)
# The checksum algorithms a manifest entry may name (``syncpoint.workers.integrity.checksum`` implements them).
CHECKSUM_ALGORITHMS = ("xxh3_128", "sha256")
# Bounds of what storage may hand a reader (storage may be hostile: a file linked to /dev/zero, a
# manifest of a million entries). A manifest of MANIFEST_MAX_FILES entries with long DeepSpeed names
# and sha256 digests takes about 17 MB as json_bytes writes it: 32 MiB holds that with room; a real
# state lists 2-4 files per rank, so 100,000 entries is ~25,000 ranks. trainer.json holds a position,
# an identity and the task's metrics (a few KiB); 4 MiB is room for very many metrics. A file a
# manifest lists is read with exactly its listed size as the bound.
MANIFEST_MAX_BYTES = 32 << 20
MANIFEST_MAX_FILES = 100_000
TRAINER_MAX_BYTES = 4 << 20


def state_name(global_micro_step: int) -> str:
    """Zero-padded, so names sort by micro-step and retention can tell ours from anything else."""
    return f"{global_micro_step:0{STATE_NAME_DIGITS}d}"


def is_state_name(name: str) -> bool:
    """Only directories named like ``state_name`` are syncpoint's states."""
    return len(name) == STATE_NAME_DIGITS and name.isascii() and name.isdigit()


def local_path(directory: str, rel: str) -> str:
    """Where a state file (``rel``, as the manifest names it) lies in a local copy of the state."""
    return os.path.join(directory, *rel.split("/"))


@dataclass(frozen=True)
class RankPart:
    """One per-rank kind of state as the layout knows it: one file per rank under its own directory,
    and whether a state carries it, read from the state's own record.

    Why a registry: every reader of the layout (``required_files``, the writer, the reader, the digest,
    the memory copy) iterates ``RANK_PARTS``; a new kind is one entry here, its behaviour one module
    of the workers (``syncpoint.workers.state.rank_parts``), instead of an if-branch in each of them.
    ``digest_key`` names its hash in a state's digest (the user part's predates the registry)."""

    name: str  # also its directory in a state
    carried_by: Callable[[TrainState], bool]  # what in a state's record says it has the part's files
    digest_key: str = ""

    def file(self, rank: int) -> str:
        """This part's file of ``rank`` in a state."""
        return f"{self.name}/rank_{rank:05d}.safetensors"

    def owns(self, rel: str) -> bool:
        return rel.startswith(f"{self.name}/")

    @property
    def hash_key(self) -> str:
        return self.digest_key or self.name


# every rank's RNG state: every state has it
RNG = RankPart("rng", lambda state: True)
# every rank's module buffers (states that record per_rank_buffers; before, every rank resumed with
# the buffers of DeepSpeed's module file)
BUFFERS = RankPart("buffers", lambda state: state.per_rank_buffers)
# every rank's Task.stateful objects (states that record user_state)
USER = RankPart("user", lambda state: bool(state.user_state), digest_key="user_state")
# every rank's stream position (states of stream datasets: data.stream)
STREAM = RankPart("stream", lambda state: state.data.stream is not None)
# In the order ``required_files`` lists them.
RANK_PARTS: tuple[RankPart, ...] = (RNG, BUFFERS, USER, STREAM)
RNG_DIR, BUFFERS_DIR, STREAM_DIR, USER_DIR = RNG.name, BUFFERS.name, STREAM.name, USER.name
rng_file, buffers_file, stream_file, user_file = RNG.file, BUFFERS.file, STREAM.file, USER.file


def zero3_model_file(rank: int) -> str:
    """DeepSpeed's ZeRO-3 per-rank model file in a state."""
    return f"{ENGINE_TAG}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def zero_optim_file(rank: int, *, bf16: bool) -> str:
    """DeepSpeed's per-rank ZeRO (or bf16) optimizer shard in a state."""
    return f"{ENGINE_TAG}/{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def engine_files(*, world_size: int, zero_stage: int, precision: str | None, full_optimizer_state: bool) -> list[str]:
    """DeepSpeed's files a committed state of this layout must list (DeepSpeed 0.19's file names).

    ZeRO 0 keeps model and optimizer in one file (fp32 and bf16 alike, measured); ZeRO 1/2 write
    one optimizer shard per rank (``bf16_``-prefixed in bf16); ZeRO 3 partitions the model too, so
    every rank writes its own model file (shapes and buffers; no ``mp_rank_00_model_states.pt``)
    next to its optimizer shard, which holds the rank's fp32 partition of every parameter. Offload
    (optimizer or parameters, to the CPU) changes where tensors live while training, not the files
    (measured). Elastic ZeRO 1-3 add the gathered optimizer state."""
    ranks = range(world_size)
    files = [zero3_model_file(r) for r in ranks] if zero_stage == 3 else [MODEL_FILE]
    if zero_stage in (1, 2, 3):
        files += [zero_optim_file(r, bf16=precision == "bf16") for r in ranks]
        if full_optimizer_state:
            files.append(FULL_OPTIMIZER_FILE)
    return files


def required_files(
    *,
    world_size: int,
    zero_stage: int,
    precision: str | None,
    full_optimizer_state: bool,
    per_rank_buffers: bool = False,
    stream: bool = False,
    user_state: bool = False,
) -> list[str]:
    """Every file a committed state of this layout must list: ``trainer.json``, DeepSpeed's files and
    every rank's file of each part carried (``TrainState.required_files`` asks each part itself)."""
    carried = {RNG: True, BUFFERS: per_rank_buffers, USER: user_state, STREAM: stream}
    engine = engine_files(
        world_size=world_size, zero_stage=zero_stage, precision=precision, full_optimizer_state=full_optimizer_state
    )
    return [TRAINER_FILE, *engine, *_part_files(world_size, [p for p in RANK_PARTS if carried.get(p)])]


def _part_files(world_size: int, parts: list[RankPart]) -> list[str]:
    return [p.file(r) for p in parts for r in range(world_size)]


def scheduler_phases(scheduler: SchedulerSpec) -> list[str]:
    """The phase order a state records: a schedule with another order cannot be continued.

    One phase named after the type (what states before warmup-stable-decay record for constant,
    linear and cosine), after a warmup when there is one; ``wsd`` records its stable phase and its
    decay's shape (linear and cosine decay differ as linear and cosine schedules do)."""
    warmup = ["linear_warmup"] if scheduler.warmup else []
    if scheduler.type == "wsd":
        return [*warmup, "stable", f"{scheduler.decay_shape or 'linear'}_decay"]
    return [*warmup, scheduler.type]


def json_bytes(record: JSONObject) -> bytes:
    """The one encoding of ``trainer.json`` and ``manifest.json`` (what every state on disk holds)."""
    return json.dumps(record, indent=1, sort_keys=True).encode()


def problem_of(error: ValidationError, file: str) -> str:
    """One line naming the first field a metadata file got wrong (classification's reason)."""
    errors = error.errors()
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"])
    cause = (first.get("ctx") or {}).get("error")
    if first["type"] == "value_error" and cause is not None:
        detail = str(cause)
    elif first["type"] == "missing":
        detail = "missing"
    else:
        detail = f"{first['msg']} (it is {_short(first.get('input'))})"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{file} field {where}: {detail}{more}" if where else f"{file}: {detail}{more}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class SchedulerRecord(ScheduleShape):
    """The schedule's shape and position; the live spec supplies every value
    (``syncpoint.workers.training.schedule``)."""

    position: Count | None = None  # None: not recorded, the schedule restarts (with a warning)

    @classmethod
    def of(cls, scheduler: SchedulerSpec, position: int) -> SchedulerRecord:
        return cls(type=scheduler.type, phases=scheduler_phases(scheduler), unit=scheduler.unit, position=position)


class DataRecord(DataIdentity):
    """Where the sampler stands, in samples, in the data its identity names."""

    global_samples: Count
    samples_in_epoch: Count


class TrainState(StateIdentity):
    """``trainer.json``: which run wrote a state (its ``StateIdentity``), where it stands, and how.

    Identity and position are required; provenance fields default to "not recorded". ``elastic`` is
    ``None`` in states written before it was recorded (``elastic_optimizer`` then tells what a
    resize may do).
    """

    FILE: ClassVar[str] = TRAINER_FILE

    schema_version: StrictInt
    job_name: str | None = None
    epoch: Count
    position_in_epoch: Positive
    global_micro_step: Positive
    optimizer_step: Count
    scheduler: SchedulerRecord | None = None  # None: not recorded, the schedule restarts (with a warning)
    # the horizon the schedule ran to, in its unit (the live spec decides it; a resume says when it
    # changed, e.g. a raised train.max_steps). None: not recorded (older states), nothing said
    schedule_horizon: Count | None = None
    data: DataRecord
    # the optimizer state loads at another world size (ZeRO 0 holds it whole; elastic 1-3 add optim/full.safetensors)
    elastic_optimizer: StrictBool = False
    # every rank's module buffers lie in buffers/ (False: states before the field; every rank resumes
    # with the buffers of DeepSpeed's module file, rank 0's at ZeRO 0-2)
    per_rank_buffers: StrictBool = False
    metrics: dict[str, Any] = {}  # values as the task reported them: best-metric checks each one
    save_reasons: list[str] = []
    attempt: StrictInt | None = None
    submission: str | None = None  # a restart of this submission continues from its own states
    created_at: StrictFloat | None = None

    @model_validator(mode="before")
    @classmethod
    def _sample_counters_of_older_states(cls, raw: Any) -> Any:
        """The one conversion between layouts of ``data``: a record holding only ``sampler``,
        ``num_samples`` and ``global_samples`` was written at one fixed world size (it has no
        elastic counters), so its sample counters follow from the micro-step counters."""
        if not isinstance(raw, dict):
            return raw
        data = raw.get("data")
        if not isinstance(data, dict) or "samples_in_epoch" in data or "samples_per_epoch" in data:
            return raw
        keys = (
            "position_in_epoch",
            "global_micro_step",
            "grad_accum",
            "micro_batches_per_epoch",
            "micro_batch_size",
            "world_size",
        )
        counters = [v for v in (raw.get(k) for k in keys) if isinstance(v, int) and not isinstance(v, bool)]
        if len(counters) != len(keys):
            return raw  # the field errors name what is wrong
        position, global_micro_step, grad_accum, micro_batches_per_epoch, micro_batch_size, world_size = counters
        per_micro = micro_batch_size * world_size
        derived = {
            "global_samples": global_micro_step * per_micro,
            "samples_in_epoch": position * per_micro,
            "samples_per_epoch": micro_batches_per_epoch * per_micro,
            "global_batch": grad_accum * per_micro,
        }
        return {**raw, "data": {**derived, **data}}

    @property
    def full_optimizer_state(self) -> bool:
        """Whether the state holds ``optim/full.safetensors`` (elastic ZeRO 1-3; before ``elastic``
        was recorded, an elastic optimizer at ZeRO 1/2 said so)."""
        return bool(self.elastic) or (self.elastic_optimizer and self.zero_stage in (1, 2))

    def required_files(self) -> list[str]:
        engine = engine_files(
            world_size=self.world_size,
            zero_stage=self.zero_stage,
            precision=self.precision,
            full_optimizer_state=self.full_optimizer_state,
        )
        return [TRAINER_FILE, *engine, *_part_files(self.world_size, self.rank_parts())]

    def rank_parts(self) -> list[RankPart]:
        """The per-rank parts this state carries (``RANK_PARTS``, in their order)."""
        return [p for p in RANK_PARTS if p.carried_by(self)]

    def record(self) -> JSONObject:
        """The JSON object ``trainer.json`` holds (``json_bytes`` encodes it)."""
        return self.model_dump()

    def identity(self) -> StateIdentity:
        """The state's identity alone, as the live job's is built (``syncpoint states`` compares
        with it when no run is live)."""
        fields = set(StateIdentity.model_fields)
        data_fields = set(DataIdentity.model_fields)
        record = {k: v for k, v in self.model_dump(include=fields).items()}
        record["data"] = {k: v for k, v in record["data"].items() if k in data_fields}
        if record.get("scheduler") is not None:
            record["scheduler"] = {k: v for k, v in record["scheduler"].items() if k in ScheduleShape.model_fields}
        record["optimizer"] = {**record["optimizer"], "running": None}
        return StateIdentity.model_validate(record)


def schema_problem(raw: JSONObject) -> str | None:
    """Why this syncpoint cannot read a ``trainer.json`` at all (checked before the model: a newer
    schema may lack or retype fields this one requires), or None."""
    version = raw.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > TRAINER_SCHEMA_VERSION:
        return (
            f"{TRAINER_FILE} schema_version {version!r} is newer than this syncpoint reads "
            f"(<= {TRAINER_SCHEMA_VERSION}); upgrade syncpoint to resume it"
        )
    return None


def entry_problem(rel: Any, info: Any) -> str | None:
    """Why one manifest entry is unusable (an unsafe path, no valid size, not exactly one known
    checksum): the one rule that classification, fetch and ``digest`` apply alike."""
    if not isinstance(rel, str):
        return f"manifest names a non-string path {rel!r}"
    bad_path = path_problem(rel)
    if bad_path:
        return f"manifest entry {rel!r} {bad_path}"
    if not isinstance(info, dict):
        return f"manifest entry {rel} is not an object"
    size = info.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"manifest entry {rel} has no valid size ({size!r})"
    algos = [a for a in CHECKSUM_ALGORITHMS if a in info]
    if len(algos) != 1:
        return (
            f"manifest entry {rel} names {'no' if not algos else 'more than one'} known checksum algorithm "
            f"(one of {', '.join(CHECKSUM_ALGORITHMS)}; it has {sorted(k for k in info if k != 'size')})"
        )
    digest = info[algos[0]]
    if not isinstance(digest, str) or not digest or any(ch not in "0123456789abcdef" for ch in digest):
        return f"manifest entry {rel}: {algos[0]} is not a hex digest"
    return None


class ManifestEntry(_Record):
    """One file: its size and exactly one checksum, keyed by the algorithm (``entry_problem``)."""

    size: Count
    xxh3_128: str | None = None
    sha256: str | None = None

    @property
    def algorithm(self) -> str:
        return next(a for a in CHECKSUM_ALGORITHMS if getattr(self, a) is not None)

    @property
    def digest(self) -> str:
        return getattr(self, self.algorithm)

    @classmethod
    def of(cls, size: int, algo: str, hexdigest: str) -> ManifestEntry:
        """The entry of a file just written and checksummed with ``algo``."""
        if algo not in CHECKSUM_ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algo!r} (known: {', '.join(CHECKSUM_ALGORITHMS)})")
        return cls.model_validate({"size": size, algo: hexdigest})

    def record(self) -> JSONObject:
        """The JSON object a manifest holds for this file."""
        return self.model_dump(exclude_none=True)


class Manifest(_Record):
    """``manifest.json``: written last, it commits the state; a signed one also carries ``signature``
    (``syncpoint.workers.integrity.signing``, which checks the object as read)."""

    FILE: ClassVar[str] = MANIFEST_FILE

    format: str = MANIFEST_FORMAT
    state: str | None = None  # None: not recorded (the directory name is the state)
    created_at: StrictFloat | None = None
    world_size: Positive | None = None  # None: not recorded, not compared
    checksum: str | None = None  # the algorithm the writer used (each entry names its own)
    files: dict[str, ManifestEntry]
    lease_generation: StrictInt | None = None  # the fencing token of the writer

    @field_validator("files", mode="before")
    @classmethod
    def _every_entry_usable(cls, files: Any) -> Any:
        if not isinstance(files, dict) or not files:
            raise ValueError("manifest lists no files")
        if len(files) > MANIFEST_MAX_FILES:  # checked first: validating a million entries costs seconds
            raise ValueError(
                f"manifest lists {len(files)} files, more than the {MANIFEST_MAX_FILES} a state holds "
                "(2-4 per rank): not a manifest syncpoint wrote"
            )
        for rel, info in files.items():
            problem = entry_problem(rel, info)
            if problem:
                raise ValueError(problem)
        return files

    def record(self) -> JSONObject:
        """The JSON object ``manifest.json`` holds, unsigned (``json_bytes`` encodes it)."""
        return self.model_dump(exclude_none=True)
