"""The job spec: one pydantic model that validates itself (loading YAML lives in ``syncpoint.orchestrator.spec_file``).

Why a leaf module in ``policies/``: every layer reads the spec (the driver parses it, the
workers train by it, decisions compare against it), so it imports nothing of the project but
other leaves; the YAML parser, line mapping and ``--set`` overrides are the driver's business.

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
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    field_validator,
    model_validator,
)

from syncpoint.policies.contracts.import_path import is_import_path
from syncpoint.policies.decisions.redact import redact_env, redact_obj

BUILTIN_POLICIES = ("newest-resumable", "pinned", "fresh", "best-metric")

# ---- input bounds (docs/reference/spec.md, "Bounds"). Generous for any real job, small enough
# that validating the worst allowed spec takes milliseconds.
MAX_SPEC_BYTES = 1 << 20  # job file size; a spec is a few hundred bytes
MAX_YAML_DEPTH = 32  # nesting levels, the document root included
MAX_YAML_NODES = 10_000  # YAML nodes after alias expansion (an alias counts as a copy of its target)
MAX_WORKERS = 4096  # Ray Train workers (torch ranks)
MAX_CPUS_PER_WORKER = 1024.0
MAX_MICRO_BATCH = 1 << 20  # samples per rank per micro-batch
MAX_GRAD_ACCUM = 1 << 16
MAX_STEPS = 10**9  # optimizer steps, schedule lengths, save/log intervals
MAX_EPOCHS = 10**6
MAX_MICRO_STEPS = 10**12  # state names are 12-digit global micro-steps
MAX_COUNT = 10**6  # keep_last, restarts, the save ordinal of a fault
MAX_DATALOADER_WORKERS = 256
MAX_STREAM_SHUFFLE_BUFFER = 1 << 20  # examples a stream's shuffle buffer holds (saved with every state)
MAX_SEED = (1 << 63) - 1  # torch and numpy take 64-bit seeds; 63 bits survive every signed cast
MAX_LR = 100.0  # above this it is a typo (1e3 for 1e-3), not a learning rate
MAX_LEASE_TTL_S = 7 * 24 * 3600.0  # a crashed owner blocks its successors this long at most
MAX_PATH_CHARS = 4096  # storage and state URLs
MAX_NAME_CHARS = 200  # the run directory's name (file systems stop at 255 bytes)
MAX_IMPORT_PATH_CHARS = 512
MAX_NO_DECAY_PATTERNS = 256  # train.optimizer.no_decay entries
MAX_PATTERN_CHARS = 256  # one no_decay name pattern
MAX_POWER = 100.0  # a polynomial schedule's exponent: beyond this the rate is 0 after the first step anyway
MAX_FAULTS = 1000
MAX_COLLECTIVE_TIMEOUT_S = 24 * 3600  # one collective's wait; a day is already a hang
MAX_PREEMPTIONS_PER_HOUR = 3600.0  # one a second: beyond that no state could ever commit
MAX_WINDOW_SHARDS = 1 << 16  # shards a shuffle window spans (each must fit the local cache)
MAX_CACHE_BYTES = 1 << 50  # a local shard cache of a petabyte is a typo
MAX_FETCH_CONCURRENCY = 64


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
    """``scaling.num_workers: {min, max}``: the world sizes an elastic run may continue on."""

    min: StrictInt = Field(..., ge=1, le=MAX_WORKERS, description="The fewest workers the run continues on.")
    max: StrictInt = Field(
        ..., ge=1, le=MAX_WORKERS, description=("The most workers; train.grad_accum is stated for this many.")
    )

    @model_validator(mode="after")
    def _order(self) -> ElasticWorkers:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


def _workers_kind(v: Any) -> str:
    """Which form of ``num_workers`` this is; the ``tagged-`` prefix keeps it out of error paths."""
    return "tagged-elastic" if isinstance(v, (dict, ElasticWorkers)) else "tagged-fixed"


# a tagged union: an elastic range's error is about its min/max only, not also "not an integer"
MAX_ENV_VARS = 256  # scaling.env entries
MAX_ENV_VALUE_CHARS = 32 << 10  # one value; a path or a URL is well under it
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# what syncpoint sets for every rank, and where it comes from (the reason a scaling.env entry for it is refused)
_DISTRIBUTED = "torch.distributed's, one per rank"
RESERVED_ENV = {
    "PYTHONHASHSEED": "from train.seed, the same in every attempt",
    "PYTHONPATH": "the driver's working directory and its own PYTHONPATH: set it where `syncpoint run` runs",
    **dict.fromkeys(
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"),
        _DISTRIBUTED,
    ),
}


def _job_env(v: Any) -> Any:
    """``scaling.env``: names a shell would take (and no variable syncpoint sets per rank), string values
    (numbers are written as they read; anything else, or a NUL, is refused, naming the variable)."""
    if not isinstance(v, dict):  # said without the value: it may be a credential
        raise ValueError(f"must be a mapping of NAME: value (e.g. {{DATA_DIR: /data}}), not a {type(v).__name__}")
    if len(v) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} variables")
    out: dict[str, str] = {}
    for name, value in v.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ValueError(
                f"{str(name)[:80]!r} is not an environment variable name: letters, digits and _, not starting "
                "with a digit, at most 128 characters (e.g. DATA_DIR)"
            )
        if name in RESERVED_ENV:
            raise ValueError(f"{name} is syncpoint's to set for every rank ({RESERVED_ENV[name]}): remove it")
        if isinstance(value, bool):
            raise ValueError(f"{name}: a value must be a string: quote it ({name}: '{str(value).lower()}')")
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"{name}: a value must be a string, not a {type(value).__name__}")
        text = value if isinstance(value, str) else str(value)
        if "\x00" in text or len(text) > MAX_ENV_VALUE_CHARS:
            raise ValueError(f"{name}: a value holds no NUL character and at most {MAX_ENV_VALUE_CHARS} characters")
        out[name] = text
    return out


_Workers = Annotated[
    Annotated[StrictInt, Tag("tagged-fixed")] | Annotated[ElasticWorkers, Tag("tagged-elastic")],
    Discriminator(_workers_kind),
]


class ScalingSpec(_Strict):
    """Named after Ray Train's ``ScalingConfig``."""

    num_workers: _Workers = Field(
        1,
        description=(
            "Ray Train workers (one torch rank each, at most 4096), or {min, max} for elastic training: the run "
            "continues on whatever number in the range Ray can place (train.grad_accum is then stated for max workers)."
        ),
    )
    cpus_per_worker: float = Field(
        1.0,
        gt=0,
        le=MAX_CPUS_PER_WORKER,
        description=(
            "CPUs reserved per worker; also the intra-op thread count, so results do not depend on the host's cores."
        ),
    )
    use_gpu: bool = Field(
        False,
        description=(
            "One GPU per worker (the one at LOCAL_RANK), NCCL instead of gloo; batches are moved to it for you."
        ),
    )
    collective_timeout_s: StrictInt = Field(
        600,
        ge=1,
        le=MAX_COLLECTIVE_TIMEOUT_S,
        description=(
            "Seconds any one collective (gloo or NCCL, DeepSpeed's own groups included) may wait for its peers "
            "before it fails (torch and Ray Train default to 1800 s): the backstop for a peer that went silent where "
            "Ray's node health check cannot see it. "
            "Every legitimate wait must fit (the slowest rank's save, load or op build at a barrier)."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment variables of every worker process, on any cluster (Ray's runtime_env env_vars), in the "
            "pods `syncpoint k8s` renders and in ranks started without Ray, e.g. {DATA_DIR: /data/owt}; not "
            "PYTHONHASHSEED, PYTHONPATH or torch.distributed's per-rank variables. A name that looks like a "
            "credential's (KEY, TOKEN, SECRET, PASS, AUTH, ...) has its value shown as *** wherever syncpoint prints "
            "or stores the spec, and is refused by `syncpoint submit` and `syncpoint k8s` (their job files are "
            "readable on the cluster: give it from the nodes' own environment or a Kubernetes Secret)."
        ),
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        return _job_env(v)

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
    """``task``: the function that builds the Task, and the config it is called with."""

    path: str = Field(
        ..., max_length=MAX_IMPORT_PATH_CHARS, description="Import path 'package.module:function' returning a Task."
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Passed to the task function as-is.")

    @field_validator("path")
    @classmethod
    def _import_path(cls, v: str) -> str:
        if not is_import_path(v):
            raise ValueError("must look like 'package.module:function' (e.g. examples.tiny_lm:build)")
        return v


class OptimizerSpec(_Strict):
    """``train.optimizer``: the optimizer syncpoint builds when the task brings none (``Task.optimizer``)."""

    type: Literal["adamw", "adam", "sgd"] = Field(
        "adamw", description=("The optimizer; changing it between attempts is refused unless resume.reset_optimizer.")
    )
    weight_decay: float = Field(0.0, ge=0, description="Weight decay of every parameter not matched by no_decay.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="Adam/AdamW betas."
    )
    eps: float = Field(1e-8, gt=0, le=1, description="Adam/AdamW epsilon.")
    momentum: float = Field(0.0, ge=0, le=1, description="SGD momentum.")
    no_decay: list[Annotated[str, Field(min_length=1, max_length=MAX_PATTERN_CHARS)]] | None = Field(
        None,
        max_length=MAX_NO_DECAY_PATTERNS,
        description=(
            "Parameter name patterns (fnmatch, e.g. '*.bias') kept out of weight decay, in a second param group "
            "with weight_decay 0. Default (null): biases and the parameters of normalization modules (LayerNorm, "
            "RMSNorm, GroupNorm, BatchNorm, any module class named *Norm*); [] keeps one group. The split does not "
            "depend on weight_decay, so editing weight_decay never changes the group layout."
        ),
    )


# the fields only one schedule type reads: set for another type they are an error, not silently ignored
_TYPE_FIELDS = {
    "decay": "wsd",
    "decay_fraction": "wsd",
    "decay_shape": "wsd",
    "power": "polynomial",
    "step_size": "step",
    "gamma": "step",
    "path": "custom",
}


class SchedulerSpec(_Strict):
    """The live schedule. Only its *position* is persisted; this spec decides the values.

    Every type yields a factor that multiplies each param group's own base learning rate.
    """

    type: Literal["constant", "linear", "cosine", "wsd", "inverse_sqrt", "polynomial", "step", "custom"] = Field(
        "constant",
        description=(
            "constant; linear, cosine (decay to min_lr_ratio over the horizon); wsd (warmup-stable-decay: 1 until "
            "the last decay units, or decay_fraction of the horizon, then a decay_shape decay); inverse_sqrt "
            "(sqrt(warmup / (position + 1)) after the warmup); polynomial ((1 - progress)^power); step (times gamma "
            "every step_size units after the warmup); custom (path). Changing the type or the phase order (a warmup "
            "added or removed, wsd's decay_shape) between attempts is refused unless resume.reset_schedule."
        ),
    )
    warmup: StrictInt = Field(0, ge=0, le=MAX_STEPS, description="Warmup length in `unit`s (linear ramp from 0).")
    unit: Literal["optimizer_steps", "epochs"] = Field(
        "optimizer_steps",
        description=(
            "What warmup, total, decay and step_size count. A change between attempts recomputes the position "
            "(with a warning)."
        ),
    )
    total: StrictInt | None = Field(
        None, ge=1, le=MAX_STEPS, description="Horizon in `unit`s; default: the run's length."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The factor decaying schedules end at (their floor).")
    decay: StrictInt | None = Field(
        None, ge=1, le=MAX_STEPS, description="wsd: the decay phase's length in `unit`s (or decay_fraction)."
    )
    decay_fraction: float | None = Field(
        None, gt=0, le=1, description="wsd: the decay phase as a fraction of the horizon (or decay)."
    )
    decay_shape: Literal["linear", "cosine"] | None = Field(None, description="wsd: the decay's shape (linear).")
    power: float | None = Field(
        None, gt=0, le=MAX_POWER, description="polynomial: the exponent of (1 - progress) (default 1: linear)."
    )
    step_size: StrictInt | None = Field(
        None, ge=1, le=MAX_STEPS, description="step: multiply the rate by gamma every step_size `unit`s."
    )
    gamma: float | None = Field(None, gt=0, le=1, description="step: the factor per step_size (default 0.1).")
    path: str | None = Field(
        None,
        max_length=MAX_IMPORT_PATH_CHARS,
        description=(
            "custom: 'pkg.mod:fn', fn(position: int, total: int) -> float, a finite factor >= 0 on each group's base "
            "rate, checked at every step. It decides the whole schedule, so warmup and min_lr_ratio are refused with "
            "it; a path that does not resolve fails before anything is loaded."
        ),
    )

    @field_validator("path")
    @classmethod
    def _path_shape(cls, v: str | None) -> str | None:
        if v is not None and not is_import_path(v):
            raise ValueError("must look like 'package.module:function' (fn(position: int, total: int) -> float)")
        return v

    @model_validator(mode="after")
    def _fields_fit_type(self) -> SchedulerSpec:
        stray = [k for k, owner in _TYPE_FIELDS.items() if getattr(self, k) is not None and owner != self.type]
        if stray:
            k = stray[0]
            raise ValueError(
                f"train.scheduler.{k} applies to type {_TYPE_FIELDS[k]} only (type is {self.type}); "
                f"remove it or set type: {_TYPE_FIELDS[k]}"
            )
        if self.type == "wsd" and (self.decay is None) == (self.decay_fraction is None):
            raise ValueError(
                "train.scheduler type wsd needs exactly one of decay (the decay phase in units) or "
                "decay_fraction (of the horizon), e.g. decay_fraction: 0.2"
            )
        if self.type == "step" and self.step_size is None:
            raise ValueError("train.scheduler type step needs step_size (units between two multiplications by gamma)")
        if self.type == "custom":
            if self.path is None:
                raise ValueError(
                    "train.scheduler type custom needs path: 'package.module:function', "
                    "fn(position: int, total: int) -> float"
                )
            if self.warmup or self.min_lr_ratio:
                raise ValueError(
                    "train.scheduler type custom: the function decides the whole schedule; "
                    "remove warmup and min_lr_ratio (put them in the function)"
                )
        return self


class EvalEvery(_Strict):
    """``train.eval_every``: the shape and shorthand of ``checkpoint.save_every`` (``{value, unit}`` or
    ``"N unit"``), in the units an evaluation can be due in, and ``0`` for off. No ``seconds``: the
    steps evaluated must be the same in a resumed run as in the uninterrupted one, and wall-clock time
    is not; no ``micro_steps``: evaluation runs at sync boundaries only."""

    value: float = Field(..., ge=0, le=MAX_STEPS, description="0 disables evaluation.")
    unit: Literal["optimizer_steps", "epochs"] = Field(..., description="What value counts.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            if v == 0:
                return {"value": 0, "unit": "optimizer_steps"}
            raise ValueError(f"{v} needs a unit: write '{v} optimizer_steps' or '{v} epochs' (0 turns evaluation off)")
        if isinstance(v, str):
            parts = v.split()
            if len(parts) != 2:
                raise ValueError(
                    "write it as '<number> <unit>', e.g. '100 optimizer_steps' or '1 epochs', or {value, unit}"
                )
            return {"value": parts[0], "unit": parts[1]}
        return v

    @model_validator(mode="after")
    def _integral(self) -> EvalEvery:
        if self.value != int(self.value):
            raise ValueError(f"{self.unit} must be a whole number")
        return self


TrackerName = Literal["tensorboard", "mlflow", "wandb"]  # train.report_to (syncpoint.workers.observation.trackers)


class TrainSpec(_Strict):
    """``train``: batch layout, length, seed, hyper-parameters and schedule; the live spec's values win on resume."""

    micro_batch_size: StrictInt = Field(..., ge=1, le=MAX_MICRO_BATCH, description="Samples per rank per micro-batch.")
    grad_accum: StrictInt = Field(
        1,
        ge=1,
        le=MAX_GRAD_ACCUM,
        description="Micro-batches per optimizer step (the epoch end flushes a short cycle).",
    )
    epochs: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_EPOCHS,
        description=("Epochs to train; set epochs, max_steps or both (whichever ends first)."),
    )
    max_steps: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description=("Stop after this many optimizer steps (with epochs: whichever ends first)."),
    )
    seed: StrictInt = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description=("Seeds model initialisation, the sampler's permutation and every per-sample random draw."),
    )
    lr: float = Field(
        1e-3,
        gt=0,
        le=MAX_LR,
        description=(
            "Base learning rate (above 100 it is a typo such as 1e3 for 1e-3); unused when the task returns "
            "Task.optimizer, whose groups carry their own."
        ),
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec,
        description=(
            "adamw, adam or sgd, or {type, weight_decay, betas, eps, momentum, no_decay}; unused when the task "
            "returns Task.optimizer."
        ),
    )
    scheduler: SchedulerSpec = Field(
        default_factory=SchedulerSpec,
        description=(
            "The learning-rate schedule: a factor on each param group's base rate, after a linear warmup of "
            "`warmup` units (not custom), decaying schedules ending at min_lr_ratio over the horizon `total`."
        ),
    )
    gradient_clipping: float = Field(0.0, ge=0, description="DeepSpeed's gradient clipping (0: off).")
    dataloader_workers: StrictInt = Field(
        0, ge=0, le=MAX_DATALOADER_WORKERS, description="torch DataLoader worker processes."
    )
    stream_shuffle_buffer: StrictInt = Field(
        0,
        ge=0,
        le=MAX_STREAM_SHUFFLE_BUFFER,
        description=(
            "Stream datasets: shuffle each rank's stream through a buffer of this many examples, reseeded every pass "
            "and saved with every state, so a resume continues exactly (0: no shuffle). Datasets' own "
            ".shuffle(buffer_size) is refused: its resume refills the buffer with other examples."
        ),
    )
    stream_epoch_steps: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description=(
            "Stream datasets: optimizer steps that count as one epoch (a stream has no length), so train.epochs, "
            "epoch-unit schedules and evaluations can count epochs; default: none, train.max_steps ends the run."
        ),
    )
    record_samples: bool = Field(
        False, description="Log the sample ids of every optimizer step (audits, elastic tests)."
    )
    log_every: StrictInt = Field(
        10,
        ge=1,
        le=MAX_STEPS,
        description=(
            "Every N optimizer steps (and at the last): the progress line, the Ray Train report and the TensorBoard "
            "points."
        ),
    )
    prints: Literal["rank0", "all"] = Field(
        "rank0",
        description=(
            "Whose prints (stdout) reach you: rank0, each line once, from rank 0 (the other ranks' dropped, "
            "except syncpoint's own lines); all, every rank's, each line prefixed [rank N]. Every "
            "rank's stderr (warnings, errors) always shows, prefixed [rank N] on ranks other than 0."
        ),
    )
    report_to: list[TrackerName] = Field(
        default_factory=lambda: list[TrackerName](["tensorboard"]),
        max_length=3,
        description=(
            "Where rank 0 records the metrics of each optimizer step: tensorboard (<run>/tensorboard), mlflow "
            "(MLFLOW_TRACKING_URI, default <run>/mlruns; pip install 'syncpoint[mlflow]') and wandb "
            "(WANDB_MODE=offline for offline files; pip install 'syncpoint[wandb]'). One tracker run per syncpoint "
            "run across every attempt, each step logged once; [] records nothing but Ray Train's report."
        ),
    )
    eval_every: EvalEvery = Field(
        default_factory=lambda: EvalEvery(value=0, unit="optimizer_steps"),
        description=(
            "Evaluate the task's eval_dataset every N optimizer_steps or epochs (at sync boundaries, and at the run's "
            "end); 0 is off."
        ),
    )
    max_nonfinite_steps: StrictInt = Field(
        10,
        ge=1,
        le=MAX_STEPS,
        description=(
            "Fail the run after this many consecutive optimizer steps whose loss is not finite or whose update "
            "DeepSpeed skipped for overflowing gradients, naming the first (a diverged run, retried, diverges again). "
            "10: fp16's dynamic loss scale skips a few steps in a row while it finds its scale, a diverged run skips "
            "every step."
        ),
    )
    deterministic: bool = Field(
        True,
        description=(
            "GPU: deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG) so a resumed "
            "run is bitwise the uninterrupted one; false trades that for speed. CPU runs are deterministic anyway."
        ),
    )

    @field_validator("report_to")
    @classmethod
    def _report_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("name each tracker once")
        return v

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer_shorthand(cls, v: Any) -> Any:
        return {"type": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _length(self) -> TrainSpec:
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
    """``deepspeed``: the engine's ZeRO stage, precision, offload and clipping."""

    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description=("ZeRO stage: 1 partitions the optimizer state, 2 also the gradients, 3 also the parameters.")
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="fp16 needs scaling.use_gpu.")
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none",
        description=(
            "ZeRO-Offload: optimizer state and step on the CPU (ZeRO 1-3; Adam/AdamW use DeepSpeed's CPU Adam)."
        ),
    )
    offload_params: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Infinity parameter offload to the CPU (ZeRO 3 only)."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Passthrough DeepSpeed config keys: not the ones syncpoint sets (batch sizes, zero_optimization, "
            "optimizer, scheduler, bf16, fp16), and no secrets (DeepSpeed stores its config in every checkpoint file, "
            "so a key that names a credential is refused)."
        ),
    )

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> DeepSpeedSpec:
        """DeepSpeed offloads only what ZeRO partitions: the optimizer from stage 1, parameters at 3."""
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                "deepspeed.offload_optimizer needs deepspeed.zero_stage 1, 2 or 3 (ZeRO 0 does not "
                "partition the optimizer, so DeepSpeed has nothing to offload)"
            )
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError(
                "deepspeed.offload_params needs deepspeed.zero_stage: 3 (only ZeRO-3 partitions parameters)"
            )
        return self

    @field_validator("config")
    @classmethod
    def _no_conflicts(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = {
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "train_batch_size",
            "zero_optimization",
            "optimizer",
            "scheduler",
            "bf16",
            "fp16",
        }
        clash = sorted(owned & set(v))
        if clash:
            raise ValueError(
                f"keys {clash} are set by syncpoint from train.* and deepspeed.zero_stage/precision; "
                "set them there instead"
            )
        secrets = _secret_keys(v)
        if secrets:
            raise ValueError(
                f"{', '.join(secrets[:5])} look{'s' if len(secrets) == 1 else ''} like a secret "
                "(a key, token or password). "
                "DeepSpeed stores its whole config inside every checkpoint file (mp_rank_*.pt), so it would land in "
                "storage: remove it and give it to the workers as an environment variable instead (the monitors read "
                "WANDB_API_KEY, COMET_API_KEY, ...; set it from a secret store or a Kubernetes Secret)"
            )
        return v


class SaveEvery(_Strict):
    """``checkpoint.save_every``: ``{value, unit}``, ``"200 micro_steps"``, ``auto`` (stored as
    ``{value: 0, unit: auto}``: the interval is decided while the run goes, see
    ``syncpoint.policies.decisions.save_interval``), or ``0`` (no periodic saves: the explicit opt-out from the
    default, ``auto``)."""

    value: float = Field(..., ge=0, le=MAX_STEPS, description="0 disables periodic saves.")
    unit: Literal["micro_steps", "optimizer_steps", "seconds", "auto"] = Field(
        ..., description=("What value counts; auto takes no value.")
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip() == "auto":
            return {"value": 0, "unit": "auto"}
        if (isinstance(v, int) and not isinstance(v, bool) and v == 0) or (isinstance(v, str) and v.strip() == "0"):
            return {"value": 0, "unit": "optimizer_steps"}  # 0: never periodically (only notices and the end)
        if isinstance(v, str):
            parts = v.split()
            if len(parts) != 2:
                raise ValueError(
                    "write it as '<number> <unit>', e.g. '200 micro_steps', {value, unit}, auto, or 0 (never)"
                )
            return {"value": parts[0], "unit": parts[1]}
        return v

    @model_validator(mode="after")
    def _integral(self) -> SaveEvery:
        if self.unit == "auto" and self.value != 0:
            raise ValueError(
                "save_every auto takes no value (the interval is computed from the measured save cost "
                "and preemption rate): write `save_every: auto`, or give a fixed interval such as "
                f"'{self.value:g} seconds'"
            )
        if self.unit not in ("seconds", "auto") and self.value != int(self.value):
            raise ValueError(f"{self.unit} must be a whole number")
        return self


class CheckpointSpec(_Strict):
    """``checkpoint``: when states are saved, how they are written, verified and kept."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    save_every: SaveEvery = Field(
        default_factory=lambda: SaveEvery(value=0, unit="auto"),
        description=(
            "{value, unit}, '200 micro_steps', auto (the default: an interval from the measured save cost and the "
            "preemption rate, the first state at the first boundary), or 0 (no periodic saves: only preemption "
            "notices and the end commit a state). A request that falls mid-cycle is carried to the next sync "
            "boundary, never dropped, and the run always commits a state at its end."
        ),
    )
    save_trigger: str | None = Field(
        None, max_length=MAX_IMPORT_PATH_CHARS, description="Custom trigger 'pkg.mod:Class' (replaces save_every)."
    )

    @field_validator("save_trigger")
    @classmethod
    def _trigger_path(cls, v: str | None) -> str | None:
        if v is not None and not is_import_path(v):
            raise ValueError("must look like 'package.module:Class' (a class with wants_save(tick) -> bool)")
        return v

    expected_preemptions_per_hour: float | None = Field(
        None,
        gt=0,
        le=MAX_PREEMPTIONS_PER_HOUR,
        description=(
            "With save_every: auto, the preemption rate assumed until this run has seen its own (default 1 per hour); "
            "the estimate then moves to the observed rate."
        ),
    )
    sigterm_grace_s: float | None = Field(
        None,
        gt=0,
        le=MAX_LEASE_TTL_S,
        description=(
            "Seconds the platform waits between a SIGTERM and its SIGKILL (Kubernetes' "
            "terminationGracePeriodSeconds, a launcher's timeout). A notice commits a state at the next boundary; "
            "with a known deadline (this, or the deadline in Ray's drain notice) the run then trains on without "
            "saving and saves again at the last boundaries that can commit before it. Unset, a SIGTERM's "
            "grace window saves at every boundary."
        ),
    )
    keep_last: StrictInt = Field(3, ge=0, le=MAX_COUNT, description="Resumable states to keep; 0 keeps all.")
    prune_unsafe: bool = Field(
        False,
        description=("Also delete mid-cycle, corrupt and incompatible states older than the newest resumable one."),
    )
    export_final: bool = Field(
        True,
        description=(
            "Write the final model to <run>/final/model.safetensors (a transformers model: its save_pretrained "
            "directory, which from_pretrained loads)."
        ),
    )
    async_save: bool = Field(
        False,
        alias="async",
        description=(
            "Only a copy of the tensors into reusable host buffers blocks training; serialization, checksum and "
            "upload run in the background, and the manifest commits once every rank's upload finished (at most one "
            "save in flight; the run's last save is synchronous)."
        ),
    )
    memory_copy: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Keep this node's copy of the newest committed state in shared memory (/dev/shm, or "
            "SYNCPOINT_MEMORY_DIR), written alongside every save, so a restart on the same node restores from "
            "memory instead of the object store; the copy is verified against the state's manifest like any "
            "bytes, and a missing, stale or failing copy falls back to storage (the log says which). true, false, "
            "or auto: on when storage is neither a local filesystem (states there already restore in place) nor "
            "memory://. A finished run removes its copy."
        ),
    )
    checksum: Literal["xxh3_128", "sha256"] = Field(
        "xxh3_128",
        description=(
            "Checksum of every file in a state's manifest, verified before anything is loaded: xxh3_128 "
            "(fast, guards against torn and corrupt files) or sha256 (cryptographic, ~7x slower; needed for "
            "signing)."
        ),
    )
    signing_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description=(
            "Name of an environment variable holding a key (>= 32 bytes): rank 0 signs every manifest with "
            "HMAC-SHA256, and selection refuses unsigned or wrongly signed states as untrusted. Needs "
            "checksum: sha256."
        ),
    )

    @model_validator(mode="after")
    def _rate_needs_auto(self) -> CheckpointSpec:
        if self.expected_preemptions_per_hour is not None and (self.save_every.unit != "auto" or self.save_trigger):
            raise ValueError(
                "checkpoint.expected_preemptions_per_hour is only read by checkpoint.save_every: auto "
                "(it sets the preemption rate the interval assumes before any was observed); set "
                "save_every: auto, or remove expected_preemptions_per_hour"
            )
        return self

    @model_validator(mode="after")
    def _signed_needs_sha256(self) -> CheckpointSpec:
        if self.signing_key_env and self.checksum != "sha256":
            raise ValueError(
                "checkpoint.signing_key_env needs checkpoint.checksum: sha256 (a signature over xxh3_128 "
                "checksums would not authenticate the files: xxh3 is not collision-resistant)"
            )
        return self


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def _byte_count(v: Any) -> Any:
    """``17179869184``, ``"16GiB"``, ``"500 MB"`` -> bytes; anything else is left to the int check."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", v)
        if not m or m.group(2).lower() not in _BYTE_UNITS:
            raise ValueError("write a number of bytes, optionally with a unit: 17179869184, '16 GiB', '500 MB'")
        return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])
    return v


class CorpusSpec(_Strict):
    """How syncpoint reads a sharded corpus (``syncpoint.ShardedCorpus``, returned by the task as
    its dataset): the epoch order, and the node-local cache the shards are fetched into."""

    shuffle: Literal["auto", "global", "shard-window"] = Field(
        "auto",
        description=(
            "auto: shard-window when the task's dataset is a ShardedCorpus, else global | global: one keyed "
            "permutation of every sample per epoch (random access over the whole corpus) | shard-window: the "
            "shard order permuted per epoch, then the rows within each window of window_shards shards (reads "
            "window_shards shards at a time)."
        ),
    )
    window_shards: StrictInt = Field(
        8,
        ge=1,
        le=MAX_WINDOW_SHARDS,
        description=(
            "shard-window: consecutive shards (of the epoch's shard order) whose rows are shuffled together; "
            "a micro-batch draws from one window. More mixes better and needs a larger cache."
        ),
    )
    prefetch_shards: StrictInt | None = Field(
        None,
        ge=0,
        le=MAX_WINDOW_SHARDS,
        description=("Shards fetched ahead of the window in use (default: window_shards, one window ahead)."),
    )
    fetch_concurrency: StrictInt = Field(
        4, ge=1, le=MAX_FETCH_CONCURRENCY, description="Shards downloaded at the same time per process."
    )
    cache_dir: str | None = Field(
        None,
        max_length=MAX_PATH_CHARS,
        description=(
            "Local directory of the shard cache and the corpus index (shared by the ranks of a node); default "
            "$SYNCPOINT_CORPUS_CACHE, else <tmp>/syncpoint-corpus-<uid>. Private to the job's user: created 0700 "
            "and refused if another account owns it or others can write it. Shards on a local filesystem are read "
            "in place."
        ),
    )
    cache_bytes: StrictInt = Field(
        16 << 30,
        ge=1,
        le=MAX_CACHE_BYTES,
        description=(
            "Bound of the shard cache per node (bytes, or '16 GiB'): it must hold window_shards + prefetch_shards "
            "of the largest shard; least recently used shards are evicted beyond it."
        ),
    )

    @field_validator("cache_bytes", mode="before")
    @classmethod
    def _units(cls, v: Any) -> Any:
        return _byte_count(v)

    @field_validator("cache_dir")
    @classmethod
    def _local_dir(cls, v: str | None) -> str | None:
        if v is not None and "://" in v and not v.startswith("file://"):
            raise ValueError(
                "must be a local directory (the cache holds shards next to the ranks that read them), not a URL"
            )
        return v.removeprefix("file://") if v else v

    @property
    def prefetch(self) -> int:
        return self.window_shards if self.prefetch_shards is None else self.prefetch_shards


class ResumeSpec(_Strict):
    """``resume``: the policy that chooses where a submission starts, and the opt-outs it may take."""

    policy: str = Field(
        "newest-resumable",
        max_length=MAX_IMPORT_PATH_CHARS,
        description=(
            "newest-resumable, pinned, fresh, best-metric, or your own 'pkg.mod:Class'. A Ray "
            "restart inside one submission continues from that submission's newest state "
            "whatever the policy."
        ),
    )

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, v: str) -> str:
        if v not in BUILTIN_POLICIES and not is_import_path(v):
            raise ValueError(f"must be one of {', '.join(BUILTIN_POLICIES)}, or 'package.module:Class' for your own")
        return v

    policy_args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Keyword arguments for the policy, e.g. pinned: {state: 120}, best-metric: {metric: loss, mode: min}; "
            "a built-in's are checked against its own model before anything starts."
        ),
    )
    init_from: str | None = Field(
        None,
        max_length=MAX_PATH_CHARS,
        description=(
            "A state URL, a run directory (its newest committed state), or a Hugging Face save_pretrained directory "
            "(config.json and safetensors weights: a local copy of a hub model, another run's final/) to take "
            "weights from: fine-tuning. Never its position, RNG or data position; once this run has its own "
            "resumable state, that wins."
        ),
    )
    init_optimizer: bool = Field(False, description="With init_from: also import optimizer state.")
    init_from_signing_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description=(
            "With init_from: the environment variable holding the source run's signing key; its state must be "
            "signed with it. Default: this run's checkpoint.signing_key_env, when set."
        ),
    )
    reset_schedule: bool = Field(
        False,
        description=(
            "Opt-out: restart the LR schedule at 0 when the scheduler type or phases changed (otherwise refused)."
        ),
    )
    allow_user_state_change: bool = Field(
        False,
        description=(
            "Opt-out: resume although the task's Task.stateful names differ from the state's: objects the "
            "state saved and the task no longer has are dropped, objects the task added start from their own "
            "state. Without it such a change is refused at selection."
        ),
    )
    reset_optimizer: bool = Field(
        False,
        description=(
            "Opt-out: keep the state's weights and position but start the optimizer state (moments) fresh, e.g. "
            "after changing train.optimizer.type. Without it such a change is refused at selection."
        ),
    )
    on_existing: Literal["refuse", "archive", "overwrite"] = Field(
        "refuse",
        description=(
            "With policy: fresh on a run directory that has states: refuse, archive (move them to archive/) or "
            "overwrite."
        ),
    )
    lease_ttl_s: float = Field(
        60.0,
        gt=0,
        le=MAX_LEASE_TTL_S,
        description=(
            "The run directory's lease expires this long after its owner's last heartbeat; then a successor of the "
            "same job may take over. A re-submission waits (at most that long, plus a margin) for a dead holder's "
            "lease to expire instead of being refused."
        ),
    )


class FailureSpec(_Strict):
    """Named after Ray Train's ``FailureConfig``."""

    max_failures: StrictInt = Field(
        0,
        ge=-1,
        le=MAX_COUNT,
        description=("Application-error restarts (Ray's FailureConfig.max_failures; -1: unlimited)."),
    )
    max_preemptions: StrictInt = Field(
        -1,
        ge=-1,
        le=MAX_COUNT,
        description=(
            "Preemption restarts (Ray's max_preemption_failures; -1: unlimited). Preemptions never count against "
            "max_failures."
        ),
    )
    placement_timeout_s: float = Field(
        900.0,
        gt=0,
        le=MAX_LEASE_TTL_S,
        description=(
            "How long the run waits in a row for room to place its workers (at start or after a lost node) "
            "before it fails with a message; Ray Train alone would wait forever. Checked each time Ray "
            "Train's worker-group start times out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by default)."
        ),
    )
    in_place: StrictBool = Field(
        True,
        description=(
            "Recover a rank that crashed or raised, while every node lives, inside the same Ray Train worker group: "
            "each worker supervises its training process and starts a new one (forked with torch and DeepSpeed "
            "already imported), and every rank resumes from the newest committed state (from the node's memory "
            "copy when it has one). Same budgets and verdicts as a Ray Train restart. false: every failure "
            "restarts the worker group."
        ),
    )
    warm_nodes: StrictBool = Field(
        True,
        description=(
            "With in_place on CPU ranks: keep one warm training-process server (torch and DeepSpeed imported) on "
            "every node that can host a rank, for the job's length, so a new worker group (a Ray Train restart, a "
            "lost node's replacement already in the cluster, the first one on an embedded run) forks its training "
            "processes from it instead of importing them again; and, on each node that hosts ranks, as many spare Ray "
            "worker processes for the job's next worker group as it has ranks, so that group's actors start without "
            "new processes. Costs each node one idle process (~0.5 GB here) and one per rank (~0.2 GB). "
            "false: each worker starts its own server, which ends with it, and no spares."
        ),
    )


class CrashFault(_Strict):
    """Rehearse preemption: crash ``rank`` once per run, at a micro-step or a save phase.

    ``phase`` picks the save by its ordinal (``at_save``, the attempt's saves) or, with
    ``at_micro_step``, as the first save at or after that micro-step: a storm drill places a crash
    inside a save at a point of the run without knowing how many saves earlier attempts made."""

    rank: StrictInt = Field(0, ge=0, le=MAX_WORKERS, description="The rank to crash.")
    at_micro_step: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_MICRO_STEPS,
        description=("The micro-step to fire after; with phase: the first save at or after this micro-step."),
    )
    phase: (
        Literal[
            "before_shards",
            "after_some_shards",
            "before_manifest",
            "during_manifest",
            "before_retention",
            "during_retention",
        ]
        | None
    ) = Field(
        None,
        description=(
            "Crash inside a save at this phase; before_manifest, during_manifest and during_retention run on rank 0 "
            "only."
        ),
    )
    at_save: StrictInt = Field(
        1, ge=1, le=MAX_COUNT, description=("With phase (and no at_micro_step): which save (1 = first) of the attempt.")
    )
    mode: Literal["exit", "raise", "sigterm", "hold"] = Field(
        "exit",
        description="exit: os._exit (hard crash); raise: exception (in-process tests); sigterm: a preemption "
        "notice, then the process dies after the next boundary's save (at_micro_step only); "
        "hold: the rank stops after the micro-step and waits, bounded, for its node to be taken "
        "away (the storm drill's node loss at an exact point; at_micro_step only).",
    )

    @model_validator(mode="after")
    def _one_trigger(self) -> CrashFault:
        if self.at_micro_step is None and self.phase is None:
            raise ValueError(
                "a fault needs at_micro_step, phase, or both (phase with at_micro_step: the first save "
                "at or after that micro-step)"
            )
        # at_save's default (1) is what a dumped spec carries to the workers: only another value conflicts
        if self.phase is not None and self.at_micro_step is not None and self.at_save != 1:
            raise ValueError(
                "give phase with at_save (the attempt's Nth save) or with at_micro_step (the first save "
                "at or after it), not both"
            )
        if self.mode in ("sigterm", "hold") and (self.phase is not None or self.at_micro_step is None):
            raise ValueError(f"mode {self.mode} needs at_micro_step and no phase (it fires between micro-steps)")
        if self.phase in ("before_manifest", "during_manifest", "during_retention") and self.rank != 0:
            raise ValueError(
                f"phase {self.phase} happens on rank 0 only (it writes the manifest and runs "
                "retention): use rank: 0, or a phase every rank passes (before_shards, "
                "after_some_shards, before_retention)"
            )
        return self

    @property
    def fault_id(self) -> str:
        if self.phase is None:
            where = f"step{self.at_micro_step}"
        elif self.at_micro_step is None:
            where = f"{self.phase}-save{self.at_save}"
        else:
            where = f"{self.phase}-from-step{self.at_micro_step}"
        return f"rank{self.rank}-{where}"


class JobSpec(_Strict):
    """A job: what to train (``task``), where its states live (``storage``/``name``), and how (every other
    section). Read one from YAML with ``syncpoint.load_spec``; ``syncpoint schema`` prints its JSON Schema."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=MAX_NAME_CHARS,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description=(
            "The run's name; its directory is <storage>/<name>. Keep name and storage the same "
            "across retries: they are how every restart finds its states."
        ),
    )
    storage: str = Field(
        "./runs",
        max_length=MAX_PATH_CHARS,
        description=(
            "fsspec URL or path (/abs, file://, memory://, s3://, ...), made absolute on the driver. Credentials in "
            "the URL are redacted from all output and refused by submit: give them to the storage backend as "
            "environment variables."
        ),
    )
    scaling: ScalingSpec = Field(
        default_factory=ScalingSpec, description=("Workers and what each gets (named after Ray Train's ScalingConfig).")
    )
    task: TaskSpec = Field(..., description="Your code: the function that builds the Task, and its config.")
    train: TrainSpec = Field(..., description="Batches, length, optimizer, schedule, evaluation, logging.")
    deepspeed: DeepSpeedSpec = Field(
        default_factory=DeepSpeedSpec,
        description=("ZeRO stage, precision, offload and passthrough DeepSpeed settings."),
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description=("When states are saved, how they are checked, signed and kept.")
    )
    resume: ResumeSpec = Field(
        default_factory=ResumeSpec,
        description=("Where a run starts: the resume policy, fine-tuning, opt-outs and the run directory's lease."),
    )
    failure: FailureSpec = Field(
        default_factory=FailureSpec,
        description=("Restart budgets and the placement bound (named after Ray Train's FailureConfig)."),
    )
    corpus: CorpusSpec = Field(
        default_factory=CorpusSpec,
        description=("How a sharded corpus (syncpoint.ShardedCorpus) is ordered and cached."),
    )
    faults: list[CrashFault] = Field(
        default_factory=list,
        max_length=MAX_FAULTS,
        description=("Fault injection: crashes that fire once per run, to rehearse preemption."),
    )

    @model_validator(mode="after")
    def _combinations(self) -> JobSpec:
        if self.deepspeed.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("deepspeed.precision fp16 needs scaling.use_gpu: true (use fp32 or bf16 on CPU)")
        for f in self.faults:
            if f.rank >= self.scaling.max_workers:
                raise ValueError(
                    f"faults: rank {f.rank} does not exist with scaling.num_workers={self.scaling.max_workers}"
                )
        if self.scaling.elastic:
            from syncpoint.policies.decisions.elastic import allowed_world_sizes

            lo, hi = self.scaling.min_workers, self.scaling.max_workers
            ok = allowed_world_sizes(self.train.micro_batch_size, self.train.grad_accum, lo, hi)
            bad = [w for w in range(lo, hi + 1) if w not in ok]
            if bad:
                raise ValueError(
                    f"scaling.num_workers {{min: {lo}, max: {hi}}}: on {_ranges(bad)} worker(s) no whole accumulation "
                    f"keeps the global batch ({self.train.micro_batch_size} x {hi} x {self.train.grad_accum}); world "
                    f"sizes that work: {_ranges(ok)}. Narrow the range or change train.grad_accum"
                )
        if self.train.scheduler.unit == "epochs" and self.train.epochs is None and self.train.scheduler.total is None:
            raise ValueError("train.scheduler.unit epochs needs train.epochs or train.scheduler.total")
        return self

    @property
    def run_url(self) -> str:
        return self.storage.rstrip("/") + "/" + self.name


def spec_to_json(spec: JobSpec, redact: bool = True) -> str:
    """The normalized spec as JSON; with ``redact`` (the default: it is for printing and for what is
    stored beside the model), URL credentials anywhere in it (storage, resume.init_from, task.config)
    and the values of ``scaling.env``'s secret-named variables are replaced by ``***``."""
    data = spec.model_dump(mode="json", by_alias=True)  # checkpoint.async, as the docs and the schema spell it
    if redact:
        data = redact_obj(data)
        data["scaling"]["env"] = redact_env(spec.scaling.env)  # WANDB_API_KEY: ***
    return json.dumps(data, indent=2, sort_keys=False)


def job_schema() -> dict[str, Any]:
    """The job spec's JSON schema (``syncpoint schema``; editors validate YAML job files with it)."""
    return JobSpec.model_json_schema()
