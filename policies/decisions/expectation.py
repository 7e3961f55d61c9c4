"""What the live job can continue exactly (``Expectation``), and the identity a state records of it.

Why its own module: the writer records these fields in ``trainer.json`` (``identity_record``) and
selection compares a state's with the live job's (``syncpoint.policies.decisions.compatibility``);
the two must agree field for field, so they are defined once, here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, cast

from syncpoint.policies.contracts.corpus_identity import (
    CorpusIdentity,
    CorpusSummary,
)
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.contracts.state_format import (
    SAMPLER_VERSION,
    STREAM_SAMPLER,
    StreamFields,
    TrainState,
    scheduler_phases,
)
from syncpoint.policies.decisions.elastic import Layout


def job_identity(spec: JobSpec) -> str:
    """Which job wrote a state: its name and task, so another job's states are never resumed."""
    return hashlib.sha256(f"{spec.name}|{spec.task.path}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Expectation:
    """What the current run can continue exactly; anything else is incompatible.

    A state's ``trainer.json`` embeds exactly these fields (``identity_record``): ``from_spec``
    builds the live run's expectation, ``from_state`` reads a state's back (``syncpoint states``
    without a live run), and the two agree on the loop's own states. ``None`` in an optional field
    means "not known, do not compare" (states written before the field existed).
    """

    job_identity: str
    world_size: int
    micro_batch_size: int
    grad_accum: int
    micro_batches_per_epoch: int
    zero_stage: int
    model_fingerprint: str
    seed: int
    # elastic runs compare what must stay constant across world sizes instead of the layout itself
    elastic: bool = False
    global_batch: int = 0
    samples_per_epoch: int = 0
    num_samples: int | None = None
    precision: str | None = None
    optimizer_type: str | None = None
    scheduler_type: str | None = None
    scheduler_phases: tuple[str, ...] | None = None
    # the optimizer's param groups, (parameters, elements, names hash) each; None: not known
    param_groups: tuple[tuple[int, int, str | None], ...] | None = None
    # the model's state-dict buffers, (name, shape, dtype) each, and its parameters' dtypes (the
    # common one, (name, dtype) of each other); None: not known
    model_buffers: tuple[tuple[str, tuple[int, ...], str], ...] | None = None
    parameter_dtypes: tuple[str, tuple[tuple[str, str], ...]] | None = None
    sampler: str = SAMPLER_VERSION  # what a new run orders its epochs with (a state continues with its own)
    window_shards: int | None = None  # the shard-window sampler's window (None: another sampler)
    # the sharded corpus (None: the dataset is none): its digest and size, and (the live run only)
    # the whole index, to name the shard a state's corpus differs in
    corpus: CorpusSummary | None = None
    corpus_index: CorpusIdentity | None = None
    # a stream dataset's ``StreamRecord`` fields (source, identity, DataLoader workers, shuffle buffer); None: map-style
    stream: StreamFields | None = None
    # the task's own train-side generators, (path, kind) each, whose states a state's RNG files hold
    task_generators: tuple[tuple[str, str], ...] | None = None
    # the task's Task.stateful names, sorted; None: the task has none (or a state before user state)
    user_state: tuple[str, ...] | None = None
    # opt-outs (resume.*): continue on these weights and this position although that part differs
    reset_schedule: bool = False
    reset_optimizer: bool = False
    allow_user_state_change: bool = False

    @classmethod
    def from_spec(
        cls,
        spec: JobSpec,
        layout: Layout,
        *,
        model_fingerprint: str,
        num_samples: int | None,
        param_groups: tuple[tuple[int, int, str | None], ...] | None = None,
        optimizer_type: str | None = None,
        model_buffers: tuple[tuple[str, tuple[int, ...], str], ...] | None = None,
        parameter_dtypes: tuple[str, tuple[tuple[str, str], ...]] | None = None,
        task_generators: dict[str, str] | None = None,
        corpus: CorpusIdentity | None = None,
        sampler: str = SAMPLER_VERSION,
        window_shards: int | None = None,
        stream: StreamFields | None = None,
        user_state: tuple[str, ...] | None = None,
    ) -> Expectation:
        """The live run's expectation: the spec, this attempt's layout (world size included), the
        task's model (fingerprint, buffers, dtypes), its dataset (its size and corpus, or for a
        stream ``stream``, what names it), the order a new run uses (``sampler``,
        ``window_shards``), and the built optimizer's param groups (``optimizer_type``: the class
        name when the task builds the optimizer, else the spec's type)."""
        t = spec.train
        return cls(
            job_identity=job_identity(spec),
            world_size=layout.world_size,
            micro_batch_size=t.micro_batch_size,
            grad_accum=layout.grad_accum,
            micro_batches_per_epoch=layout.micro_batches_per_epoch,
            zero_stage=spec.deepspeed.zero_stage,
            model_fingerprint=model_fingerprint,
            seed=t.seed,
            elastic=spec.scaling.elastic,
            global_batch=layout.global_batch,
            samples_per_epoch=layout.samples_per_epoch,
            num_samples=num_samples,
            precision=spec.deepspeed.precision,
            optimizer_type=optimizer_type or t.optimizer.type,
            param_groups=param_groups,
            model_buffers=model_buffers,
            parameter_dtypes=parameter_dtypes,
            scheduler_type=t.scheduler.type,
            scheduler_phases=tuple(scheduler_phases(t.scheduler)),
            reset_schedule=spec.resume.reset_schedule,
            reset_optimizer=spec.resume.reset_optimizer,
            task_generators=None if task_generators is None else tuple(sorted(task_generators.items())),
            sampler=sampler if stream is None else STREAM_SAMPLER,
            window_shards=window_shards,
            corpus=corpus.summary() if corpus else None,
            corpus_index=corpus,
            stream=stream,
            user_state=tuple(sorted(user_state)) if user_state else None,
            allow_user_state_change=spec.resume.allow_user_state_change,
        )

    @classmethod
    def from_state(cls, state: TrainState) -> Expectation:
        """The expectation a state itself implies: the run that wrote it, as it was then."""
        scheduler, groups = state.scheduler, state.optimizer.param_groups
        return cls(
            job_identity=state.job_identity,
            world_size=state.world_size,
            micro_batch_size=state.micro_batch_size,
            grad_accum=state.grad_accum,
            micro_batches_per_epoch=state.micro_batches_per_epoch,
            zero_stage=state.zero_stage,
            model_fingerprint=state.model_fingerprint,
            seed=state.seed,
            elastic=bool(state.elastic),
            global_batch=state.data.global_batch,
            samples_per_epoch=state.data.samples_per_epoch,
            num_samples=state.data.num_samples,
            precision=state.precision,
            optimizer_type=state.optimizer.type,
            param_groups=tuple((g.params, g.numel, g.names) for g in groups) if groups is not None else None,
            model_buffers=None
            if state.model_buffers is None
            else tuple((b.name, tuple(b.shape), b.dtype) for b in state.model_buffers),
            parameter_dtypes=None
            if state.parameter_dtypes is None
            else (state.parameter_dtypes.common, tuple(state.parameter_dtypes.others.items())),
            scheduler_type=scheduler.type if scheduler else None,
            scheduler_phases=tuple(scheduler.phases) if scheduler else None,
            sampler=state.data.sampler,
            # model_dump's values are Any; a StreamRecord dumps StreamFields (and any unknown keys it kept)
            stream=None if state.data.stream is None else cast("StreamFields", state.data.stream.model_dump()),
            task_generators=None if state.task_generators is None else tuple(sorted(state.task_generators.items())),
            window_shards=state.data.window_shards,
            user_state=tuple(state.user_state) if state.user_state else None,
            corpus=None
            if state.data.corpus is None
            else CorpusSummary(state.data.corpus.digest, state.data.corpus.shards, state.data.corpus.rows),
        )


def identity_record(exp: Expectation) -> dict[str, Any]:
    """The identity fields of ``trainer.json`` (the rest is position, metrics and provenance)."""
    return {
        "job_identity": exp.job_identity,
        "world_size": exp.world_size,
        "micro_batch_size": exp.micro_batch_size,
        "grad_accum": exp.grad_accum,
        "micro_batches_per_epoch": exp.micro_batches_per_epoch,
        "zero_stage": exp.zero_stage,
        "precision": exp.precision,
        "model_fingerprint": exp.model_fingerprint,
        "model_buffers": None
        if exp.model_buffers is None
        else [{"name": n, "shape": list(shape), "dtype": dtype} for n, shape, dtype in exp.model_buffers],
        "parameter_dtypes": None
        if exp.parameter_dtypes is None
        else {"common": exp.parameter_dtypes[0], "others": dict(exp.parameter_dtypes[1])},
        "seed": exp.seed,
        "elastic": exp.elastic,
        "optimizer": {
            "type": exp.optimizer_type,
            "param_groups": None
            if exp.param_groups is None
            else [{"params": n, "numel": numel, "names": names} for n, numel, names in exp.param_groups],
        },
        "task_generators": None if exp.task_generators is None else dict(exp.task_generators),
        "user_state": None if exp.user_state is None else list(exp.user_state),
    }
