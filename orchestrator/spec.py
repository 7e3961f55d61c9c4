"""The job spec: one pydantic model, loaded from YAML, that validates itself.

Why pydantic with ``extra="forbid"`` everywhere: a typo in a job file must be an error that names
the YAML path (and line) and says what is allowed, not a silently ignored key that changes the
run. Cross-field rules (``epochs`` or ``max_steps``, units, ZeRO stage vs precision) live in model
validators so every entry point (CLI, Ray job, tests) gets the same answers.

Why bounds everywhere (the ``MAX_*`` limits below): a job file is input, sometimes hostile, often
absurd by accident. Its size, YAML nesting and alias expansion are bounded *while it is parsed*
(an alias bomb or a 10,000-deep list is refused before it is built); every float must be finite
and every integer lie in a range a real job can use, so ``.inf``, ``.nan`` and ``seed: 2**70``
are errors naming the field, not a crash hours later; every error message is capped in length.
"""

from __future__ import annotations

import json
import os
import re
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictInt, Tag, ValidationError, field_validator,
                      model_validator)

from policies.redact import redact_obj, redact_text


BUILTIN_POLICIES = ("newest-resumable", "pinned", "fresh", "best-metric")

# ---- input bounds (README: Job spec reference, "Bounds"). Generous for any real job, small enough
# that validating the worst allowed spec takes milliseconds.
MAX_SPEC_BYTES = 1 << 20  # job file size; a spec is a few hundred bytes
MAX_YAML_DEPTH = 32  # nesting levels, the document root included
MAX_YAML_NODES = 10_000  # YAML nodes after alias expansion (an alias counts as a copy of its target)
MAX_MESSAGE_CHARS = 2000  # one error message, all problems together
MAX_PROBLEM_CHARS = 700  # one problem's line (echoed input is cut to 80 characters before that)
MAX_WORKERS = 4096  # Ray Train workers (torch ranks)
MAX_CPUS_PER_WORKER = 1024.0
MAX_MICRO_BATCH = 1 << 20  # samples per rank per micro-batch
MAX_GRAD_ACCUM = 1 << 16
MAX_STEPS = 10**9  # optimizer steps, schedule lengths, save/log intervals
MAX_EPOCHS = 10**6
MAX_MICRO_STEPS = 10**12  # state names are 12-digit global micro-steps
MAX_COUNT = 10**6  # keep_last, restarts, the save ordinal of a fault
MAX_DATALOADER_WORKERS = 256
MAX_SEED = (1 << 63) - 1  # torch and numpy take 64-bit seeds; 63 bits survive every signed cast
MAX_LR = 100.0  # above this it is a typo (1e3 for 1e-3), not a learning rate
MAX_LEASE_TTL_S = 7 * 24 * 3600.0  # a crashed owner blocks its successors this long at most
MAX_PATH_CHARS = 4096  # storage and state URLs
MAX_NAME_CHARS = 200  # the run directory's name (file systems stop at 255 bytes)
MAX_IMPORT_PATH_CHARS = 512
MAX_FAULTS = 1000


def _is_import_path(v: str) -> bool:
    mod, _, attr = v.partition(":")
    return bool(mod and attr) and all(p.isidentifier() for p in mod.split(".")) and attr.isidentifier()


def _ranges(values: list[int], limit: int = 12) -> str:
    """[1, 2, 3, 5] -> '[1-3, 5]', at most ``limit`` runs: a range of thousands of workers must not
    make a message of thousands of numbers."""
    spans: list[list[int]] = []
    for v in values:
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    runs = [f"{lo}-{hi}" if hi - lo >= 2 else ", ".join(str(x) for x in range(lo, hi + 1)) for lo, hi in spans]
    shown = runs[:limit] + ([f"... ({len(runs) - limit} more)"] if len(runs) > limit else [])
    return "[" + ", ".join(shown) + "]"


class _Strict(BaseModel):
    # allow_inf_nan=False: .inf/.nan in a learning rate or a TTL is never meant, and would otherwise
    # pass every gt/ge bound (or crash int() later)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ElasticWorkers(_Strict):
    min: StrictInt = Field(..., ge=1, le=MAX_WORKERS)
    max: StrictInt = Field(..., ge=1, le=MAX_WORKERS)

    @model_validator(mode="after")
    def _order(self) -> "ElasticWorkers":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


def _workers_kind(v: Any) -> str:
    """Which form of ``num_workers`` this is; the ``tagged-`` prefix keeps it out of error paths."""
    return "tagged-elastic" if isinstance(v, (dict, ElasticWorkers)) else "tagged-fixed"


# a tagged union: an elastic range's error is about its min/max only, not also "not an integer"
_Workers = Annotated[Union[Annotated[StrictInt, Tag("tagged-fixed")], Annotated[ElasticWorkers, Tag("tagged-elastic")]],
                     Discriminator(_workers_kind)]


class ScalingSpec(_Strict):
    """Named after Ray Train's ``ScalingConfig``."""

    num_workers: _Workers = Field(1, description=(
        "Ray Train workers (one torch rank each), or {min, max} to continue on whatever number Ray "
        "can place (elastic; train.grad_accum is then stated for max workers)."))
    cpus_per_worker: float = Field(1.0, gt=0, le=MAX_CPUS_PER_WORKER, description="CPUs reserved per worker.")
    use_gpu: bool = Field(False, description="One GPU per worker; NCCL instead of gloo.")

    @field_validator("num_workers")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (or {min, max} for elastic training)")
        if isinstance(v, int) and v > MAX_WORKERS:
            raise ValueError(f"must be at most {MAX_WORKERS}; syncpoint runs one torch rank per worker")
        return v

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, ElasticWorkers)

    @property
    def min_workers(self) -> int:
        return self.num_workers.min if isinstance(self.num_workers, ElasticWorkers) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers.max if isinstance(self.num_workers, ElasticWorkers) else self.num_workers


class TaskSpec(_Strict):
    path: str = Field(..., max_length=MAX_IMPORT_PATH_CHARS, description="Import path 'package.module:function' returning a Task.")
    config: dict[str, Any] = Field(default_factory=dict, description="Passed to the task function as-is.")

    @field_validator("path")
    @classmethod
    def _import_path(cls, v: str) -> str:
        if not _is_import_path(v):
            raise ValueError("must look like 'package.module:function' (e.g. examples.tiny_lm:build)")
        return v


class OptimizerSpec(_Strict):
    type: Literal["adamw", "adam", "sgd"] = "adamw"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0, le=1)
    momentum: float = Field(0.0, ge=0, le=1)


class SchedulerSpec(_Strict):
    """The live schedule. Only its *position* is persisted; this spec decides the values."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    warmup: StrictInt = Field(0, ge=0, le=MAX_STEPS, description="Warmup length in `unit`s (linear ramp from 0).")
    unit: Literal["optimizer_steps", "epochs"] = "optimizer_steps"
    total: StrictInt | None = Field(None, ge=1, le=MAX_STEPS, description="Horizon in `unit`s; default: the run's length.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class TrainSpec(_Strict):
    micro_batch_size: StrictInt = Field(..., ge=1, le=MAX_MICRO_BATCH, description="Samples per rank per micro-batch.")
    grad_accum: StrictInt = Field(1, ge=1, le=MAX_GRAD_ACCUM, description="Micro-batches per optimizer step (the epoch end flushes a short cycle).")
    epochs: StrictInt | None = Field(None, ge=1, le=MAX_EPOCHS)
    max_steps: StrictInt | None = Field(None, ge=1, le=MAX_STEPS, description="Stop after this many optimizer steps.")
    seed: StrictInt = Field(0, ge=0, le=MAX_SEED)
    lr: float = Field(1e-3, gt=0, le=MAX_LR)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    gradient_clipping: float = Field(0.0, ge=0)
    dataloader_workers: StrictInt = Field(0, ge=0, le=MAX_DATALOADER_WORKERS, description="torch DataLoader worker processes.")
    record_samples: bool = Field(False, description="Log the sample ids of every optimizer step (audits, elastic tests).")
    log_every: StrictInt = Field(10, ge=1, le=MAX_STEPS, description="Print progress every N optimizer steps.")
    deterministic: bool = Field(True, description=(
        "GPU: deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG) so a resumed "
        "run is bitwise the uninterrupted one; false trades that for speed. CPU runs are deterministic anyway."))

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer_shorthand(cls, v: Any) -> Any:
        return {"type": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _length(self) -> "TrainSpec":
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set train.epochs or train.max_steps (or both: whichever ends first)")
        return self


# words that name a credential in a config key: api_key, apiKey, token, password, secret, key, ...
_SECRET_WORDS = {"key", "apikey", "token", "password", "passwd", "pwd", "secret", "credential", "credentials"}


def _key_words(key: str) -> list[str]:
    """'wandb.apiKey' / 'API-KEY' / 'api_key' -> ['api', 'key'] (camelCase split, case folded)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def _secret_keys(obj: Any, path: str = "deepspeed.config", depth: int = 0) -> list[str]:
    """Dotted paths of every key in ``obj`` (recursively, lists included) that names a secret.

    Why refuse rather than strip: DeepSpeed pickles its config into every ``mp_rank_*.pt``; a
    stripped key would silently turn a monitor off, a refusal says where the secret belongs.
    """
    found: list[str] = []
    if depth > MAX_YAML_DEPTH:
        return found
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        here = f"{path}.{k}"
        words = _key_words(str(k)) if isinstance(k, str) else []
        if isinstance(k, str) and (_SECRET_WORDS & set(words) or "".join(words) in _SECRET_WORDS):
            found.append(here)
        found += _secret_keys(v, here, depth + 1)
    return found


class DeepSpeedSpec(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Offload: optimizer state and step on the CPU (ZeRO 1-3; Adam/AdamW use DeepSpeed's CPU Adam).")
    offload_params: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Infinity parameter offload to the CPU (ZeRO 3 only).")
    config: dict[str, Any] = Field(default_factory=dict, description="Passthrough DeepSpeed config keys.")

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> "DeepSpeedSpec":
        """DeepSpeed offloads only what ZeRO partitions: the optimizer from stage 1, parameters at 3."""
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError("deepspeed.offload_optimizer needs deepspeed.zero_stage 1, 2 or 3 (ZeRO 0 does not "
                             "partition the optimizer, so DeepSpeed has nothing to offload)")
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_params needs deepspeed.zero_stage: 3 (only ZeRO-3 partitions parameters)")
        return self

    @field_validator("config")
    @classmethod
    def _no_conflicts(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "zero_optimization", "optimizer", "scheduler", "bf16", "fp16"}
        clash = sorted(owned & set(v))
        if clash:
            raise ValueError(
                f"keys {clash} are set by syncpoint from train.* and deepspeed.zero_stage/precision; "
                "set them there instead")
        secrets = _secret_keys(v)
        if secrets:
            raise ValueError(
                f"{', '.join(secrets[:5])} look{'s' if len(secrets) == 1 else ''} like a secret (a key, token or password). "
                "DeepSpeed stores its whole config inside every checkpoint file (mp_rank_*.pt), so it would land in "
                "storage: remove it and give it to the workers as an environment variable instead (the monitors read "
                "WANDB_API_KEY, COMET_API_KEY, ...; set it from a secret store or a Kubernetes Secret)")
        return v


class SaveEvery(_Strict):
    value: float = Field(..., ge=0, le=MAX_STEPS, description="0 disables periodic saves.")
    unit: Literal["micro_steps", "optimizer_steps", "seconds"]

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, str):
            parts = v.split()
            if len(parts) != 2:
                raise ValueError("write it as '<number> <unit>', e.g. '200 micro_steps', or {value, unit}")
            return {"value": parts[0], "unit": parts[1]}
        return v

    @model_validator(mode="after")
    def _integral(self) -> "SaveEvery":
        if self.unit != "seconds" and self.value != int(self.value):
            raise ValueError(f"{self.unit} must be a whole number")
        return self


class CheckpointSpec(_Strict):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    save_every: SaveEvery = Field(default_factory=lambda: SaveEvery(value=0, unit="optimizer_steps"))
    save_trigger: str | None = Field(None, max_length=MAX_IMPORT_PATH_CHARS,
                                     description="Custom trigger 'pkg.mod:Class' (replaces save_every).")

    @field_validator("save_trigger")
    @classmethod
    def _trigger_path(cls, v: str | None) -> str | None:
        if v is not None and not _is_import_path(v):
            raise ValueError("must look like 'package.module:Class' (a class with wants_save(tick) -> bool)")
        return v
    keep_last: StrictInt = Field(3, ge=0, le=MAX_COUNT, description="Resumable states to keep; 0 keeps all.")
    prune_unsafe: bool = False
    export_final: bool = Field(True, description="Write consolidated safetensors to <run>/final/.")
    async_save: bool = Field(False, alias="async", description=(
        "Only the snapshot to local staging blocks training; the upload runs in the background and "
        "the manifest commits once every rank's upload finished (at most one save in flight)."))
    checksum: Literal["xxh3_128", "sha256"] = Field("xxh3_128", description=(
        "Checksum of every file in a state's manifest, verified before anything is loaded: xxh3_128 "
        "(fast, guards against torn and corrupt files) or sha256 (cryptographic, ~7x slower)."))
    signing_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", description=(
        "Name of an environment variable holding a key (>= 32 bytes): rank 0 signs every manifest with "
        "HMAC-SHA256, and selection refuses unsigned or wrongly signed states as untrusted. Needs "
        "checksum: sha256."))

    @model_validator(mode="after")
    def _signed_needs_sha256(self) -> "CheckpointSpec":
        if self.signing_key_env and self.checksum != "sha256":
            raise ValueError("checkpoint.signing_key_env needs checkpoint.checksum: sha256 (a signature over xxh3_128 "
                             "checksums would not authenticate the files: xxh3 is not collision-resistant)")
        return self


class ResumeSpec(_Strict):
    policy: str = Field("newest-resumable", max_length=MAX_IMPORT_PATH_CHARS,
                        description="newest-resumable | pinned | fresh | best-metric | pkg.mod:Class")

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, v: str) -> str:
        if v not in BUILTIN_POLICIES and not _is_import_path(v):
            raise ValueError(f"must be one of {', '.join(BUILTIN_POLICIES)}, or 'package.module:Class' for your own")
        return v
    policy_args: dict[str, Any] = Field(default_factory=dict)
    init_from: str | None = Field(None, max_length=MAX_PATH_CHARS, description="State URL to take weights from (fine-tune).")
    init_optimizer: bool = Field(False, description="With init_from: also import optimizer state.")
    init_from_signing_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", description=(
        "With init_from: the environment variable holding the source run's signing key; its state must be "
        "signed with it. Default: this run's checkpoint.signing_key_env, when set."))
    reset_schedule: bool = Field(False, description="Opt-out: restart the LR schedule at 0 on resume.")
    reset_optimizer: bool = Field(False, description=(
        "Opt-out: keep the state's weights and position but start the optimizer state (moments) fresh, e.g. "
        "after changing train.optimizer.type. Without it such a change is refused at selection."))
    on_existing: Literal["refuse", "archive", "overwrite"] = "refuse"
    lease_ttl_s: float = Field(60.0, gt=0, le=MAX_LEASE_TTL_S, description=(
        "The run directory's lease expires this long after its owner's last heartbeat; then a "
        "successor of the same job may take over."))


class FailureSpec(_Strict):
    """Named after Ray Train's ``FailureConfig``."""

    max_failures: StrictInt = Field(0, ge=-1, le=MAX_COUNT, description="Application-error restarts (-1: unlimited).")
    max_preemptions: StrictInt = Field(-1, ge=-1, le=MAX_COUNT, description="Preemption restarts (-1: unlimited).")


class CrashFault(_Strict):
    """Rehearse preemption: crash ``rank`` once per run, at a micro-step or a save phase."""

    rank: StrictInt = Field(0, ge=0, le=MAX_WORKERS)
    at_micro_step: StrictInt | None = Field(None, ge=1, le=MAX_MICRO_STEPS)
    phase: Literal["before_shards", "after_some_shards", "before_manifest", "during_manifest",
                   "before_retention", "during_retention"] | None = None
    at_save: StrictInt = Field(1, ge=1, le=MAX_COUNT, description="With phase: which save (1 = first) of the run.")
    mode: Literal["exit", "raise", "sigterm"] = Field(
        "exit", description="exit: os._exit (hard crash); raise: exception (in-process tests); sigterm: a preemption "
                            "notice, then the process dies after the next boundary's save (at_micro_step only).")

    @model_validator(mode="after")
    def _one_trigger(self) -> "CrashFault":
        if (self.at_micro_step is None) == (self.phase is None):
            raise ValueError("a fault needs exactly one of at_micro_step or phase")
        if self.mode == "sigterm" and self.phase is not None:
            raise ValueError("mode sigterm needs at_micro_step (a notice arrives between micro-steps)")
        if self.phase in ("before_manifest", "during_manifest", "during_retention") and self.rank != 0:
            raise ValueError(f"phase {self.phase} happens on rank 0 only (it writes the manifest and runs "
                             "retention): use rank: 0, or a phase every rank passes (before_shards, "
                             "after_some_shards, before_retention)")
        return self

    @property
    def fault_id(self) -> str:
        where = f"step{self.at_micro_step}" if self.at_micro_step else f"{self.phase}-save{self.at_save}"
        return f"rank{self.rank}-{where}"


class JobSpec(_Strict):
    name: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    storage: str = Field("./runs", max_length=MAX_PATH_CHARS,
                         description="fsspec URL or path; resolved to an absolute URL on the driver.")
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    task: TaskSpec
    train: TrainSpec
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resume: ResumeSpec = Field(default_factory=ResumeSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    faults: list[CrashFault] = Field(default_factory=list, max_length=MAX_FAULTS)

    @model_validator(mode="after")
    def _combinations(self) -> "JobSpec":
        if self.deepspeed.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("deepspeed.precision fp16 needs scaling.use_gpu: true (use fp32 or bf16 on CPU)")
        for f in self.faults:
            if f.rank >= self.scaling.max_workers:
                raise ValueError(f"faults: rank {f.rank} does not exist with scaling.num_workers={self.scaling.max_workers}")
        if self.scaling.elastic:
            from policies.elastic import allowed_world_sizes

            lo, hi = self.scaling.min_workers, self.scaling.max_workers
            ok = allowed_world_sizes(self.train.micro_batch_size, self.train.grad_accum, lo, hi)
            bad = [w for w in range(lo, hi + 1) if w not in ok]
            if bad:
                raise ValueError(
                    f"scaling.num_workers {{min: {lo}, max: {hi}}}: on {_ranges(bad)} worker(s) no whole accumulation "
                    f"keeps the global batch ({self.train.micro_batch_size} x {hi} x {self.train.grad_accum}); world "
                    f"sizes that work: {_ranges(ok)}. Narrow the range or change train.grad_accum")
        if self.train.scheduler.unit == "epochs" and self.train.epochs is None and self.train.scheduler.total is None:
            raise ValueError("train.scheduler.unit epochs needs train.epochs or train.scheduler.total")
        return self

    @property
    def run_url(self) -> str:
        return self.storage.rstrip("/") + "/" + self.name


# ---------------------------------------------------------------- loading and errors


class SpecError(ValueError):
    """Bad input: one paragraph per problem, naming the YAML path (and line) and the fix.

    Why capped and redacted here: every refusal of every entry point goes through this class, and
    a message quoting hostile input (ten thousand unknown keys, a megabyte-long value) or a storage
    URL with credentials must stay a short paragraph that is safe to print and log.
    """

    def __init__(self, source: str, problems: list[str], what: str = "invalid job spec") -> None:
        self.source, self.problems = _one_line(str(source), 200), _cap_problems(problems)
        super().__init__(f"{self.source}: {what}\n" + "\n".join(f"  - {p}" for p in self.problems))


def _one_line(text: str, limit: int) -> str:
    """Redacted, whitespace collapsed to single spaces, at most ``limit`` characters."""
    text = " ".join(redact_text(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cap_problems(problems: list[str]) -> list[str]:
    """Each problem one line of at most MAX_PROBLEM_CHARS, all together under MAX_MESSAGE_CHARS."""
    out: list[str] = []
    used = 200  # the source and headline
    for i, p in enumerate(problems):
        line = _one_line(p, MAX_PROBLEM_CHARS)
        if used + len(line) + 6 > MAX_MESSAGE_CHARS - 80:
            already = re.match(r"\.\.\. and (\d+) more problem", problems[-1])  # a count of unformatted ones
            more = len(problems) - i + (int(already.group(1)) - 1 if already else 0)
            out.append(f"... and {more} more problem(s); fix these first")
            break
        out.append(line)
        used += len(line) + 6
    return out


_TOO_DEEP = (f"nested deeper than {MAX_YAML_DEPTH} levels (aliases expanded); a job spec needs a handful: flatten "
             "task.config, or let the task read deep structures from its own files")


class _YamlBound(yaml.YAMLError):
    """The document exceeds a parse bound (depth, expanded size, a recursive alias)."""

    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        line = f"line {mark.line + 1}: " if mark is not None else ""
        super().__init__(line + message)


class _BoundedComposer(yaml.composer.Composer):
    """A YAML composer that refuses, while composing, what would be too big or too deep to build.

    Why during composition: an alias bomb is a few hundred bytes whose *expansion* is billions of
    nodes (PyYAML shares the aliased node, but everything that walks the result — line mapping,
    validation, JSON output — expands it); a 10,000-deep list overflows the recursive composer.
    Counting here stops both after at most MAX_YAML_NODES steps. An alias counts as a full copy of
    its target's subtree; an alias to a node still being composed (a cycle) is refused outright.
    """

    def __init__(self, base_depth: int = 0) -> None:
        super().__init__()
        self._depth = base_depth  # of the node being composed (the root is base_depth + 1)
        self._deepest = 0  # deepest level reached so far, aliases expanded
        self._nodes = 0  # nodes composed so far, aliases expanded
        self._sizes: dict[str, tuple[int, int]] = {}  # anchor -> (expanded node count, height) of its subtree
        self._open: set[str] = set()  # anchors whose node is being composed

    def _count(self, n: int, mark: yaml.Mark) -> None:
        self._nodes += n
        if self._nodes > MAX_YAML_NODES:
            raise _YamlBound(f"more than {MAX_YAML_NODES} YAML nodes once aliases are expanded (an alias bomb?); "
                             "a job spec is small: let the task read large data from its own files", mark)

    def _reach(self, level: int, mark: yaml.Mark) -> None:
        if level > MAX_YAML_DEPTH:
            raise _YamlBound(_TOO_DEEP, mark)
        self._deepest = max(self._deepest, level)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:  # noqa: D102
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise _YamlBound(f"alias *{event.anchor} refers to a node that contains it (a recursive structure); "
                                 "a job spec must be a tree: copy the values instead", event.start_mark)
            node = super().compose_node(parent, index)  # an undefined alias raises ComposerError here
            size, height = self._sizes.get(event.anchor, (1, 1))
            self._reach(self._depth + height, event.start_mark)
            self._count(size, event.start_mark)
            return node
        self._depth += 1
        self._reach(self._depth, event.start_mark)
        nodes_before, deepest_before, anchor = self._nodes, self._deepest, event.anchor
        self._deepest = self._depth
        self._count(1, event.start_mark)
        if anchor is not None:
            self._open.add(anchor)
        node = super().compose_node(parent, index)
        if anchor is not None:
            self._open.discard(anchor)
            self._sizes[anchor] = (self._nodes - nodes_before, self._deepest - self._depth + 1)
        self._deepest = max(self._deepest, deepest_before)
        self._depth -= 1
        return node


class _PyLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, _BoundedComposer,
                yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """yaml.SafeLoader with the bounded composer (pure Python events)."""

    def __init__(self, stream: str, base_depth: int = 0) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        _BoundedComposer.__init__(self, base_depth)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)


def _construct_int(loader: Any, node: yaml.ScalarNode) -> int:
    """Python refuses int() of more than 4300 digits with a bare ValueError; refuse far earlier, with the line."""
    if len(node.value) > 64:
        raise _YamlBound(f"an integer of {len(node.value)} characters; integers in a job spec have at most 19 "
                         "digits", node.start_mark)
    return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)


_PyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_BoundedLoader: Any = _PyLoader
if getattr(yaml, "__with_libyaml__", False):
    from yaml._yaml import CParser

    class _CLoader(_BoundedComposer, yaml.constructor.SafeConstructor, yaml.resolver.Resolver, CParser):
        """The same with libyaml's parser producing the events: scanning is ~8x faster than in Python,
        and composition (where the bounds are checked) stays in Python."""

        def __init__(self, stream: str, base_depth: int = 0) -> None:
            CParser.__init__(self, stream)
            _BoundedComposer.__init__(self, base_depth)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    _CLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
    _BoundedLoader = _CLoader


def _bounded_yaml(text: str, base_depth: int = 0) -> tuple[yaml.Node | None, Any]:
    """(root node, constructed data) of one YAML document, within the parse bounds (``base_depth``:
    levels above the document's root, e.g. the dotted key of a ``--set``).

    Raises ``yaml.YAMLError`` (``_YamlBound`` for a bound) or ``ValueError`` (an integer literal
    longer than Python converts, 4300 digits).
    """
    loader = _BoundedLoader(text, base_depth)
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    finally:
        loader.dispose()


def _line_index(node: yaml.Node, path: tuple = (), duplicates: list[str] | None = None,
                out: dict[tuple, int] | None = None) -> dict[tuple, int]:
    """Map every YAML path to its 1-based line so errors can point at it (and note duplicate keys).

    One shared ``out`` dict (not a merge per level): linear in the (bounded) expanded size.
    """
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else f"<{k.tag}>"
            if key in seen and duplicates is not None:
                dotted = ".".join(str(p) for p in (*path, key))
                duplicates.append(f"{dotted}: duplicate key (lines {seen[key]} and {k.start_mark.line + 1}); YAML would "
                                  "silently keep the last one. Merge them into one")
            seen[key] = k.start_mark.line + 1
            out[path + (key,)] = k.start_mark.line + 1
            _line_index(v, path + (key,), duplicates, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _line_index(v, path + (i,), duplicates, out)
    return out


_ALLOWED_HINT = {
    "extra_forbidden": "unknown key; allowed keys here are: {allowed}",
}


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = JobSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
        if model is None:
            return []
    return sorted((f.alias or name) for name, f in getattr(model, "model_fields", {}).items())


def _model_in(ann: Any, depth: int = 0) -> Any:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``Annotated[Union[int, X], ...]``)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if depth > 4:
        return None
    return next((m for a in getattr(ann, "__args__", ()) if (m := _model_in(a, depth + 1)) is not None), None)


def _format_errors(err: ValidationError, lines: dict[tuple, int]) -> list[str]:
    out = []
    errors = err.errors(include_url=False)
    for e in errors[:20]:  # the message shows fewer anyway (SpecError caps it)
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        line = lines.get(loc) or lines.get(loc[:-1]) if loc else None
        where = f"{dotted}" + (f" (line {line})" if line else "")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; allowed keys here are: " + ", ".join(_allowed_keys(loc))
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "finite_number":
            msg = "must be a finite number; .inf and .nan are not allowed"
        elif "input" in e and e["type"] not in ("model_type",) and not isinstance(e["input"], dict):
            msg += f" (got {_short_repr(e['input'])})"
        out.append(f"{where}: {msg}")
    if len(errors) > 20:
        out.append(f"... and {len(errors) - 20} more problem(s); fix these first")
    return out


def _short_repr(value: Any, limit: int = 80) -> str:
    """repr() of user input, cut: a megabyte-long value must not become a megabyte-long message."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 4000 else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _yaml_problem(e: Exception) -> str:
    """One line for a YAML (or YAML-bound, or oversized-integer) failure, with its line when known."""
    if isinstance(e, _YamlBound):
        return str(e)
    if "nesting depth" in str(getattr(e, "problem", "")):  # libyaml's own limit (1000 flow levels)
        return _YamlBound(_TOO_DEEP, getattr(e, "problem_mark", None)).args[0]
    if isinstance(e, ValueError):  # int("9" * 5000): Python's 4300-digit conversion limit
        return "a number is too long to be read; integers here are at most 19 digits"
    mark = getattr(e, "problem_mark", None)
    line = f" (line {mark.line + 1})" if mark else ""
    return f"not valid YAML{line}: {getattr(e, 'problem', None) or e}"


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set a.b=value`` (value parsed as YAML, within the same bounds as a job file)."""
    if sum(len(o) for o in overrides) > MAX_SPEC_BYTES:
        raise SpecError("--set", [f"the overrides are longer than {MAX_SPEC_BYTES} characters together; put large "
                                  "values in the job file or in files the task reads"], "invalid argument")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError("--set", [f"{_short_repr(item)}: write overrides as a.b=value"], "invalid argument")
        parts = key.split(".")
        if len(parts) >= MAX_YAML_DEPTH:
            raise SpecError("--set", [f"{_short_repr(key)}: nested deeper than {MAX_YAML_DEPTH} levels; a job spec "
                                      "needs a handful"], "invalid argument")
        node = raw
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise SpecError("--set", [f"{key}: {p} is not a mapping, cannot set a key inside it (set the whole "
                                          f"value instead, e.g. --set '{p}=[...]')"], "invalid argument")
            node = nxt
        try:
            node[parts[-1]] = _bounded_yaml(value, base_depth=len(parts))[1]
        except (yaml.YAMLError, ValueError) as e:
            raise SpecError("--set", [f"{_short_repr(key)}={_short_repr(value, 60)}: {_yaml_problem(e)}; quote "
                                      "strings and close brackets, e.g. --set 'faults=[]'"],
                            "invalid argument") from None
    return raw


def read_spec_file(path: str | os.PathLike[str]) -> str:
    """The job file's text, reading at most MAX_SPEC_BYTES + 1 bytes (``/dev/zero`` is refused, not read)."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(source, [f"cannot read the job file: {e.strerror or e}; check the path"]) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(source, [f"the job file is larger than {MAX_SPEC_BYTES} bytes (a job spec is a few hundred): "
                                 "check the path, and let the task read large data from its own files"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(source, ["the job file is not UTF-8 text; save it as UTF-8 YAML"]) from None


def load_spec(path: str | os.PathLike[str], overrides: list[str] | None = None) -> JobSpec:
    """Load, override and validate a job file; every failure is a ``SpecError``."""
    return parse_spec(read_spec_file(path), str(path), overrides)


def parse_spec(text: str, source: str = "<spec>", overrides: list[str] | None = None) -> JobSpec:
    """Parse (within the size, depth and alias bounds), override and validate a job spec."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(source, [f"the job spec is larger than {MAX_SPEC_BYTES} characters (a job spec is a few "
                                 "hundred); let the task read large data from its own files"])
    try:
        node, raw = _bounded_yaml(text)
    except (yaml.YAMLError, ValueError) as e:
        raise SpecError(source, [_yaml_problem(e)]) from None
    if not isinstance(raw, dict):
        raise SpecError(source, ["the top level must be a mapping with at least name, task and train"])
    duplicates: list[str] = []
    lines = _line_index(node, (), duplicates) if node is not None else {}
    if duplicates:
        raise SpecError(source, duplicates)
    raw = apply_overrides(raw, overrides or [])
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(source, _format_errors(e, lines)) from None


def resolve_storage(spec: JobSpec, base_dir: str | None = None) -> JobSpec:
    """Make ``storage`` an absolute URL on the driver: Ray workers run in another directory."""
    s = spec.storage
    scheme, sep, rest = s.partition("://")
    if sep and not rest.strip("/"):
        raise SpecError("storage", [f"storage {s!r} names no location; write an absolute path (/data/runs), "
                                    "file:///data/runs, or an object-store URL such as s3://bucket/prefix"])
    if "://" not in s and not os.path.isabs(os.path.expanduser(s)) and "runtime_resources" in os.getcwd():
        raise SpecError("storage", [
            f"storage {s!r} is relative, and this driver runs in a Ray job's temporary working directory "
            f"({os.getcwd()}): states would vanish with the job. Set storage to an absolute path every node "
            "shares or an object-store URL (s3://...), e.g. --set storage=s3://bucket/syncpoint"])
    if "://" not in s:
        s = "file://" + os.path.abspath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(s)))
    return spec.model_copy(update={"storage": s.rstrip("/")})


def spec_to_json(spec: JobSpec, redact: bool = True) -> str:
    """The normalized spec as JSON; with ``redact`` (the default: it is for printing), URL credentials
    anywhere in it (storage, resume.init_from, task.config) are replaced by ``***``."""
    data = spec.model_dump(mode="json")
    return json.dumps(redact_obj(data) if redact else data, indent=2, sort_keys=False)


def job_schema() -> dict[str, Any]:
    return JobSpec.model_json_schema()
