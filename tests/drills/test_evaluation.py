"""Evaluation on two ZeRO-3 ranks whose evaluation shards are uneven: on vs off is the same run, and a
hard crash between an evaluation and the next save gives the same evaluations."""

from __future__ import annotations

from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import (
    digest,
    lm_spec,
    state_names,
    step_history,
)
from tests.integration.workers.training.test_evaluation import all_evaluations, evaluations


def test_zero3_two_ranks_uneven_eval_shards(tmp_path):
    """5 eval samples on 2 ranks in batches of 2: rank 0 has 2 batches, rank 1 one; rank 1 runs a
    weight-0 forward so ZeRO-3's parameter all-gathers pair up. On vs off: the same run; a hard crash
    between an evaluation and the next save: the same evaluations."""
    common = (
        "task.config.num_samples=36",
        "task.config.eval_samples=5",
        "train.grad_accum=2",
        "train.epochs=1",
        "deepspeed.zero_stage=3",
        "checkpoint.save_every={value: 2, unit: optimizer_steps}",
    )
    off = lm_spec(tmp_path / "off", *common, "train.eval_every=0", workers=2)
    on = lm_spec(tmp_path / "on", *common, "train.eval_every=1 optimizer_steps", workers=2)
    assert run_spawned(off) == [0, 0] and run_spawned(on) == [0, 0]
    final = max(state_names(off))
    assert max(state_names(on)) == final and digest(off, final) == digest(on, final)
    h_off, h_on = step_history(off), step_history(on)
    assert all(h_off[k].loss == h_on[k].loss for k in h_off) and h_off.keys() == h_on.keys()
    # 9 micro-batches of 2 x 2 samples, accumulation 2: steps end at micro-steps 2, 4, 6, 8, 9
    assert sorted(evaluations(on)) == [1, 2, 3, 4, 5]
    # rank 1 dies hard after micro-step 6: step 3 was evaluated there, the last save was step 2 (micro-step 4)
    crashed = lm_spec(
        tmp_path / "crash",
        *common,
        "train.eval_every=1 optimizer_steps",
        "faults=[{rank: 1, at_micro_step: 6}]",
        workers=2,
    )
    assert run_spawned(crashed)[1] == 17
    assert run_spawned(crashed) == [0, 0]
    assert evaluations(crashed) == evaluations(on)
    assert [e.optimizer_step for e in all_evaluations(crashed)] == [1, 2, 3, 3, 4, 5]
    assert all(e.metrics == evaluations(on)[e.optimizer_step] for e in all_evaluations(crashed))
    assert digest(crashed, final) == digest(on, final)
