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

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import ValidationError

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.corpus_identity import (
    CorpusIdentity,
)
from syncpoint.policies.contracts.errors import candidates_table
from syncpoint.policies.contracts.state_format import (
    MANIFEST_FILE,
    STATE_NAME_DIGITS,
    TRAINER_FILE,
    TRAINER_SCHEMA_VERSION,
    Manifest,
    TrainState,
    is_state_name,
    problem_of,
    schema_problem,
    state_name,
)
from syncpoint.policies.decisions.boundaries import is_boundary
from syncpoint.policies.decisions.compatibility import incompatibility
from syncpoint.policies.decisions.live_job import LiveJob, job_identity

# TRAINER_SCHEMA_VERSION: still imported from here by syncpoint.workers.training.loop
# (syncpoint.policies.contracts.state_format
# defines it)
RecordT = TypeVar("RecordT", TrainState, Manifest)


__all__ = [
    "TRAINER_SCHEMA_VERSION",
    "Candidate",
    "LiveJob",
    "Verdict",
    "candidates_table",
    "classify",
    "finite_metric",
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
    trainer: JSONObject | None = None
    trainer_error: str | None = None
    manifest: JSONObject | None = None
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


def _completeness_problem(manifest: Manifest, s: TrainState) -> str | None:
    missing = [f for f in s.required_files() if f not in manifest.files]
    if missing:
        return (
            f"incomplete: the manifest lacks {', '.join(missing[:3])}"
            f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''}, which a ZeRO {s.zero_stage} "
            f"{s.precision or ''} state of {s.world_size} worker(s) needs"
        ).replace("  ", " ")
    return None


def classify(c: Candidate, live: LiveJob | None) -> Candidate:
    """Set ``c.verdict`` and ``c.reason``; the order is torn, corrupt, untrusted, mid-cycle, incompatible.

    ``live`` None: no run to compare with (``syncpoint states`` on a run without a readable state),
    so nothing is judged incompatible."""
    c.verdict, c.reason = _classify(c, live)
    return c


def _classify(c: Candidate, live: LiveJob | None) -> tuple[Verdict, str]:
    unreadable = _unreadable(c)
    if unreadable:
        return unreadable
    problem = _manifest_problem(c.parse())
    if problem or c.record is None:
        return Verdict.CORRUPT, str(problem)
    if c.trust_error:
        return Verdict.UNTRUSTED, c.trust_error
    return _judge_trainer(c, c.record, live)


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


def _judge_trainer(c: Candidate, manifest: Manifest, live: LiveJob | None) -> tuple[Verdict, str]:
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
    why = incompatibility(state, live, c) if live is not None else None
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
