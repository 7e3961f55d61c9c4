"""The job spec: one pydantic model, loaded from YAML, that validates itself.

Why pydantic with ``extra="forbid"`` everywhere: a typo in a job file must be an error that names
the YAML path (and line) and says what is allowed, not a silently ignored key that changes the
run. Cross-field rules (``epochs`` or ``max_steps``, units, ZeRO stage vs precision) live in model
validators so every entry point (CLI, Ray job, tests) gets the same answers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator


BUILTIN_POLICIES = ("newest-resumable", "pinned", "fresh", "best-metric")


def _is_import_path(v: str) -> bool:
    mod, _, attr = v.partition(":")
    return bool(mod and attr) and all(p.isidentifier() for p in mod.split(".")) and attr.isidentifier()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ElasticWorkers(_Strict):
    min: StrictInt = Field(..., ge=1)
    max: StrictInt = Field(..., ge=1)

    @model_validator(mode="after")
    def _order(self) -> "ElasticWorkers":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class ScalingSpec(_Strict):
    """Named after Ray Train's ``ScalingConfig``."""

    num_workers: Union[StrictInt, ElasticWorkers] = Field(1, description=(
        "Ray Train workers (one torch rank each), or {min, max} to continue on whatever number Ray "
        "can place (elastic; train.grad_accum is then stated for max workers)."))
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs reserved per worker.")
    use_gpu: bool = Field(False, description="One GPU per worker; NCCL instead of gloo.")

    @field_validator("num_workers")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (or {min, max} for elastic training)")
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
    path: str = Field(..., description="Import path 'package.module:function' returning a Task.")
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
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    momentum: float = Field(0.0, ge=0)


class SchedulerSpec(_Strict):
    """The live schedule. Only its *position* is persisted; this spec decides the values."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    warmup: StrictInt = Field(0, ge=0, description="Warmup length in `unit`s (linear ramp from 0).")
    unit: Literal["optimizer_steps", "epochs"] = "optimizer_steps"
    total: StrictInt | None = Field(None, ge=1, description="Horizon in `unit`s; default: the run's length.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class TrainSpec(_Strict):
    micro_batch_size: StrictInt = Field(..., ge=1, description="Samples per rank per micro-batch.")
    grad_accum: StrictInt = Field(1, ge=1, description="Micro-batches per optimizer step (the epoch end flushes a short cycle).")
    epochs: StrictInt | None = Field(None, ge=1)
    max_steps: StrictInt | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    seed: StrictInt = Field(0, ge=0)
    lr: float = Field(1e-3, gt=0)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    gradient_clipping: float = Field(0.0, ge=0)
    dataloader_workers: StrictInt = Field(0, ge=0, description="torch DataLoader worker processes.")
    record_samples: bool = Field(False, description="Log the sample ids of every optimizer step (audits, elastic tests).")
    log_every: StrictInt = Field(10, ge=1, description="Print progress every N optimizer steps.")
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


class DeepSpeedSpec(_Strict):
    zero_stage: Literal[0, 1, 2] = 2
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    config: dict[str, Any] = Field(default_factory=dict, description="Passthrough DeepSpeed config keys.")

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
        return v


class SaveEvery(_Strict):
    value: float = Field(..., ge=0, description="0 disables periodic saves.")
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
    save_trigger: str | None = Field(None, description="Custom trigger 'pkg.mod:Class' (replaces save_every).")

    @field_validator("save_trigger")
    @classmethod
    def _trigger_path(cls, v: str | None) -> str | None:
        if v is not None and not _is_import_path(v):
            raise ValueError("must look like 'package.module:Class' (a class with wants_save(tick) -> bool)")
        return v
    keep_last: StrictInt = Field(3, ge=0, description="Resumable states to keep; 0 keeps all.")
    prune_unsafe: bool = False
    export_final: bool = Field(True, description="Write consolidated safetensors to <run>/final/.")
    async_save: bool = Field(False, alias="async", description=(
        "Only the snapshot to local staging blocks training; the upload runs in the background and "
        "the manifest commits once every rank's upload finished (at most one save in flight)."))
    checksum: Literal["xxh3_128", "sha256"] = Field("xxh3_128", description=(
        "Checksum of every file in a state's manifest, verified before anything is loaded: xxh3_128 "
        "(fast, guards against torn and corrupt files) or sha256 (cryptographic, ~7x slower)."))


class ResumeSpec(_Strict):
    policy: str = Field("newest-resumable", description="newest-resumable | pinned | fresh | best-metric | pkg.mod:Class")

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, v: str) -> str:
        if v not in BUILTIN_POLICIES and not _is_import_path(v):
            raise ValueError(f"must be one of {', '.join(BUILTIN_POLICIES)}, or 'package.module:Class' for your own")
        return v
    policy_args: dict[str, Any] = Field(default_factory=dict)
    init_from: str | None = Field(None, description="State URL to take weights from (fine-tune).")
    init_optimizer: bool = Field(False, description="With init_from: also import optimizer state.")
    reset_schedule: bool = Field(False, description="Opt-out: restart the LR schedule at 0 on resume.")
    on_existing: Literal["refuse", "archive", "overwrite"] = "refuse"
    lease_ttl_s: float = Field(60.0, gt=0, description=(
        "The run directory's lease expires this long after its owner's last heartbeat; then a "
        "successor of the same job may take over."))


class FailureSpec(_Strict):
    """Named after Ray Train's ``FailureConfig``."""

    max_failures: StrictInt = Field(0, ge=-1, description="Application-error restarts (-1: unlimited).")
    max_preemptions: StrictInt = Field(-1, ge=-1, description="Preemption restarts (-1: unlimited).")


class CrashFault(_Strict):
    """Rehearse preemption: crash ``rank`` once per run, at a micro-step or a save phase."""

    rank: StrictInt = Field(0, ge=0)
    at_micro_step: StrictInt | None = Field(None, ge=1)
    phase: Literal["before_shards", "after_some_shards", "before_manifest", "during_manifest",
                   "before_retention", "during_retention"] | None = None
    at_save: StrictInt = Field(1, ge=1, description="With phase: which save (1 = first) of the run.")
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
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    storage: str = Field("./runs", description="fsspec URL or path; resolved to an absolute URL on the driver.")
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    task: TaskSpec
    train: TrainSpec
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resume: ResumeSpec = Field(default_factory=ResumeSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    faults: list[CrashFault] = Field(default_factory=list)

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
                    f"scaling.num_workers {{min: {lo}, max: {hi}}}: on {bad} worker(s) no whole accumulation keeps the "
                    f"global batch ({self.train.micro_batch_size} x {hi} x {self.train.grad_accum}); world sizes that "
                    f"work: {ok}. Narrow the range or change train.grad_accum")
        if self.train.scheduler.unit == "epochs" and self.train.epochs is None and self.train.scheduler.total is None:
            raise ValueError("train.scheduler.unit epochs needs train.epochs or train.scheduler.total")
        return self

    @property
    def run_url(self) -> str:
        return self.storage.rstrip("/") + "/" + self.name


# ---------------------------------------------------------------- loading and errors


class SpecError(ValueError):
    """Bad input: one paragraph per problem, naming the YAML path (and line) and the fix."""

    def __init__(self, source: str, problems: list[str], what: str = "invalid job spec") -> None:
        self.source, self.problems = source, problems
        super().__init__(f"{source}: {what}\n" + "\n".join(f"  - {p}" for p in problems))


def _line_index(node: yaml.Node, path: tuple = (), duplicates: list[str] | None = None) -> dict[tuple, int]:
    """Map every YAML path to its 1-based line so errors can point at it (and note duplicate keys)."""
    out = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = k.value
            if key in seen and duplicates is not None:
                dotted = ".".join(str(p) for p in (*path, key))
                duplicates.append(f"{dotted}: duplicate key (lines {seen[key]} and {k.start_mark.line + 1}); YAML would "
                                  "silently keep the last one. Merge them into one")
            seen[key] = k.start_mark.line + 1
            out[path + (key,)] = k.start_mark.line + 1
            out.update({p: l for p, l in _line_index(v, path + (key,), duplicates).items() if p != path + (key,)})
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out.update(_line_index(v, path + (i,), duplicates))
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
        ann = field.annotation
        args = getattr(ann, "__args__", ())
        model = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return []
    return sorted((f.alias or name) for name, f in getattr(model, "model_fields", {}).items())


def _format_errors(err: ValidationError, lines: dict[tuple, int]) -> list[str]:
    out = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        line = lines.get(loc) or lines.get(loc[:-1]) if loc else None
        where = f"{dotted}" + (f" (line {line})" if line else "")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; allowed keys here are: " + ", ".join(_allowed_keys(loc))
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and e["type"] not in ("model_type",) and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        out.append(f"{where}: {msg}")
    return out


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set a.b=value`` (value parsed as YAML) to the raw mapping."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError("--set", [f"{item!r}: write overrides as a.b=value"], "invalid argument")
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise SpecError("--set", [f"{key}: {p} is not a mapping, cannot set a key inside it (set the whole "
                                          f"value instead, e.g. --set '{p}=[...]')"], "invalid argument")
            node = nxt
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise SpecError("--set", [f"{key}={value}: the value is not valid YAML ({getattr(e, 'problem', e)}); "
                                      "quote strings and close brackets, e.g. --set 'faults=[]'"],
                            "invalid argument") from None
    return raw


def load_spec(path: str | os.PathLike[str], overrides: list[str] | None = None) -> JobSpec:
    """Load, override and validate a job file; every failure is a ``SpecError``."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SpecError(source, [f"cannot read the job file: {e.strerror or e}; check the path"]) from None
    except UnicodeDecodeError:
        raise SpecError(source, ["the job file is not UTF-8 text; save it as UTF-8 YAML"]) from None
    return parse_spec(text, source, overrides)


def parse_spec(text: str, source: str = "<spec>", overrides: list[str] | None = None) -> JobSpec:
    try:
        node = yaml.compose(text)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark else ""
        raise SpecError(source, [f"not valid YAML{line}: {getattr(e, 'problem', e)}"]) from None
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


def spec_to_json(spec: JobSpec) -> str:
    return json.dumps(spec.model_dump(mode="json"), indent=2, sort_keys=False)


def job_schema() -> dict[str, Any]:
    return JobSpec.model_json_schema()
