"""Classify state candidates from metadata alone (``trainer.json``, ``manifest.json``, a listing).

Why plain data: selection must decide before any weights or data are touched, must be testable
without storage, and must give every rejected candidate a reason a person can act on. Nothing
here reads a file; discovery (``syncpoint.workers.state.discovery``) hands in what it read, and classification
parses it with the state format's models (``syncpoint.policies.contracts.state_format``): a field the model refuses
makes the state corrupt, with that field named.

The rule this module keeps: anything a later step (fetch, load, the loop's resume arithmetic)
could refuse, classification refuses first. So it checks the manifest's structure (known
checksum algorithms, paths inside the state, every file the layout needs), every redundant
position field against the others, and every field that decides which samples a step sees or
whether the optimizer state can be loaded, naming the spec field and any opt-out.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import ValidationError

from syncpoint.policies.contracts.corpus_identity import (
    CORPUS_DIR,
    CorpusIdentity,
    CorpusSummary,
    first_difference,
    index_file,
)
from syncpoint.policies.contracts.errors import candidates_table
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.contracts.state_format import (
    KNOWN_SAMPLERS,
    MANIFEST_FILE,
    SAMPLER_VERSION,
    SHARD_WINDOW_SAMPLER,
    STATE_NAME_DIGITS,
    STREAM_SAMPLER,
    TRAINER_FILE,
    TRAINER_SCHEMA_VERSION,
    Manifest,
    TrainState,
    is_state_name,
    problem_of,
    scheduler_phases,
    schema_problem,
    state_name,
)
from syncpoint.policies.decisions.boundaries import is_boundary
from syncpoint.policies.decisions.elastic import Layout

# TRAINER_SCHEMA_VERSION: still imported from here by syncpoint.workers.training.loop
# (syncpoint.policies.contracts.state_format
# defines it)
RecordT = TypeVar("RecordT", TrainState, Manifest)

__all__ = [
    "TRAINER_SCHEMA_VERSION",
    "Candidate",
    "Expectation",
    "Verdict",
    "candidates_table",
    "classify",
    "finite_metric",
    "identity_record",
    "job_identity",
    "newest_first",
]


class Verdict(StrEnum):
    """What selection concluded about one state directory (``syncpoint states`` shows it).

    ======================  ===========================================================================
    ``RESUMABLE``           may be chosen: committed, complete, at a sync boundary, compatible
    ``MID_CYCLE``           its position is not a sync boundary (recomputed, never a stored flag)
    ``TORN``                no manifest: a save that never committed
    ``CORRUPT``             its bytes contradict its manifest (sizes, checksums, paths, links)
    ``INCOMPATIBLE``        sound, but another job's or one this spec cannot continue exactly; the
                            reason names the spec field and any opt-out (never called corruption)
    ``UNTRUSTED``           signing is on and the manifest's signature is missing or wrong
    ======================  ===========================================================================
    """

    RESUMABLE = "resumable"
    MID_CYCLE = "mid-cycle"
    TORN = "torn"
    CORRUPT = "corrupt"
    INCOMPATIBLE = "incompatible"
    UNTRUSTED = "untrusted"


@dataclass
class Candidate:
    """One directory under ``states/`` as discovery saw it (metadata only).

    ``trainer`` and ``manifest`` are the JSON objects as read: a signature covers the manifest's
    exact object (and ``syncpoint.workers.state.resume_negotiation`` digests it), and a custom policy may
    read either. ``parse`` turns both into the typed records once (discovery calls it), and every
    later step (classification, the policies, the load, the CLI) reads ``state`` and ``record``.
    """

    name: str
    trainer: dict[str, Any] | None = None
    trainer_error: str | None = None
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None
    listing: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes (regular files)
    # what the listing found that is neither file nor directory (a link, a FIFO): path -> what it is
    unsafe: dict[str, str] = field(default_factory=dict)
    symlink: bool = False  # the directory is a link: never followed, never deleted through
    trust_error: str | None = None  # signing on and the manifest's signature missing or wrong
    # the state's corpus index (``corpus/<digest>.json``), read only when its corpus differs from the
    # live one, so the reason can name the shard; or why it could not be read
    corpus_index: CorpusIdentity | None = None
    corpus_index_error: str | None = None
    verdict: Verdict | None = None
    reason: str = ""
    # the typed records (``parse``): each None with the problem that refused its object (or its absence)
    state: TrainState | None = None
    state_problem: str | None = None  # the first bad field of trainer.json (corrupt)
    schema_newer: str | None = None  # trainer.json's schema is newer than this syncpoint reads (incompatible)
    record: Manifest | None = None
    record_problem: str | None = None  # the first bad field of manifest.json (corrupt)
    parsed: bool = False

    def parse(self) -> Candidate:
        """Parse ``trainer`` and ``manifest`` into ``state`` and ``record`` (once: a second call
        keeps the first result). A record that does not validate leaves its problem, which
        classification reports in its own order."""
        if self.parsed:
            return self
        self.parsed = True
        self.record, self.record_problem = _parsed(Manifest, self.manifest)
        self.schema_newer = schema_problem(self.trainer) if self.trainer is not None else None
        self.state, self.state_problem = _parsed(TrainState, self.trainer)
        return self

    @property
    def micro_step(self) -> int | None:
        if self.name.isdigit():
            return int(self.name)
        state = self.parse().state
        return state.global_micro_step if state is not None else None

    @property
    def sort_key(self) -> tuple[int, str]:
        step = self.micro_step
        return (step if step is not None else -1, self.name)


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
    stream: dict[str, Any] | None = None
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
        stream: dict[str, Any] | None = None,
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
            stream=None if state.data.stream is None else state.data.stream.model_dump(),
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


def _parsed(model: type[RecordT], raw: Any) -> tuple[RecordT | None, str | None]:
    """(the model, None) or (None, the first bad field named): a validation error is corruption."""
    try:
        return model.model_validate(raw), None
    except ValidationError as e:
        return None, problem_of(e, model.FILE)


def _manifest_problem(c: Candidate) -> str | None:
    """Why the manifest is unusable: the first bad field, or what the listing and the directory
    contradict in a well-formed one."""
    manifest = c.record
    if manifest is None:
        return c.record_problem
    if manifest.state is not None and manifest.state != c.name:
        return f"manifest names state {manifest.state!r} but lies in directory {c.name}"
    for rel, entry in manifest.files.items():
        unsafe = _unsafe_at(c, rel)
        if unsafe:
            return unsafe
        if rel not in c.listing:
            return f"missing file listed in the manifest: {rel}"
        if entry.size != c.listing[rel]:
            return f"{rel} is {c.listing[rel]} bytes, the manifest says {entry.size}"
    if TRAINER_FILE not in manifest.files:
        return f"manifest does not cover {TRAINER_FILE}"
    return None


def _unsafe_at(c: Candidate, rel: str) -> str | None:
    """Why a file the manifest lists cannot be read: it, or a directory above it, is a link or no
    regular file (never followed, never read), or None."""
    parts = rel.split("/")
    for i in range(len(parts), 0, -1):
        at = "/".join(parts[:i])
        if at in c.unsafe:
            if at == rel:
                return f"{rel} is {c.unsafe[at]}, not a regular file: never followed or read"
            return f"{rel} lies below {at}, which is {c.unsafe[at]}: never followed or read"
    return None


def _fixed_world_size(s: TrainState) -> bool:
    """Whether the writing run could not have changed world size, so its micro-step counters
    alone must agree (a resized run's micro-steps count at the world sizes it ran on)."""
    return s.elastic is False or (not s.elastic and not s.elastic_optimizer)


def _position_problem(c: Candidate, manifest: Manifest, s: TrainState) -> str | None:
    """Every redundant position field must agree with the others (and with the directory name),
    so an edited field cannot move a state to a mid-cycle position or reorder selection."""
    epoch, position, micro_step, step = s.epoch, s.position_in_epoch, s.global_micro_step, s.optimizer_step
    accum, per_epoch = s.grad_accum, s.micro_batches_per_epoch
    if position > per_epoch:
        return f"position fields out of range (position {position} of {per_epoch})"
    if c.name != state_name(micro_step):
        return f"directory {c.name} does not hold micro-step {micro_step} ({TRAINER_FILE} global_micro_step)"
    if manifest.world_size is not None and manifest.world_size != s.world_size:
        return f"manifest world_size {manifest.world_size!r} != {TRAINER_FILE} world_size {s.world_size}"
    d, per_micro = s.data, s.micro_batch_size * s.world_size
    in_epoch, epoch_samples, batch, seen = d.samples_in_epoch, d.samples_per_epoch, d.global_batch, d.global_samples
    if in_epoch != position * per_micro:
        return (
            f"position inconsistent: {position} micro-batches of {per_micro} samples != {in_epoch} samples "
            "into the epoch"
        )
    if epoch_samples != per_epoch * per_micro:
        return (
            f"position inconsistent: {per_epoch} micro-batches of {per_micro} samples != {epoch_samples} "
            "samples per epoch"
        )
    if batch != accum * per_micro:
        return f"position inconsistent: accumulation {accum} x {per_micro} samples != global batch {batch}"
    if seen != epoch * epoch_samples + in_epoch:
        return f"position inconsistent: epoch {epoch} x {epoch_samples} + {in_epoch} samples != {seen} samples seen"
    steps = (
        epoch * -(-epoch_samples // batch)
        + in_epoch // batch
        + (1 if in_epoch == epoch_samples and epoch_samples % batch else 0)
    )
    if step != steps:
        return f"position inconsistent: {seen} samples at global batch {batch} are {steps} optimizer steps, not {step}"
    if _fixed_world_size(s) and epoch * per_epoch + position != micro_step:
        return f"position inconsistent: epoch {epoch} * {per_epoch} + {position} != micro-step {micro_step}"
    return None


def _differs(field_name: str, have: Any, want: Any, what: str, fix: str) -> str:
    return f"{what}: the state has {field_name}={have!r}, this run has {want!r}. {fix}"


def _incompatibility(s: TrainState, exp: Expectation, c: Candidate | None = None) -> str | None:
    restore = "Restore the previous value, or start a new run (another name, or resume.policy: fresh)."
    if s.job_identity == exp.job_identity:  # another job's state: that is the reason (below)
        data = _corpus_incompatibility(s, exp, c) or _order_incompatibility(s, exp)
        if data:
            return data
    checks = _identity_checks(s, exp, restore)
    if s.data.stream is not None or exp.stream is not None:  # which job, model and seed first, then which stream
        stream = _first_difference(checks) or _stream_incompatibility(s, exp)
        if stream:
            return stream
    if s.user_state and s.world_size != exp.world_size:  # which job first, then why it cannot re-split
        resized = _first_difference(checks) or _user_state_resize_refusal(s, exp)
        if resized:
            return resized
    checks += _dataset_size_checks(s, exp, restore)
    if exp.elastic and s.world_size != exp.world_size:
        refused = _resize_refusal(s, exp)
        if refused:
            return refused
        checks += _elastic_checks(s, exp, restore)
    else:
        checks += _same_size_checks(s, exp, restore)
    checks += _engine_checks(s, exp)
    return _first_difference(checks) or _sampler_incompatibility(s) or _detail_incompatibility(s, exp)


_Check = tuple[str, Any, Any, str, str]  # (field, the state's value, this run's, what differs, the fix)


def _first_difference(checks: list[_Check]) -> str | None:
    for key, have, want, what, fix in checks:
        if have != want:
            return _differs(key, have, want, what, fix)
    return None


def _identity_checks(s: TrainState, exp: Expectation, restore: str) -> list[_Check]:
    """Which job, which model, which seed: compared first, for every kind of dataset."""
    return [
        ("job_identity", s.job_identity, exp.job_identity, "written by another job (name / task.path)", restore),
        (
            "model_fingerprint",
            s.model_fingerprint,
            exp.model_fingerprint,
            "model parameters (names/shapes) differ (task)",
            "Use resume.init_from to take compatible weights instead.",
        ),
        ("seed", s.seed, exp.seed, "sampler seed differs (train.seed): other samples per step", restore),
    ]


def _dataset_size_checks(s: TrainState, exp: Expectation, restore: str) -> list[_Check]:
    if exp.num_samples is None or s.data.num_samples is None:
        return []
    return [
        (
            "data.num_samples",
            s.data.num_samples,
            exp.num_samples,
            "dataset size differs (the task's dataset): each epoch's permutation changes",
            restore,
        )
    ]


def _resize_refusal(s: TrainState, exp: Expectation) -> str | None:
    """Why an elastic run cannot continue this state on its new world size at all."""
    if not s.elastic_optimizer:
        return (
            f"saved on {s.world_size} worker(s) without world-size-independent optimizer state "
            f"(ZeRO {s.zero_stage} non-elastic); cannot load on {exp.world_size} (scaling.num_workers)"
        )
    per_micro = exp.micro_batch_size * exp.world_size
    if per_micro and s.data.samples_in_epoch % per_micro:
        return (
            f"{s.data.samples_in_epoch} samples into the epoch is not a whole number of micro-batches on "
            f"{exp.world_size} worker(s) (scaling.num_workers); resume it on {s.world_size}"
        )
    return None


def _elastic_checks(s: TrainState, exp: Expectation, restore: str) -> list[_Check]:
    """A resized elastic run keeps the global batch, the epoch and the micro-batch size."""
    d = s.data
    return [
        (
            "data.global_batch",
            d.global_batch,
            exp.global_batch,
            "global batch (samples per optimizer step) differs (train.micro_batch_size x max workers x "
            "train.grad_accum)",
            restore,
        ),
        (
            "data.samples_per_epoch",
            d.samples_per_epoch,
            exp.samples_per_epoch,
            "samples per epoch differ (dataset size or the elastic range)",
            restore,
        ),
        (
            "micro_batch_size",
            s.micro_batch_size,
            exp.micro_batch_size,
            "micro-batch size differs (train.micro_batch_size)",
            restore,
        ),
    ]


def _same_size_checks(s: TrainState, exp: Expectation, restore: str) -> list[_Check]:
    """A run on the state's world size (or a non-elastic one) keeps the layout of every cycle."""
    checks: list[_Check] = (
        []
        if s.data.stream is not None or exp.stream is not None
        else [  # a stream's: _stream_incompatibility
            (
                "world_size",
                s.world_size,
                exp.world_size,
                "world size differs (scaling.num_workers)",
                "Use the same number of workers, or an elastic range {min, max} (with ZeRO 0, or elastic ZeRO 1-3 "
                "states).",
            ),
        ]
    )
    checks += [
        (
            "micro_batch_size",
            s.micro_batch_size,
            exp.micro_batch_size,
            "micro-batch size differs (train.micro_batch_size)",
            restore,
        ),
        ("grad_accum", s.grad_accum, exp.grad_accum, "gradient accumulation differs (train.grad_accum)", restore),
        (
            "micro_batches_per_epoch",
            s.micro_batches_per_epoch,
            exp.micro_batches_per_epoch,
            "epoch length in micro-batches differs ("
            + (
                "train.stream_epoch_steps x train.grad_accum"
                if exp.stream is not None
                else "dataset size, train.micro_batch_size"
            )
            + ")",
            restore,
        ),
    ]
    if exp.samples_per_epoch:
        checks.append(
            (
                "data.samples_per_epoch",
                s.data.samples_per_epoch,
                exp.samples_per_epoch,
                "samples per epoch differ (dataset size)",
                restore,
            )
        )
    return checks


def _engine_checks(s: TrainState, exp: Expectation) -> list[_Check]:
    """ZeRO stage, precision and optimizer type: what the engine's saved state is laid out by."""
    checks: list[_Check] = [
        (
            "zero_stage",
            s.zero_stage,
            exp.zero_stage,
            "ZeRO stage differs (deepspeed.zero_stage)",
            "DeepSpeed shards the optimizer state by stage; restore deepspeed.zero_stage.",
        )
    ]
    if exp.precision is not None and s.precision is not None:
        checks.append(
            (
                "precision",
                s.precision,
                exp.precision,
                "precision differs (deepspeed.precision)",
                "Master weights and loss-scale state are stored per precision; restore deepspeed.precision, "
                "or take the weights into a new run with resume.init_from.",
            )
        )
    if not exp.reset_optimizer and exp.optimizer_type is not None and s.optimizer.type is not None:
        checks.append(
            (
                "optimizer.type",
                s.optimizer.type,
                exp.optimizer_type,
                "optimizer type differs (train.optimizer.type, or the class Task.optimizer returns): its "
                "moments cannot be loaded",
                "Set resume.reset_optimizer: true to keep weights and position and start the optimizer "
                "state fresh, or restore train.optimizer.type (Task.optimizer).",
            )
        )
    return checks


def _sampler_incompatibility(s: TrainState) -> str | None:
    if s.data.sampler not in KNOWN_SAMPLERS:
        return (
            f"its sampler ({s.data.sampler!r}) is not one this syncpoint knows ({', '.join(KNOWN_SAMPLERS)}): it "
            "cannot compute the state's sample order. Resume it with the syncpoint version that wrote it."
        )
    return None


def _detail_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """Tensors, param groups, the LR schedule and the task's own generators."""
    return (
        _tensor_incompatibility(s, exp)
        or _group_incompatibility(s, exp)
        or _schedule_incompatibility(s, exp)
        or _generator_incompatibility(s, exp)
        or _user_state_incompatibility(s, exp)
    )


def _user_state_resize_refusal(s: TrainState, exp: Expectation) -> str:
    return (
        f"world size differs (scaling.num_workers) and the state holds user state (Task.stateful "
        f"{list(s.user_state or ())}): the state has world_size={s.world_size}, this run has {exp.world_size}, and "
        f"each rank's objects are its own, so they cannot be re-split. Resume on {s.world_size} worker(s), or "
        "start a new run (resume.init_from takes the weights)."
    )


def _user_state_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """Every rank's user file holds the task's ``Task.stateful`` objects by name: a task with other
    names would continue some from their own fresh state and drop others, silently; and the objects
    are each rank's own, so they continue only on the world size that saved them."""
    have, want = tuple(s.user_state or ()), tuple(exp.user_state or ())
    if have == want or exp.allow_user_state_change:
        return None
    gone, new = sorted(set(have) - set(want)), sorted(set(want) - set(have))
    parts = ([f"the state saved {gone} that this run's task lacks"] if gone else []) + (
        [f"this run's task has {new} that the state did not save"] if new else []
    )
    return (
        f"user state differs (Task.stateful): {'; '.join(parts)} (the state: {list(have) or 'none'}, this run: "
        f"{list(want) or 'none'}). Restore the task's Task.stateful names, or set "
        "resume.allow_user_state_change: true to resume anyway (the dropped ones are lost, the new ones start "
        "from their own state)."
    )


def _stream_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """A stream's position is its per-rank, per-worker state: it continues only the same stream, on
    the same world size, read by as many DataLoader workers, through the same shuffle buffer; and a
    map-style position never continues a stream, nor the other way round."""
    have, want = s.data.stream, exp.stream
    if have is None and want is None:
        return None
    fix = "Restore the previous dataset, or start a new run (another name, or resume.policy: fresh)."
    if have is None or want is None:
        kinds = (
            ("map-style", f"a stream ({(want or {}).get('source')})")
            if have is None
            else (f"a stream ({have.source})", "map-style")
        )
        return (
            f"data kind differs (the task's dataset): the state was written with a {kinds[0]} dataset, this run's "
            f"is {kinds[1]}; one's position cannot continue the other. {fix}"
        )
    if s.world_size != exp.world_size:
        return (
            f"world size differs (scaling.num_workers): the state has world_size={s.world_size}, this run has "
            f"{exp.world_size}. A stream's position is each rank's own (its shard position, its DataLoader "
            "workers' states and shuffle buffers), so it cannot continue on another number of workers; no stream "
            "re-splits exactly (a datasets stream whose n_shards divides both world sizes is split by shard, but "
            f"each rank's position inside its shards is its own). Resume on {s.world_size} worker(s), or start a "
            "new run (another name, or resume.policy: fresh)."
        )
    if have.source != want["source"]:
        return (
            f"the stream differs (the task's dataset): a {have.source} stream in the state, {want['source']} in "
            f"this run. {fix}"
        )
    if have.dataloader_workers != want["dataloader_workers"]:
        return _differs(
            "data.stream.dataloader_workers",
            have.dataloader_workers,
            want["dataloader_workers"],
            "DataLoader workers differ (train.dataloader_workers): each worker reads its own shards of "
            "a stream and keeps its own position in them",
            f"Restore train.dataloader_workers: {have.dataloader_workers}, or start a new run.",
        )
    if have.shuffle_buffer != want["shuffle_buffer"]:
        return _differs(
            "data.stream.shuffle_buffer",
            have.shuffle_buffer,
            want["shuffle_buffer"],
            "the stream's shuffle buffer differs (train.stream_shuffle_buffer, or the buffer_size of the "
            "stream's .shuffle): the state holds each worker's buffer and its draws",
            f"Restore a buffer of {have.shuffle_buffer}, or start a new run.",
        )
    difference = _identity_difference(have.identity, want["identity"])
    if difference:
        return (
            f"the stream differs (the task's dataset): {difference}; a stream's saved position is meaningful only "
            f"in the stream that wrote it. {fix}"
        )
    return None


# Identity parts newer than some states: a state without one was written before syncpoint recorded
# it, and is compared on the rest (what it never recorded cannot be told apart).
LATER_IDENTITY_KEYS = frozenset({"functions", "shuffle"})


def _identity_difference(have: dict[str, Any], want: dict[str, Any]) -> str | None:
    """The first part of two streams' identities that differs, in one phrase (a file by its place,
    a ``.map``/``.filter`` function by its pipeline step)."""
    # the shuffle first: another seed also lists the data files in another order
    for key in sorted(set(have) | set(want), key=lambda k: (k != "shuffle", k)):
        a, b = have.get(key), want.get(key)
        if a == b or (key in LATER_IDENTITY_KEYS and key not in have):
            continue
        if key == "functions" and isinstance(a, list) and isinstance(b, list):
            return _function_difference(a, b)
        if key == "shuffle":
            return (
                "its .shuffle(seed=...) differs (another seed reads the shards and draws the buffer in another "
                f"order: generator {_short(a)} in the state, {_short(b)} in this run)"
            )
        if key == "files" and isinstance(a, list) and isinstance(b, list):
            for i in range(max(len(a), len(b))):
                x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
                if x != y:
                    return f"data file {i}: {_file_text(x)} in the state, {_file_text(y)} in this run"
        return f"its {key} is {_short(a)} in the state, {_short(b)} in this run"
    return None


def _function_difference(have: list[Any], want: list[Any]) -> str:
    """Which ``.map``/``.filter`` step computes something else now (``syncpoint.workers.data.function_identity``)."""
    for i in range(max(len(have), len(want))):
        x, y = (have[i] if i < len(have) else None), (want[i] if i < len(want) else None)
        if x != y:
            kind = (y or x or {}).get("kind", "a step") if isinstance(y or x, dict) else "a step"
            return (
                f"its .map/.filter function {i} (pipeline step {kind}) computes something else: its code, its "
                "arguments, or the module-level values it reads changed (digest "
                f"{_digest_text(x)} in the state, {_digest_text(y)} in this run); to keep the weights with the new "
                "function, start a new run with resume.init_from: <this run> (and resume.init_optimizer: true)"
            )
    return "its .map/.filter functions differ"


def _digest_text(entry: Any) -> str:
    return str(entry.get("digest")) if isinstance(entry, dict) else "none"


def _file_text(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "none"
    size = entry.get("size")
    return f"{entry.get('name')!r}" + (f" ({size} bytes)" if size is not None else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


_NEW_CORPUS = (
    "Restore the corpus the state was trained on (task.config), or start a new run (another name, or "
    "resume.policy: fresh; resume.init_from takes the weights)."
)


def _corpus_incompatibility(s: TrainState, exp: Expectation, c: Candidate | None) -> str | None:
    """Another corpus means other samples at every position: refused from the digest, naming the
    first differing shard from the state's index in the run directory (``Candidate.corpus_index``)."""
    have, want = s.data.corpus, exp.corpus
    if have is None and want is None:
        return None
    if have is None or want is None:
        which = (
            "this run's task reads a sharded corpus, the state was trained on another dataset"
            if have is None
            else f"the state was trained on a sharded corpus ({have.shards} shards), this run's dataset is none"
        )
        return f"the dataset differs (task): {which}. {_NEW_CORPUS}"
    if have.digest == want.digest:
        return None
    if c is not None and c.corpus_index is not None and exp.corpus_index is not None:
        what = first_difference(c.corpus_index, exp.corpus_index)
    else:
        why = c.corpus_index_error if c is not None and c.corpus_index_error else "not read"
        what = (
            f"{have.shards} shards / {have.rows} rows then, {want.shards} / {want.rows} now (the state's index "
            f"{CORPUS_DIR}/{index_file(have.digest)}: {why}, so the shard cannot be named)"
        )
    return (
        f"the sharded corpus differs from the state's (corpus {have.digest[:12]} then, {want.digest[:12]} now): "
        f"{what}. {_NEW_CORPUS}"
    )


def _order_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """The shard-window order is the user's choice (corpus.shuffle, corpus.window_shards): another
    choice means other samples per step. Between the other samplers a state keeps its own."""
    have, want = s.data.sampler == SHARD_WINDOW_SAMPLER, exp.sampler == SHARD_WINDOW_SAMPLER
    if have != want:
        return (
            f"the epoch order differs (corpus.shuffle): the state uses {s.data.sampler}, this run asks for "
            f"{exp.sampler}; other samples per step. Restore corpus.shuffle "
            f"({'shard-window' if have else 'global'}), or start a new run (another name, or "
            "resume.policy: fresh)."
        )
    if have and s.data.window_shards != exp.window_shards:
        return _differs(
            "data.window_shards",
            s.data.window_shards,
            exp.window_shards,
            "shuffle window differs (corpus.window_shards): other samples per step",
            "Restore the previous value, or start a new run (another name, or resume.policy: fresh).",
        )
    return None


def _shape(shape: Iterable[int]) -> str:
    dims = tuple(shape)
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def _buffer_difference(s: TrainState, exp: Expectation, *, dtypes: bool) -> str | None:
    """The first buffer that differs between the state and this run (name, shape, dtype), in one
    phrase; None when both record the same (or either records none: states before the field)."""
    if s.model_buffers is None or exp.model_buffers is None:
        return None
    have = {b.name: (tuple(b.shape), b.dtype) for b in s.model_buffers}
    want = {name: (shape, dtype) for name, shape, dtype in exp.model_buffers}
    for name in [*want, *(n for n in have if n not in want)]:
        if name not in have:
            return f"buffer {name}: not in the state, shape {_shape(want[name][0])} {want[name][1]} in this run"
        if name not in want:
            return f"buffer {name}: shape {_shape(have[name][0])} {have[name][1]} in the state, not in this run"
        if have[name][0] != want[name][0]:
            return f"buffer {name}: shape {_shape(have[name][0])} in the state, {_shape(want[name][0])} in this run"
        if dtypes and have[name][1] != want[name][1]:
            return f"buffer {name}: dtype {have[name][1]} in the state, {want[name][1]} in this run"
    return None


def _dtype_difference(s: TrainState, exp: Expectation) -> str | None:
    """The first parameter whose dtype differs (both record dtypes), in one phrase, or None."""
    if s.parameter_dtypes is None or exp.parameter_dtypes is None:
        return None
    have_common, have_others = s.parameter_dtypes.common, s.parameter_dtypes.others
    want_common, want_others = exp.parameter_dtypes[0], dict(exp.parameter_dtypes[1])
    for name in [*want_others, *(n for n in have_others if n not in want_others)]:
        have, want = have_others.get(name, have_common), want_others.get(name, want_common)
        if have != want:
            return f"parameter {name}: dtype {have} in the state, {want} in this run"
    if have_common != want_common:
        return f"parameters: dtype {have_common} in the state, {want_common} in this run"
    return None


def _tensor_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """Buffers and dtypes the parameter fingerprint does not cover: another buffer name or shape
    fails DeepSpeed's load (strict), another dtype loads cast, so not exactly. Refused here, from
    the metadata, naming the tensor, before any tensor is read."""
    buffers = _buffer_difference(s, exp, dtypes=True)
    if buffers:
        return (
            f"model buffers differ (task): {buffers}. The state's buffers do not load into this model exactly: "
            "restore the previous model (task / task.config), or start a new run (another name, or "
            "resume.policy: fresh)"
            + ("; resume.init_from takes the weights cast to the new dtype." if "dtype" in buffers else ".")
        )
    dtypes = _dtype_difference(s, exp)
    if dtypes:
        return (
            f"model parameter dtypes differ (task): {dtypes}. The state's weights would load cast, not "
            "exactly: restore the previous dtype (task / task.config), or take the weights into a new run "
            "with resume.init_from (cast to the new dtype)."
        )
    return None


def _generator_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """The RNG files hold the states of the task's own train-side generators, by path: a task whose
    generators are others would continue some of them from a fresh state, silently. A state
    written before they were recorded is not compared (its resume says which start fresh)."""
    if exp.task_generators is None or s.task_generators is None:
        return None
    have, want = s.task_generators, dict(exp.task_generators)
    if have == want:
        return None
    fix = (
        "Restore the task's generators as they were (the same attribute or closure, the same kind), or start a "
        "new run (another name, or resume.policy: fresh; resume.init_from takes the weights)."
    )
    for path in sorted(set(have) | set(want)):
        if path not in want:
            return (
                f"the task's own random generators differ: the state saved {path} ({have[path]}), this run's "
                f"task has no generator there (it has {sorted(want) or 'none'}). {fix}"
            )
        if path not in have:
            return (
                f"the task's own random generators differ: this run's task has {path} ({want[path]}), the state "
                f"saved no state for it (it saved {sorted(have) or 'none'}). {fix}"
            )
        if have[path] != want[path]:
            return (
                f"the task's own random generators differ: {path} is a {want[path]} in this run's task, the "
                f"state saved a {have[path]}. {fix}"
            )
    return None


def _groups_text(groups: tuple[tuple[int, int, str | None], ...]) -> str:
    return (
        "["
        + ", ".join(f"{n} params / {numel} elements" for n, numel, _ in groups[:8])
        + (f", ... ({len(groups) - 8} more)" if len(groups) > 8 else "")
        + "]"
    )


def _group_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """The optimizer's moments are flattened and partitioned per param group: another number or
    split of groups cannot load them (same counts with other members: the names hash differs).
    A state written before the layout was recorded had one group."""
    if exp.reset_optimizer or exp.param_groups is None:
        return None
    fix = (
        "Set resume.reset_optimizer: true to keep weights and position and start the optimizer state fresh, "
        "or restore the previous groups (train.optimizer.no_decay, or the task's Task.optimizer)."
    )
    recorded = s.optimizer.param_groups
    if recorded is None:
        if len(exp.param_groups) == 1:
            return None
        return (
            f"parameter groups differ: the state records none (it was written before syncpoint recorded them, "
            f"with one group of every parameter), this run has {len(exp.param_groups)} "
            f"{_groups_text(exp.param_groups)} (train.optimizer.no_decay / Task.optimizer). Set "
            "train.optimizer.no_decay: [] for one group, or resume.reset_optimizer: true to keep "
            "weights and position and start the optimizer state fresh."
        )
    have = tuple((g.params, g.numel, g.names) for g in recorded)
    if have == exp.param_groups:
        return None
    same_sizes = [g[:2] for g in have] == [g[:2] for g in exp.param_groups]
    return (
        f"parameter groups differ (train.optimizer.no_decay / Task.optimizer): the state has {len(have)} "
        f"{_groups_text(have)}, this run has {len(exp.param_groups)} {_groups_text(exp.param_groups)}"
        f"{' (same sizes, other parameters)' if same_sizes else ''}; the optimizer moments are stored per group. " + fix
    )


def _schedule_incompatibility(s: TrainState, exp: Expectation) -> str | None:
    """Only the schedule's position is kept; another type or phase order cannot be continued."""
    sched = s.scheduler
    if exp.reset_schedule or exp.scheduler_type is None or sched is None or sched.position is None:
        return None
    have = (sched.type, tuple(sched.phases))
    if have != (exp.scheduler_type, exp.scheduler_phases):
        return (
            f"train.scheduler changed from {have[0]} {list(have[1])} to {exp.scheduler_type} "
            f"{list(exp.scheduler_phases or [])}: a schedule of another type or phase order cannot be continued. "
            "Set resume.reset_schedule: true to restart the schedule from step 0 on these weights, or restore "
            "the previous train.scheduler."
        )
    return None


def init_from_problem(c: Candidate, exp: Expectation, init_optimizer: bool) -> str | None:
    """Why ``resume.init_from`` cannot take this state, from its trainer record alone (before any
    tensor is read), or None. Weights are matched by name and shape; with ``init_optimizer`` the
    optimizer moments come too, and DeepSpeed stores them flattened per group, per rank and per
    ZeRO stage and precision: any of those differing would fail mid-load or, worse, load moments
    onto the wrong parameters. Each reason names the field and the opt-out."""
    s = c.parse().state
    if s is None:
        return f"its trainer.json is unreadable: {c.state_problem}"
    if s.model_fingerprint != exp.model_fingerprint:
        return (
            "its model parameters (names/shapes) differ from this run's (task): init_from takes weights by "
            "name and shape; point resume.init_from at a state of the same model"
        )
    buffers = _buffer_difference(s, exp, dtypes=False)
    if buffers:
        return (
            f"its model buffers differ from this run's (task): {buffers}; init_from takes buffers by name and "
            "shape too: point resume.init_from at a state of the same model"
        )
    if not init_optimizer:
        return None
    opt_out = " Set resume.init_optimizer: false to take the weights only, with a fresh optimizer state."
    checks: list[tuple[str, Any, Any, str]] = [
        ("zero_stage", s.zero_stage, exp.zero_stage, "ZeRO stage (deepspeed.zero_stage)"),
        (
            "optimizer.type",
            s.optimizer.type,
            exp.optimizer_type,
            "optimizer type (train.optimizer.type / Task.optimizer)",
        ),
    ]
    if not (s.elastic_optimizer and exp.elastic):
        checks.append(
            (
                "world_size",
                s.world_size,
                exp.world_size,
                "world size (scaling.num_workers): optimizer shards are per rank",
            )
        )
    if s.precision is not None and exp.precision is not None:
        checks.append(("precision", s.precision, exp.precision, "precision (deepspeed.precision)"))
    for key, have, want, what in checks:
        if have is not None and want is not None and have != want:
            return (
                f"with resume.init_optimizer its {what} must match: the state has {key}={have!r}, this run "
                f"has {want!r}.{opt_out}"
            )
    groups = _group_incompatibility(s, replace(exp, reset_optimizer=False))
    if groups:
        return (
            "with resume.init_optimizer the "
            + groups.split("; the optimizer moments", 1)[0]
            + "; the optimizer moments are stored per group."
            + opt_out
        )
    return None


def _completeness_problem(manifest: Manifest, s: TrainState) -> str | None:
    missing = [f for f in s.required_files() if f not in manifest.files]
    if missing:
        return (
            f"incomplete: the manifest lacks {', '.join(missing[:3])}"
            f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''}, which a ZeRO {s.zero_stage} "
            f"{s.precision or ''} state of {s.world_size} worker(s) needs"
        ).replace("  ", " ")
    return None


def classify(c: Candidate, exp: Expectation | None) -> Candidate:
    """Set ``c.verdict`` and ``c.reason``; the order is torn, corrupt, untrusted, mid-cycle, incompatible.

    ``exp`` None: no run to compare with (``syncpoint states`` on a run without a readable state),
    so nothing is judged incompatible."""
    c.verdict, c.reason = _classify(c, exp)
    return c


def _classify(c: Candidate, exp: Expectation | None) -> tuple[Verdict, str]:
    unreadable = _unreadable(c)
    if unreadable:
        return unreadable
    problem = _manifest_problem(c.parse())
    if problem or c.record is None:
        return Verdict.CORRUPT, str(problem)
    if c.trust_error:
        return Verdict.UNTRUSTED, c.trust_error
    return _judge_trainer(c, c.record, exp)


def _unreadable(c: Candidate) -> tuple[Verdict, str] | None:
    """Not a directory syncpoint wrote, never committed, or a manifest that cannot be read."""
    if c.symlink:
        return Verdict.CORRUPT, "a symbolic link, not a directory syncpoint wrote: never followed (left alone)"
    if not is_state_name(c.name):
        return Verdict.CORRUPT, f"{c.name!r} is not a state name ({STATE_NAME_DIGITS} digits): not written by syncpoint"
    if c.manifest is None and c.manifest_error is None:
        return Verdict.TORN, f"no {MANIFEST_FILE}: the save never committed"
    if c.manifest_error:
        return Verdict.CORRUPT, f"{MANIFEST_FILE} unreadable: {c.manifest_error}"
    return None


def _judge_trainer(c: Candidate, manifest: Manifest, exp: Expectation | None) -> tuple[Verdict, str]:
    """A committed, trusted state judged by its trainer record: schema, boundary, position, compatibility."""
    if c.trainer_error or c.trainer is None:
        return Verdict.CORRUPT, f"{TRAINER_FILE} unusable: {c.trainer_error or 'missing'}"
    if c.schema_newer:
        return Verdict.INCOMPATIBLE, c.schema_newer
    state = c.state
    if state is None:
        return Verdict.CORRUPT, str(c.state_problem)
    if not is_boundary(state.position_in_epoch, state.grad_accum, state.micro_batches_per_epoch):
        return Verdict.MID_CYCLE, (
            f"mid-cycle: position {state.position_in_epoch} of {state.micro_batches_per_epoch} with accumulation "
            f"{state.grad_accum} is not a sync boundary; its pending micro-batch gradients were never persisted"
        )
    problem = _position_problem(c, manifest, state) or _completeness_problem(manifest, state)
    if problem:
        return Verdict.CORRUPT, problem
    why = _incompatibility(state, exp, c) if exp is not None else None
    if why:
        return Verdict.INCOMPATIBLE, why
    return Verdict.RESUMABLE, (
        f"boundary at micro-step {state.global_micro_step} "
        f"(optimizer step {state.optimizer_step}; sampler {state.data.sampler})"
    )


def finite_metric(state: TrainState | None, name: str) -> tuple[float | None, str]:
    """A recorded metric as a finite float, or (None, why it cannot be compared). Metric values are
    whatever the task reported (``TrainState.metrics`` keeps them as read)."""
    metrics = state.metrics if state is not None else {}
    if name not in metrics:
        return None, f"records no metric {name!r}"
    v = metrics[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, f"metric {name} is {v!r}, not a number"
    if not math.isfinite(v):
        return None, f"metric {name} is {v!r}, not finite"
    return float(v), ""


def newest_first(cands: Iterable[Candidate]) -> list[Candidate]:
    """Candidates newest first (by their position, the order selection and retention walk)."""
    return sorted(cands, key=lambda c: c.sort_key, reverse=True)
