"""Elastic resume: continue on fewer (or more) workers with the same global batch and samples.

Bitwise equality is not expected across world sizes: the same samples are summed in another
order (two ranks' partial gradients all-reduced vs eight micro-batches accumulated on one rank),
and float addition is not associative. The tolerance follows from that alone (dropout is off, so no
RNG-dependent op differs; per-rank RNG streams are re-derived on a world-size change, see docs/concepts/elastic.md):
per-step losses agree to 1e-3 relative; each weight differs by at most 2 x the sum of the learning
rates since the change (Adam's update is ~lr per step whatever the gradient's size, and for
gradients at rounding-noise level its sign is noise), and on average by far less.
"""

from __future__ import annotations

import pytest

from syncpoint.policies.contracts.errors import ElasticLayoutError
from syncpoint.policies.decisions.candidates import Verdict, classify
from syncpoint.policies.decisions.elastic import allowed_world_sizes, layout
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import lm_spec, state_names, step_history, trainer_json
from tests.integration.workers.training.test_loop_exact_resume import module_params
from tests.meta import changed, live


def _spec(tmp, *extra):
    return lm_spec(
        tmp,
        "scaling.num_workers={min: 1, max: 2}",
        "task.config.num_samples=40",
        "task.config.dropout=0",
        "train.grad_accum=4",
        "train.epochs=2",
        "train.record_samples=true",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *extra,
        workers=2,
    )


def test_layout_keeps_the_global_batch():
    assert allowed_world_sizes(2, 4, 1, 2) == [1, 2]
    assert allowed_world_sizes(2, 1, 1, 3) == [1, 3]  # G = 6: two workers would need accumulation 1.5
    two, one = layout(41, 2, 4, 2, 1, 2), layout(41, 2, 4, 1, 1, 2)
    assert (two.grad_accum, one.grad_accum) == (4, 8) and two.global_batch == one.global_batch == 16
    assert two.samples_per_epoch == one.samples_per_epoch == 40
    assert (two.micro_batches_per_epoch, one.micro_batches_per_epoch) == (10, 20)
    with pytest.raises(ElasticLayoutError, match=r"World sizes that work: \[1, 3\]"):
        layout(60, 2, 1, 2, 1, 3)


def test_spec_refuses_a_range_with_unworkable_world_sizes():
    from syncpoint.policies.contracts.errors import SpecError

    with pytest.raises(SpecError, match=r"world sizes that work: \[1, 3\]"):
        lm_spec("/tmp/x", "scaling.num_workers={min: 1, max: 3}", "train.grad_accum=1", workers=3)


def test_non_elastic_state_from_another_world_size_is_incompatible_with_reason():

    from tests.meta import candidate_for

    exp = live("j", 1, 2, 8, 20, 2, "f", 1, elastic=True, global_batch=16, samples_per_epoch=40)
    saved_on_2 = changed(exp, world_size=2, grad_accum=4, micro_batches_per_epoch=10, elastic=False)
    c = classify(candidate_for(4, saved_on_2), exp)
    assert c.verdict is Verdict.INCOMPATIBLE and "cannot load on 1" in c.reason
    elastic_on_2 = changed(saved_on_2, elastic=True)
    assert classify(candidate_for(4, elastic_on_2), exp).verdict is Verdict.RESUMABLE


def _assert_same_samples_and_close(ref, spec):
    a, b = step_history(ref), step_history(spec)
    assert sorted(a) == sorted(b)
    for step in a:
        assert b[step].samples == a[step].samples, f"optimizer step {step} consumed other samples"
        assert b[step].lr == a[step].lr
        assert b[step].loss == pytest.approx(a[step].loss, rel=1e-3)
    pa, pb = module_params(ref, state_names(ref)[-1]), module_params(spec, state_names(spec)[-1])
    # Adam moves each weight by at most ~lr per step whatever the gradient's size, and for weights
    # whose gradient is at rounding-noise level the direction itself is noise: so the per-element
    # bound is 2 x (sum of the learning rates of the steps after the world-size change).
    bound = 2 * sum(b[s].lr for s in b if s > min(b))
    for k in pa:
        diff = (pa[k] - pb[k]).abs()
        assert diff.max().item() <= bound, (k, diff.max().item(), bound)
        assert diff.mean().item() <= 0.05 * bound, (k, diff.mean().item())  # the typical weight: far closer


@pytest.mark.slow
@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.long), 2])
def test_two_workers_lose_one_and_finish_on_one(tmp_path, zero):
    ref = _spec(tmp_path / "ref", f"deepspeed.zero_stage={zero}")
    assert run_spawned(ref) == [0, 0]
    spec = _spec(tmp_path / "run", f"deepspeed.zero_stage={zero}", "faults=[{rank: 1, at_micro_step: 13}]")
    assert run_spawned(spec)[1] == 17  # a node is gone and no replacement comes
    assert run_spawned(spec, world_size=1) == [0]  # continue on the one worker left
    last = trainer_json(spec, state_names(spec)[-1])
    assert (last["world_size"], last["grad_accum"]) == (1, 8)
    _assert_same_samples_and_close(ref, spec)
