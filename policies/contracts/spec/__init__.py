"""The job spec: pydantic models that validate themselves, a module per section (YAML is the driver's).

Loading YAML lives in ``syncpoint.orchestrator.spec_file``.

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

from syncpoint.policies.contracts.spec.bounds import (
    BUILTIN_POLICIES,
    MAX_CACHE_BYTES,
    MAX_COLLECTIVE_TIMEOUT_S,
    MAX_COUNT,
    MAX_CPUS_PER_WORKER,
    MAX_DATALOADER_WORKERS,
    MAX_EPOCHS,
    MAX_FAULTS,
    MAX_FETCH_CONCURRENCY,
    MAX_GRAD_ACCUM,
    MAX_IMPORT_PATH_CHARS,
    MAX_LEASE_TTL_S,
    MAX_LR,
    MAX_MICRO_BATCH,
    MAX_MICRO_STEPS,
    MAX_NAME_CHARS,
    MAX_NO_DECAY_PATTERNS,
    MAX_PATH_CHARS,
    MAX_PATTERN_CHARS,
    MAX_POWER,
    MAX_PREEMPTIONS_PER_HOUR,
    MAX_SEED,
    MAX_SPEC_BYTES,
    MAX_STEPS,
    MAX_STREAM_SHUFFLE_BUFFER,
    MAX_WINDOW_SHARDS,
    MAX_WORKERS,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
)
from syncpoint.policies.contracts.spec.checkpoint import CheckpointSpec, SaveEvery
from syncpoint.policies.contracts.spec.corpus import CorpusSpec
from syncpoint.policies.contracts.spec.deepspeed import DeepSpeedSpec
from syncpoint.policies.contracts.spec.failure import CrashFault, FailureSpec
from syncpoint.policies.contracts.spec.job import JobSpec, job_schema, spec_to_json
from syncpoint.policies.contracts.spec.resume import ResumeSpec
from syncpoint.policies.contracts.spec.scaling import (
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    RESERVED_ENV,
    ElasticWorkers,
    ScalingSpec,
)
from syncpoint.policies.contracts.spec.train import (
    EvalEvery,
    OptimizerSpec,
    SchedulerSpec,
    TaskSpec,
    TrackerName,
    TrainSpec,
)

__all__ = [
    "BUILTIN_POLICIES",
    "CheckpointSpec",
    "CorpusSpec",
    "CrashFault",
    "DeepSpeedSpec",
    "ElasticWorkers",
    "EvalEvery",
    "FailureSpec",
    "JobSpec",
    "MAX_CACHE_BYTES",
    "MAX_COLLECTIVE_TIMEOUT_S",
    "MAX_COUNT",
    "MAX_CPUS_PER_WORKER",
    "MAX_DATALOADER_WORKERS",
    "MAX_ENV_VALUE_CHARS",
    "MAX_ENV_VARS",
    "MAX_EPOCHS",
    "MAX_FAULTS",
    "MAX_FETCH_CONCURRENCY",
    "MAX_GRAD_ACCUM",
    "MAX_IMPORT_PATH_CHARS",
    "MAX_LEASE_TTL_S",
    "MAX_LR",
    "MAX_MICRO_BATCH",
    "MAX_MICRO_STEPS",
    "MAX_NAME_CHARS",
    "MAX_NO_DECAY_PATTERNS",
    "MAX_PATH_CHARS",
    "MAX_PATTERN_CHARS",
    "MAX_POWER",
    "MAX_PREEMPTIONS_PER_HOUR",
    "MAX_SEED",
    "MAX_SPEC_BYTES",
    "MAX_STEPS",
    "MAX_STREAM_SHUFFLE_BUFFER",
    "MAX_WINDOW_SHARDS",
    "MAX_WORKERS",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "OptimizerSpec",
    "RESERVED_ENV",
    "ResumeSpec",
    "SaveEvery",
    "ScalingSpec",
    "SchedulerSpec",
    "TaskSpec",
    "TrackerName",
    "TrainSpec",
    "job_schema",
    "spec_to_json",
]
