"""The grace window's save policy (``syncpoint.policies.decisions.grace_window``) and the notices' deadlines."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncpoint.policies.decisions.grace_window import SLACK_S, kept_in_window, margin_s, notice_deadline, save_due
from syncpoint.workers.supervision.preemption import PreemptionNotices


def test_ray_drain_notices_carry_their_deadline_in_unix_milliseconds():
    assert notice_deadline(
        {"source": "ray-drain", "deadline_ms": 1_700_000_000_500}, sigterm_at=None, sigterm_grace_s=None
    ) == (1_700_000_000.5)


@pytest.mark.parametrize("deadline_ms", [0, -5, None, float("nan"), float("inf"), "soon", True])
def test_a_drain_without_a_usable_deadline_has_none(deadline_ms):
    notice = {"source": "ray-drain", "deadline_ms": deadline_ms}
    assert (
        notice_deadline(notice, sigterm_at=100.0, sigterm_grace_s=30.0) is None
    )  # not a SIGTERM: its grace is not this


def test_a_sigterm_has_a_deadline_only_when_the_spec_gives_its_grace():
    assert notice_deadline({"source": "sigterm"}, sigterm_at=100.0, sigterm_grace_s=30.0) == 130.0
    assert notice_deadline({"source": "sigterm"}, sigterm_at=100.0, sigterm_grace_s=None) is None
    assert notice_deadline({"source": "sigterm"}, sigterm_at=None, sigterm_grace_s=30.0) is None


def test_without_a_deadline_or_a_measurement_every_boundary_saves():
    assert save_due(0.0, None, 0.1, 0.1)
    assert save_due(0.0, 1e9, None, 0.1)  # no step measured yet
    assert save_due(0.0, 1e9, 0.1, None)  # no save measured yet


def test_with_a_deadline_only_the_boundaries_within_the_margin_save():
    step, commit = 0.2, 0.3
    m = margin_s(step, commit)
    assert m == pytest.approx(2 * (0.2 + 0.3) + SLACK_S)
    deadline = 100.0
    assert not save_due(deadline - m - 0.01, deadline, step, commit)  # the next boundary is still safe
    assert save_due(deadline - m, deadline, step, commit)  # the next one might be too late: save here
    assert save_due(deadline + 5, deadline, step, commit)  # past it (the node stayed): every boundary


def test_the_simulator_model_keeps_more_with_a_deadline():
    step, c = 0.06, 0.04
    without = kept_in_window(30.0, step, c, c, deadline=False)
    with_deadline = kept_in_window(30.0, step, c, c, deadline=True)
    assert without == pytest.approx((30 - step) * step / (step + c))  # 60% of the window: every boundary saves
    assert with_deadline > 28.0 > without  # only the margin's boundaries save
    assert kept_in_window(0.5, step, c, c, deadline=True) == kept_in_window(0.5, step, c, c, deadline=False)
    assert kept_in_window(0.01, step, c, c, deadline=True) == 0.0


def test_notices_remember_when_the_sigterm_came():
    notices = PreemptionNotices()
    notices.send_sigterm()  # off the handler: recorded as the handler would
    first = notices.sigterm_at
    assert first is not None and notices.poll() == {"source": "sigterm"}
    notices.send_sigterm()  # a second SIGTERM does not move the deadline
    assert notices.sigterm_at == first
    assert notices.deadline({"source": "sigterm"}, 30.0) == pytest.approx(first + 30.0)


@settings(max_examples=300, deadline=None)
@given(
    step=st.floats(0.01, 5.0),
    commit=st.floats(0.001, 10.0),
    lead=st.floats(0.0, 300.0),
    jitter=st.lists(st.floats(0.5, 1.0), min_size=1, max_size=50),
)
def test_a_window_whose_steps_and_saves_stay_as_measured_commits_before_its_deadline(step, commit, lead, jitter):
    """Walk a window boundary by boundary as the loop does (each step and save no longer than the
    longest measured): once the notice's state is committed, the policy's next save always commits
    before the deadline, and no boundary before the margin saves."""
    deadline, now, commits, k = lead, 0.0, [], 0
    now += commit  # the notice's own save
    commits.append(now)
    while now < deadline:
        now += step * jitter[k % len(jitter)]  # the next boundary
        k += 1
        if save_due(now, deadline, step, commit):
            now += commit * jitter[k % len(jitter)]
            commits.append(now)
            break
    if lead >= commit + margin_s(step, commit) + step:  # a window long enough for a planned save
        assert len(commits) == 2 and commits[1] <= deadline
        assert commits[1] >= deadline - margin_s(step, commit) - step  # trained on until the margin
