"""The live job and a state hold one identity model, and selection compares it field by field."""

from __future__ import annotations

import pytest

from syncpoint.policies.contracts.corpus_identity import CorpusSummary
from syncpoint.policies.contracts.state_format import SHARD_WINDOW_SAMPLER, TrainState
from syncpoint.policies.contracts.state_identity import DataIdentity, StateIdentity
from syncpoint.policies.decisions.candidates import LiveJob, Verdict, classify
from tests.meta import candidate_for, changed, live

EXP = live(
    "j",
    1,
    1,
    4,
    10,
    0,
    "f",
    3,
    precision="fp32",
    optimizer_type="adamw",
    param_groups=((2, 10, "aa"),),
    scheduler_type="cosine",
    scheduler_phases=("cosine",),
    model_buffers=(("bn.running_mean", (4,), "float32"),),
    parameter_dtypes=("float32", ()),
    task_generators=(("loss.<locals>.g", "torch.Generator(cpu)"),),
    user_state=("ema",),
    num_samples=10,
    samples_per_epoch=10,
    global_batch=4,
)

# Each identity field, changed in the live job: the state written by EXP must be refused for it.
CHANGES = {
    "job_identity": {"job_identity": "another"},
    "world_size": {"world_size": 2},
    "micro_batch_size": {"micro_batch_size": 2},
    "grad_accum": {"grad_accum": 2},
    "micro_batches_per_epoch": {"micro_batches_per_epoch": 20},
    "zero_stage": {"zero_stage": 2},
    "precision": {"precision": "bf16"},
    "model_fingerprint": {"model_fingerprint": "g"},
    "model_buffers": {"model_buffers": (("bn.running_mean", (8,), "float32"),)},
    "parameter_dtypes": {"parameter_dtypes": ("bfloat16", ())},
    "seed": {"seed": 4},
    "optimizer.type": {"optimizer_type": "sgd"},
    "optimizer.param_groups": {"param_groups": ((1, 5, "aa"), (1, 5, "bb"))},
    "scheduler.type": {"scheduler_type": "linear"},
    "scheduler.phases": {"scheduler_phases": ("linear_warmup", "cosine")},
    "data.num_samples": {"num_samples": 11},
    "data.samples_per_epoch": {"samples_per_epoch": 20},
    # compared where a resize may happen (at one world size, grad_accum and micro_batch_size fix it)
    "data.global_batch": {"global_batch": 8, "elastic": True, "world_size": 2},
    "data.sampler": {"sampler": SHARD_WINDOW_SAMPLER, "window_shards": 2},
    "data.window_shards": {"window_shards": 2},  # with the shard-window sampler on both sides (below)
    "data.corpus": {"corpus": CorpusSummary("d" * 64, 2, 10)},
    "data.stream": {
        "stream": {"source": "custom", "identity": {"class": "S"}, "dataloader_workers": 0, "shuffle_buffer": 0},
        "sampler": "stream/v1",
    },
    "task_generators": {"task_generators": (("loss.<locals>.noise", "torch.Generator(cpu)"),)},
    "user_state": {"user_state": ("ema", "scale")},
}
# Identity fields that are no refusal of their own, and why.
NOT_COMPARED = {
    "elastic": "a mode: it says how another world size is judged (by the elastic rules), not a difference",
    "scheduler.unit": "the schedule's position is continued in the live spec's unit",
    "optimizer.running": "running state the state supplies, recorded for the writer, not the live job",
}


def _identity_fields() -> set[str]:
    nested = {"data": DataIdentity, "optimizer": None, "scheduler": None}
    out = set()
    for name, info in StateIdentity.model_fields.items():
        if name not in nested:
            out.add(name)
            continue
        model = nested[name] or info.annotation
        fields = getattr(model, "model_fields", None) or _model_of(info.annotation).model_fields
        out |= {f"{name}.{sub}" for sub in fields}
    return out


def _model_of(annotation):
    return next(a for a in getattr(annotation, "__args__", ()) if hasattr(a, "model_fields"))


def test_every_identity_field_is_compared_or_says_why_not():
    assert _identity_fields() == set(CHANGES) | set(NOT_COMPARED)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_selection_refuses_each_identity_field_changed(field):
    base = EXP
    if field == "data.window_shards":
        base = changed(EXP, sampler=SHARD_WINDOW_SAMPLER, window_shards=3)
    if field == "data.global_batch":
        base = changed(EXP, user_state=None)  # user state is never re-split, whatever the batch
    c = classify(candidate_for(8, base), base)
    assert c.verdict is Verdict.RESUMABLE, c.reason
    refused = classify(candidate_for(8, base), changed(base, **CHANGES[field]))
    assert refused.verdict is Verdict.INCOMPATIBLE, (field, refused.reason)
    assert "corrupt" not in refused.reason  # a mismatch with the live job is never corruption
    if field == "data.global_batch":
        assert "data.global_batch" in refused.reason, refused.reason


def test_a_states_identity_is_the_live_jobs_it_was_written_by():
    state = TrainState.model_validate(candidate_for(8, EXP).trainer)
    assert isinstance(state, StateIdentity)
    assert LiveJob(state.identity()) == EXP
