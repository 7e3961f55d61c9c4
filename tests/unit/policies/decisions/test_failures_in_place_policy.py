"""The in-place recovery decision as plain functions: which rank's end says why a generation failed,
the facts it classifies, and RECOVER vs ESCALATE against the budget. A property test walks every
combination of ends, verdict, repeat and budget."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from syncpoint.policies.contracts.journal import Failure, Journal
from syncpoint.policies.decisions.failures import (
    APPLICATION,
    DIED,
    ESCALATE,
    FINISHED,
    GENERATION_MOVES,
    PREEMPTION,
    RAISED,
    RECOVER,
    REFUSAL,
    STOPPED,
    FailureVerdict,
    GenerationState,
    InPlaceAction,
    RankEnd,
    RankStatus,
    after_generation,
    classify_failure,
    failing_end,
    in_place_action,
    in_place_facts,
    move,
)

LOST = "RuntimeError: Connection closed by peer [127.0.0.1]:1234"


def test_the_failing_rank_is_the_one_whose_own_error_says_why():
    ends = [
        RankEnd(0, RAISED, message=LOST, signature="lost"),
        RankEnd(1, DIED, message="rank 1's training process exited with code 17", signature="died"),
        RankEnd(2, STOPPED),
    ]
    assert failing_end(ends) == ends[1]  # a peer's lost connection is a consequence
    ours = RankEnd(2, RAISED, message="refused", ours=True, refusal="refused")
    assert failing_end([*ends[:2], ours]) == ours  # syncpoint's own refusal first
    assert failing_end([RankEnd(0, FINISHED), RankEnd(1, STOPPED)]) is None


def test_facts_name_the_cause_first_and_never_a_dead_node():
    ends = [RankEnd(0, RAISED, message=LOST), RankEnd(1, RAISED, message="ValueError: bug", micro_step=9)]
    facts = in_place_facts(ends, notice_logged=False, repeats=False)
    assert facts.messages == ("ValueError: bug", LOST) and facts.micro_step == 9
    assert facts.dead_attempt_nodes == () and not facts.ray_says_preempted
    assert classify_failure(facts).kind == APPLICATION
    assert classify_failure(in_place_facts(ends, notice_logged=True, repeats=False)).kind == PREEMPTION
    refused = [RankEnd(0, RAISED, message="no", ours=True, refusal="train.eval_every needs an eval set")]
    assert classify_failure(in_place_facts(refused, False, False)).kind == REFUSAL


@given(
    kind=st.sampled_from([APPLICATION, PREEMPTION, REFUSAL]),
    repeats=st.booleans(),
    retried=st.integers(0, 6),
    max_failures=st.integers(-1, 6),
)
def test_only_an_application_failure_within_budget_recovers_in_place(kind, repeats, retried, max_failures):
    action = in_place_action(FailureVerdict(kind, "why"), repeats, retried, max_failures)
    within = max_failures == -1 or retried < max_failures
    assert action == (RECOVER if kind == APPLICATION and not repeats and within else ESCALATE)


def test_the_budget_counts_retries_of_the_submission_in_place_and_by_ray():
    def failure(t: float, submission: str, classified, decision: str, in_place: bool) -> Failure:
        return Failure(
            time=t,
            source="x",
            classified=classified,
            reason="r",
            decision=decision,
            ranks=[1],
            messages=[],
            dead_nodes=[],
            submission=submission,
            in_place=in_place,
        )

    journal = Journal(
        [
            failure(1, "a", APPLICATION, "RETRY", True),
            failure(2, "a", APPLICATION, "RETRY", False),
            failure(3, "a", PREEMPTION, "RETRY", False),
            failure(4, "b", APPLICATION, "RETRY", True),
            failure(5, "a", APPLICATION, "RAISE", False),
        ]
    )
    assert journal.retried("a", APPLICATION) == 2
    assert journal.retried("a", PREEMPTION) == 1
    assert journal.retried("b", APPLICATION) == 1


# ---------------------------------------------------------------- a generation's states


def _walk(ends: list[RankEnd], action: InPlaceAction) -> list[GenerationState]:
    """The states a supervisor's loop passes through for one generation ending with ``ends``."""
    state, seen = GenerationState.RUNNING, [GenerationState.RUNNING]
    state = move(state, GenerationState.ENDED)
    seen.append(state)
    asked: list[bool] = []
    state = move(state, after_generation(ends, lambda: asked.append(True) or action))
    seen.append(state)
    if state == GenerationState.RECOVERING:
        seen.append(move(state, GenerationState.RUNNING))
    assert asked == ([] if all(e.status == FINISHED for e in ends) else [True])  # rank 0 asked only for a failure
    return seen


@given(st.lists(st.sampled_from(list(RankStatus)), min_size=1, max_size=4), st.sampled_from(list(InPlaceAction)))
def test_a_generation_finishes_recovers_or_escalates_through_the_listed_moves(statuses, action):
    ends = [RankEnd(rank=r, status=s) for r, s in enumerate(statuses)]
    seen = _walk(ends, action)
    if all(s == FINISHED for s in statuses):
        assert seen[-1] == GenerationState.FINISHED
    elif action == RECOVER:
        assert seen[-2:] == [GenerationState.RECOVERING, GenerationState.RUNNING]
    else:
        assert seen[-1] == GenerationState.ESCALATED


def test_the_final_states_have_no_move_and_an_unlisted_move_is_refused():
    assert [s for s, nxt in GENERATION_MOVES.items() if not nxt] == [
        GenerationState.FINISHED,
        GenerationState.ESCALATED,
    ]
    assert set(GENERATION_MOVES) == set(GenerationState)
    with pytest.raises(ValueError, match="cannot go from finished to running"):
        move(GenerationState.FINISHED, GenerationState.RUNNING)
    with pytest.raises(ValueError, match="cannot go from running to recovering"):
        move(GenerationState.RUNNING, GenerationState.RECOVERING)


def test_a_rank_status_and_an_action_are_their_text_on_the_wire():
    assert RankStatus("died") is DIED and InPlaceAction("escalate") is ESCALATE
    assert [str(s) for s in RankStatus] == ["finished", "raised", "died", "stopped"]
