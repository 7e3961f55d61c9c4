"""The live job a state must continue: its ``StateIdentity``, built the way its own states record it.

Why its own module: selection compares a state's identity with the live job's field by field
(``syncpoint.policies.decisions.compatibility``), and the writer records the live job's identity in
every state it writes (``syncpoint.workers.training.loop_state``); both read the one model built
here, so what a state records is what the next run compares.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from syncpoint.policies.contracts.corpus_identity import CorpusIdentity
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.contracts.state_format import scheduler_phases
from syncpoint.policies.contracts.state_identity import (
    SAMPLER_VERSION,
    STREAM_SAMPLER,
    BufferRecord,
    CorpusRecord,
    DataIdentity,
    OptimizerRecord,
    ParameterDtypes,
    ParamGroupRecord,
    ScheduleShape,
    StateIdentity,
    StreamFields,
    StreamRecord,
)
from syncpoint.policies.decisions.elastic import Layout


def job_identity(spec: JobSpec) -> str:
    """Which job wrote a state: its name and task, so another job's states are never resumed."""
    return hashlib.sha256(f"{spec.name}|{spec.task.path}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LiveJob:
    """The live job: the identity its states record, and what only a live job has.

    ``corpus_index``: the sharded corpus's whole index (a state records its digest and size; the
    index names the shard that differs). The opt-outs (``resume.*``) continue on these weights and
    this position although that part differs.
    """

    identity: StateIdentity
    corpus_index: CorpusIdentity | None = None
    reset_schedule: bool = False
    reset_optimizer: bool = False
    allow_user_state_change: bool = False


def live_job(
    spec: JobSpec,
    layout: Layout,
    *,
    model_fingerprint: str,
    num_samples: int | None,
    param_groups: list[ParamGroupRecord] | None = None,
    optimizer_type: str | None = None,
    model_buffers: list[BufferRecord] | None = None,
    parameter_dtypes: ParameterDtypes | None = None,
    task_generators: dict[str, str] | None = None,
    corpus: CorpusIdentity | None = None,
    sampler: str = SAMPLER_VERSION,
    window_shards: int | None = None,
    stream: StreamFields | None = None,
    user_state: tuple[str, ...] | None = None,
) -> LiveJob:
    """The live job from its spec, this attempt's layout (world size included) and what the built
    task and engine measure: the model (fingerprint, buffers, dtypes), the dataset (its size and
    corpus, or for a stream what names it), the order a new run uses (``sampler``: a state continues
    with its own), the optimizer's param groups (``optimizer_type``: the class name when the task
    builds the optimizer, else the spec's type), its own generators and ``Task.stateful`` names."""
    t = spec.train
    data = DataIdentity(
        sampler=sampler if stream is None else STREAM_SAMPLER,
        corpus=None if corpus is None else CorpusRecord(**vars(corpus.summary())),
        window_shards=window_shards,
        num_samples=num_samples,
        samples_per_epoch=layout.samples_per_epoch,
        global_batch=layout.global_batch,
        stream=None if stream is None else StreamRecord.model_validate(stream),
    )
    identity = StateIdentity(
        job_identity=job_identity(spec),
        world_size=layout.world_size,
        micro_batch_size=t.micro_batch_size,
        grad_accum=layout.grad_accum,
        micro_batches_per_epoch=layout.micro_batches_per_epoch,
        zero_stage=spec.deepspeed.zero_stage,
        precision=spec.deepspeed.precision,
        model_fingerprint=model_fingerprint,
        model_buffers=model_buffers,
        parameter_dtypes=parameter_dtypes,
        seed=t.seed,
        elastic=spec.scaling.elastic,
        optimizer=OptimizerRecord(type=optimizer_type or t.optimizer.type, param_groups=param_groups),
        scheduler=ScheduleShape(type=t.scheduler.type, phases=scheduler_phases(t.scheduler), unit=t.scheduler.unit),
        data=data,
        task_generators=task_generators,
        user_state=sorted(user_state) if user_state else None,
    )
    return LiveJob(
        identity,
        corpus_index=corpus,
        reset_schedule=spec.resume.reset_schedule,
        reset_optimizer=spec.resume.reset_optimizer,
        allow_user_state_change=spec.resume.allow_user_state_change,
    )
