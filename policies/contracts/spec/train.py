"""The spec's ``task`` and ``train`` sections: your code, the batches, length, optimizer, schedule and evaluation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictInt,
    field_validator,
    model_validator,
)

from syncpoint.policies.contracts.import_path import is_import_path
from syncpoint.policies.contracts.spec.bounds import (
    MAX_DATALOADER_WORKERS,
    MAX_EPOCHS,
    MAX_GRAD_ACCUM,
    MAX_IMPORT_PATH_CHARS,
    MAX_LR,
    MAX_MICRO_BATCH,
    MAX_NO_DECAY_PATTERNS,
    MAX_PATTERN_CHARS,
    MAX_POWER,
    MAX_SEED,
    MAX_STEPS,
    MAX_STREAM_SHUFFLE_BUFFER,
    Strict,
)


class TaskSpec(Strict):
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


class OptimizerSpec(Strict):
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


class SchedulerSpec(Strict):
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


class EvalEvery(Strict):
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


class TrainSpec(Strict):
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
    compile: bool = Field(
        False,
        description=(
            "Compile the model with torch.compile through DeepSpeed's engine.compile (the accelerator's default "
            "backend, inductor): the first micro-step of each training process compiles; a restart on the same "
            "node reads the compiled graphs back from this user's private compile cache (TORCHINDUCTOR_CACHE_DIR, "
            "unless you set it) instead of compiling from nothing, and on CPU a node's warm server does the "
            "compiler's once-per-process set-up before it forks a training process (an in-place recovery then only "
            "traces the model again). Resumes exactly like an eager run; turning it "
            "on or off between attempts is a change of numerics the run takes, as of train.lr."
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
