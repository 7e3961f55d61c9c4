"""The drill's verdict on an elastic run (a world-size change) follows the documented rules.

Plain data: journals' step records as the drill reads them, no Ray. The Ray drill itself (a node
lost without replacement, dropout on) is in ``tests/drills/ray/test_corpus_runs.py``.
"""

from __future__ import annotations

from syncpoint.orchestrator.drill import judge_resized, world_size_change
from syncpoint.policies.contracts.journal import AttemptStarted, Journal, Step


def _steps(losses: list[float], *, samples_shift: int = 0, lr_at: dict[int, float] | None = None) -> dict[int, Step]:
    return {
        k: Step(
            optimizer_step=k,
            global_micro_step=4 * k,
            epoch=1,
            loss=loss,
            lr=(lr_at or {}).get(k, 0.1),
            samples=[2 * k + samples_shift, 2 * k + 1],
        )
        for k, loss in enumerate(losses, start=1)
    }


REF = [3.0, 2.8, 2.6, 2.5, 2.4]


def test_dropout_makes_losses_differ_after_the_change_and_the_verdict_follows_the_rules():
    run = _steps(REF[:2] + [2.7, 2.3, 2.45])  # after step 2 another world size draws other dropout masks
    ok, lines = judge_resized(_steps(REF), run, 2, [1, 2])
    assert ok
    assert lines[0] == "per-step losses and learning rates before the world-size change (steps 1-2): match"
    assert lines[1] == "world sizes [1, 2]: samples and learning rate of every optimizer step: match"
    assert lines[2].startswith("per-step losses after the change: differ (largest relative difference 8.0e-02")
    assert "not part of the verdict" in lines[2]


def test_without_randomness_the_losses_after_the_change_are_within_the_summation_tolerance():
    ok, lines = judge_resized(_steps(REF), _steps(REF[:2] + [x * (1 + 1e-6) for x in REF[2:]]), 2, [1, 2])
    assert ok and lines[2] == "per-step losses after the change: within 1e-3 relative (3 steps)"


def test_a_difference_before_the_change_fails():
    ok, lines = judge_resized(_steps(REF), _steps([3.0, 2.8000001] + REF[2:]), 2, [1, 2])
    assert not ok and lines[0].endswith("MISMATCH")


def test_other_samples_or_learning_rates_after_the_change_fail():
    assert not judge_resized(_steps(REF), _steps(REF, samples_shift=1), 2, [1, 2])[0]
    ok, lines = judge_resized(_steps(REF), _steps(REF, lr_at={4: 0.2}), 2, [1, 2])
    assert not ok and lines[1].endswith("MISMATCH")


def test_a_missing_step_fails():
    run = _steps(REF)
    del run[5]
    assert not judge_resized(_steps(REF), run, 2, [1, 2])[0]


def test_the_change_is_where_an_attempt_resumed_on_another_world_size():
    def start(attempt: int, world: int, step: int) -> AttemptStarted:
        return AttemptStarted(
            attempt=attempt,
            world_size=world,
            nodes=[],
            submission="s",
            resumed_from=None,
            global_micro_step=4 * step,
            optimizer_step=step,
        )

    assert world_size_change(Journal([start(1, 2, 0), start(2, 2, 3), start(3, 1, 6)])) == 6
    assert world_size_change(Journal([start(1, 2, 0), start(2, 2, 3)])) == 0


def test_a_failed_reference_run_is_the_verdict_with_its_last_line():
    """A reference run that failed has no steps: the verdict names its failure and last line instead of
    comparing ("per-step losses: MISMATCH (0 optimizer steps)" reads as a resume bug)."""
    from syncpoint.orchestrator.drill import reference_failed
    from syncpoint.orchestrator.interruptions import InterruptionKind

    line = "syncpoint: job 'tiny-lm-drill-ref' failed: Task.loss must return the batch's loss as a 0-d tensor"
    report = reference_failed([5, 9], [InterruptionKind.CRASH, InterruptionKind.NODE], line)
    assert not report.ok
    assert report.table.splitlines() == [
        "drill: crash at micro-step 5, node lost after micro-step 9",
        "the reference run (uninterrupted) failed, so there is nothing to compare the interrupted run with; its last "
        "line:",
        f"  {line}",
        "RESULT: FAILED (the reference run failed)",
    ]
