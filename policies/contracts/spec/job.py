"""The job spec: the one model that holds every section and checks their combinations, and its JSON forms."""

from __future__ import annotations

import json

from pydantic import (
    Field,
    model_validator,
)

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.spec.bounds import (
    MAX_FAULTS,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    Strict,
    ranges,
)
from syncpoint.policies.contracts.spec.checkpoint import CheckpointSpec
from syncpoint.policies.contracts.spec.corpus import CorpusSpec
from syncpoint.policies.contracts.spec.deepspeed import DeepSpeedSpec
from syncpoint.policies.contracts.spec.failure import CrashFault, FailureSpec
from syncpoint.policies.contracts.spec.resume import ResumeSpec
from syncpoint.policies.contracts.spec.scaling import ScalingSpec
from syncpoint.policies.contracts.spec.train import TaskSpec, TrainSpec
from syncpoint.policies.decisions.redact import redact_env, redact_obj


class JobSpec(Strict):
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
                    f"scaling.num_workers {{min: {lo}, max: {hi}}}: on {ranges(bad)} worker(s) no whole accumulation "
                    f"keeps the global batch ({self.train.micro_batch_size} x {hi} x {self.train.grad_accum}); world "
                    f"sizes that work: {ranges(ok)}. Narrow the range or change train.grad_accum"
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


def job_schema() -> JSONObject:
    """The job spec's JSON schema (``syncpoint schema``; editors validate YAML job files with it)."""
    return JobSpec.model_json_schema()
