"""Whether a state can continue the live job exactly: the first difference, named with its field and fix.

Why from metadata alone: a mismatch with the live job is never corruption, and whatever a later step
(load, the loop's resume arithmetic) could refuse is refused here first, before any tensor is read.
The checks run in the order a person fixes them: which job, model and seed; the data and its order;
the world size and batch; the engine; then the details (``detail_compatibility``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from syncpoint.policies.contracts.corpus_identity import (
    CORPUS_DIR,
    first_difference,
    index_file,
)
from syncpoint.policies.contracts.state_format import (
    KNOWN_SAMPLERS,
    SHARD_WINDOW_SAMPLER,
    TrainState,
)
from syncpoint.policies.decisions.detail_compatibility import (
    buffer_difference,
    generator_incompatibility,
    group_incompatibility,
    identity_difference,
    schedule_incompatibility,
    tensor_incompatibility,
)
from syncpoint.policies.decisions.live_job import LiveJob

if TYPE_CHECKING:  # a candidate is only read here: candidates imports this module
    from syncpoint.policies.decisions.candidates import Candidate


def differs(field_name: str, have: Any, want: Any, what: str, fix: str) -> str:
    """A difference as a person reads it: what differs, both values, and how to go on."""
    return f"{what}: the state has {field_name}={have!r}, this run has {want!r}. {fix}"


def incompatibility(s: TrainState, live: LiveJob, c: Candidate | None = None) -> str | None:
    """Why the state ``s`` cannot continue the live job exactly (its first difference), or None."""
    job = live.identity
    restore = "Restore the previous value, or start a new run (another name, or resume.policy: fresh)."
    if s.job_identity == job.job_identity:  # another job's state: that is the reason (below)
        data = _corpus_incompatibility(s, live, c) or _order_incompatibility(s, live)
        if data:
            return data
    checks = _identity_checks(s, live, restore)
    if s.data.stream is not None or job.data.stream is not None:  # which job, model and seed first, then which stream
        stream = _first_difference(checks) or _stream_incompatibility(s, live)
        if stream:
            return stream
    if s.user_state and s.world_size != job.world_size:  # which job first, then why it cannot re-split
        resized = _first_difference(checks) or _user_state_resize_refusal(s, live)
        if resized:
            return resized
    checks += _dataset_size_checks(s, live, restore)
    if job.elastic and s.world_size != job.world_size:
        refused = _resize_refusal(s, live)
        if refused:
            return refused
        checks += _elastic_checks(s, live, restore)
    else:
        checks += _same_size_checks(s, live, restore)
    checks += _engine_checks(s, live)
    return _first_difference(checks) or _sampler_incompatibility(s) or detail_incompatibility(s, live)


_Check = tuple[str, Any, Any, str, str]  # (field, the state's value, this run's, what differs, the fix)


def _first_difference(checks: list[_Check]) -> str | None:
    for key, have, want, what, fix in checks:
        if have != want:
            return differs(key, have, want, what, fix)
    return None


def _identity_checks(s: TrainState, live: LiveJob, restore: str) -> list[_Check]:
    """Which job, which model, which seed: compared first, for every kind of dataset."""
    job = live.identity
    return [
        (
            "job_identity",
            s.job_identity,
            job.job_identity,
            "written by another job (name / task.path)",
            restore,
        ),
        (
            "model_fingerprint",
            s.model_fingerprint,
            job.model_fingerprint,
            "model parameters (names/shapes) differ (task)",
            "Use resume.init_from to take compatible weights instead.",
        ),
        ("seed", s.seed, job.seed, "sampler seed differs (train.seed): other samples per step", restore),
    ]


def _dataset_size_checks(s: TrainState, live: LiveJob, restore: str) -> list[_Check]:
    job = live.identity
    if job.data.num_samples is None or s.data.num_samples is None:
        return []
    return [
        (
            "data.num_samples",
            s.data.num_samples,
            job.data.num_samples,
            "dataset size differs (the task's dataset): each epoch's permutation changes",
            restore,
        )
    ]


def _resize_refusal(s: TrainState, live: LiveJob) -> str | None:
    """Why an elastic run cannot continue this state on its new world size at all."""
    job = live.identity
    if not s.elastic_optimizer:
        return (
            f"saved on {s.world_size} worker(s) without world-size-independent optimizer state "
            f"(ZeRO {s.zero_stage} non-elastic); cannot load on {job.world_size} (scaling.num_workers)"
        )
    per_micro = job.micro_batch_size * job.world_size
    if per_micro and s.data.samples_in_epoch % per_micro:
        return (
            f"{s.data.samples_in_epoch} samples into the epoch is not a whole number of micro-batches on "
            f"{job.world_size} worker(s) (scaling.num_workers); resume it on {s.world_size}"
        )
    return None


def _elastic_checks(s: TrainState, live: LiveJob, restore: str) -> list[_Check]:
    """A resized elastic run keeps the global batch, the epoch and the micro-batch size."""
    job = live.identity
    d = s.data
    return [
        (
            "data.global_batch",
            d.global_batch,
            job.data.global_batch,
            "global batch (samples per optimizer step) differs (train.micro_batch_size x max workers x "
            "train.grad_accum)",
            restore,
        ),
        (
            "data.samples_per_epoch",
            d.samples_per_epoch,
            job.data.samples_per_epoch,
            "samples per epoch differ (dataset size or the elastic range)",
            restore,
        ),
        (
            "micro_batch_size",
            s.micro_batch_size,
            job.micro_batch_size,
            "micro-batch size differs (train.micro_batch_size)",
            restore,
        ),
    ]


def _same_size_checks(s: TrainState, live: LiveJob, restore: str) -> list[_Check]:
    """A run on the state's world size (or a non-elastic one) keeps the layout of every cycle."""
    job = live.identity
    checks: list[_Check] = (
        []
        if s.data.stream is not None or job.data.stream is not None
        else [  # a stream's: _stream_incompatibility
            (
                "world_size",
                s.world_size,
                job.world_size,
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
            job.micro_batch_size,
            "micro-batch size differs (train.micro_batch_size)",
            restore,
        ),
        (
            "grad_accum",
            s.grad_accum,
            job.grad_accum,
            "gradient accumulation differs (train.grad_accum)",
            restore,
        ),
        (
            "micro_batches_per_epoch",
            s.micro_batches_per_epoch,
            job.micro_batches_per_epoch,
            "epoch length in micro-batches differs ("
            + (
                "train.stream_epoch_steps x train.grad_accum"
                if job.data.stream is not None
                else "dataset size, train.micro_batch_size"
            )
            + ")",
            restore,
        ),
    ]
    if job.data.samples_per_epoch:
        checks.append(
            (
                "data.samples_per_epoch",
                s.data.samples_per_epoch,
                job.data.samples_per_epoch,
                "samples per epoch differ (dataset size)",
                restore,
            )
        )
    return checks


def _engine_checks(s: TrainState, live: LiveJob) -> list[_Check]:
    """ZeRO stage, precision and optimizer type: what the engine's saved state is laid out by."""
    job = live.identity
    checks: list[_Check] = [
        (
            "zero_stage",
            s.zero_stage,
            job.zero_stage,
            "ZeRO stage differs (deepspeed.zero_stage)",
            "DeepSpeed shards the optimizer state by stage; restore deepspeed.zero_stage.",
        )
    ]
    if job.precision is not None and s.precision is not None:
        checks.append(
            (
                "precision",
                s.precision,
                job.precision,
                "precision differs (deepspeed.precision)",
                "Master weights and loss-scale state are stored per precision; restore deepspeed.precision, "
                "or take the weights into a new run with resume.init_from.",
            )
        )
    if not live.reset_optimizer and job.optimizer.type is not None and s.optimizer.type is not None:
        checks.append(
            (
                "optimizer.type",
                s.optimizer.type,
                job.optimizer.type,
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


def detail_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """Tensors, param groups, the LR schedule and the task's own generators."""
    return (
        tensor_incompatibility(s, live)
        or group_incompatibility(s, live)
        or schedule_incompatibility(s, live)
        or generator_incompatibility(s, live)
        or _user_state_incompatibility(s, live)
    )


def _user_state_resize_refusal(s: TrainState, live: LiveJob) -> str:
    job = live.identity
    return (
        f"world size differs (scaling.num_workers) and the state holds user state (Task.stateful "
        f"{list(s.user_state or ())}): the state has world_size={s.world_size}, this run has {job.world_size}, and "
        f"each rank's objects are its own, so they cannot be re-split. Resume on {s.world_size} worker(s), or "
        "start a new run (resume.init_from takes the weights)."
    )


def _user_state_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """Every rank's user file holds the task's ``Task.stateful`` objects by name: a task with other
    names would continue some from their own fresh state and drop others, silently; and the objects
    are each rank's own, so they continue only on the world size that saved them."""
    job = live.identity
    have, want = tuple(s.user_state or ()), tuple(job.user_state or ())
    if have == want or live.allow_user_state_change:
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


def _stream_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """A stream's position is its per-rank, per-worker state: it continues only the same stream, on
    the same world size, read by as many DataLoader workers, through the same shuffle buffer; and a
    map-style position never continues a stream, nor the other way round."""
    job = live.identity
    have, want = s.data.stream, job.data.stream
    if have is None and want is None:
        return None
    fix = "Restore the previous dataset, or start a new run (another name, or resume.policy: fresh)."
    if have is None or want is None:
        kinds = (
            ("map-style", f"a stream ({want.source if want else None})")
            if have is None
            else (f"a stream ({have.source})", "map-style")
        )
        return (
            f"data kind differs (the task's dataset): the state was written with a {kinds[0]} dataset, this run's "
            f"is {kinds[1]}; one's position cannot continue the other. {fix}"
        )
    if s.world_size != job.world_size:
        return (
            f"world size differs (scaling.num_workers): the state has world_size={s.world_size}, this run has "
            f"{job.world_size}. A stream's position is each rank's own (its shard position, its DataLoader "
            "workers' states and shuffle buffers), so it cannot continue on another number of workers; no stream "
            "re-splits exactly (a datasets stream whose n_shards divides both world sizes is split by shard, but "
            f"each rank's position inside its shards is its own). Resume on {s.world_size} worker(s), or start a "
            "new run (another name, or resume.policy: fresh)."
        )
    if have.source != want.source:
        return (
            f"the stream differs (the task's dataset): a {have.source} stream in the state, {want.source} in "
            f"this run. {fix}"
        )
    if have.dataloader_workers != want.dataloader_workers:
        return differs(
            "data.stream.dataloader_workers",
            have.dataloader_workers,
            want.dataloader_workers,
            "DataLoader workers differ (train.dataloader_workers): each worker reads its own shards of "
            "a stream and keeps its own position in them",
            f"Restore train.dataloader_workers: {have.dataloader_workers}, or start a new run.",
        )
    if have.shuffle_buffer != want.shuffle_buffer:
        return differs(
            "data.stream.shuffle_buffer",
            have.shuffle_buffer,
            want.shuffle_buffer,
            "the stream's shuffle buffer differs (train.stream_shuffle_buffer, or the buffer_size of the "
            "stream's .shuffle): the state holds each worker's buffer and its draws",
            f"Restore a buffer of {have.shuffle_buffer}, or start a new run.",
        )
    difference = identity_difference(have.identity, want.identity)
    if difference:
        return (
            f"the stream differs (the task's dataset): {difference}; a stream's saved position is meaningful only "
            f"in the stream that wrote it. {fix}"
        )
    return None


_NEW_CORPUS = (
    "Restore the corpus the state was trained on (task.config), or start a new run (another name, or "
    "resume.policy: fresh; resume.init_from takes the weights)."
)


def _corpus_incompatibility(s: TrainState, live: LiveJob, c: Candidate | None) -> str | None:
    """Another corpus means other samples at every position: refused from the digest, naming the
    first differing shard from the state's index in the run directory (``Candidate.corpus_index``)."""
    job = live.identity
    have, want = s.data.corpus, job.data.corpus
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
    if c is not None and c.corpus_index is not None and live.corpus_index is not None:
        what = first_difference(c.corpus_index, live.corpus_index)
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


def _order_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """The shard-window order is the user's choice (corpus.shuffle, corpus.window_shards): another
    choice means other samples per step. Between the other samplers a state keeps its own."""
    job = live.identity
    have, want = s.data.sampler == SHARD_WINDOW_SAMPLER, job.data.sampler == SHARD_WINDOW_SAMPLER
    if have != want:
        return (
            f"the epoch order differs (corpus.shuffle): the state uses {s.data.sampler}, this run asks for "
            f"{job.data.sampler}; other samples per step. Restore corpus.shuffle "
            f"({'shard-window' if have else 'global'}), or start a new run (another name, or "
            "resume.policy: fresh)."
        )
    if have and s.data.window_shards != job.data.window_shards:
        return differs(
            "data.window_shards",
            s.data.window_shards,
            job.data.window_shards,
            "shuffle window differs (corpus.window_shards): other samples per step",
            "Restore the previous value, or start a new run (another name, or resume.policy: fresh).",
        )
    return None


def init_from_problem(c: Candidate, live: LiveJob, init_optimizer: bool) -> str | None:
    """Why ``resume.init_from`` cannot take this state, from its trainer record alone (before any
    tensor is read), or None. Weights are matched by name and shape; with ``init_optimizer`` the
    optimizer moments come too, and DeepSpeed stores them flattened per group, per rank and per
    ZeRO stage and precision: any of those differing would fail mid-load or, worse, load moments
    onto the wrong parameters. Each reason names the field and the opt-out."""
    job = live.identity
    s = c.parse().state
    if s is None:
        return f"its trainer.json is unreadable: {c.state_problem}"
    if s.model_fingerprint != job.model_fingerprint:
        return (
            "its model parameters (names/shapes) differ from this run's (task): init_from takes weights by "
            "name and shape; point resume.init_from at a state of the same model"
        )
    buffers = buffer_difference(s, live, dtypes=False)
    if buffers:
        return (
            f"its model buffers differ from this run's (task): {buffers}; init_from takes buffers by name and "
            "shape too: point resume.init_from at a state of the same model"
        )
    if not init_optimizer:
        return None
    opt_out = " Set resume.init_optimizer: false to take the weights only, with a fresh optimizer state."
    checks: list[tuple[str, Any, Any, str]] = [
        ("zero_stage", s.zero_stage, job.zero_stage, "ZeRO stage (deepspeed.zero_stage)"),
        (
            "optimizer.type",
            s.optimizer.type,
            job.optimizer.type,
            "optimizer type (train.optimizer.type / Task.optimizer)",
        ),
    ]
    if not (s.elastic_optimizer and job.elastic):
        checks.append(
            (
                "world_size",
                s.world_size,
                job.world_size,
                "world size (scaling.num_workers): optimizer shards are per rank",
            )
        )
    if s.precision is not None and job.precision is not None:
        checks.append(("precision", s.precision, job.precision, "precision (deepspeed.precision)"))
    for key, have, want, what in checks:
        if have is not None and want is not None and have != want:
            return (
                f"with resume.init_optimizer its {what} must match: the state has {key}={have!r}, this run "
                f"has {want!r}.{opt_out}"
            )
    groups = group_incompatibility(s, replace(live, reset_optimizer=False))
    if groups:
        return (
            "with resume.init_optimizer the "
            + groups.split("; the optimizer moments", 1)[0]
            + "; the optimizer moments are stored per group."
            + opt_out
        )
    return None
