"""One accounting of a run's wall time (``syncpoint.policies.decisions.goodput``), shown alike by the end-of-run
summary, ``syncpoint events`` and the plot: over the journal of a real run interrupted twice (two
injected crashes, each resumed from its newest state), with evaluations and a save at every step."""

from __future__ import annotations

import pytest

from syncpoint.orchestrator.plot import draw
from syncpoint.orchestrator.timeline import badput_lines, format_summary, goodput_headline, summarize
from syncpoint.policies.contracts.journal import Evaluated
from syncpoint.policies.decisions.goodput import BADPUT, goodput
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import cli
from tests.helpers import interrupted_twice as two_interruptions


@pytest.fixture(scope="module")
def interrupted_twice(tmp_path_factory):
    """A linear run with an eval set, crashed at micro-steps 7 and 15, then run to its end."""
    return two_interruptions(tmp_path_factory.mktemp("taxonomy"))


def test_a_real_run_interrupted_twice_is_accounted_by_cause(interrupted_twice):
    journal = EventLog(RunStorage(interrupted_twice.run_url)).journal()
    g = goodput(journal)
    assert g is not None and g.finished and len(g.restarts) == 2
    assert [c.lost_micro_steps for c in g.restarts] == [3, 1]  # 7 after 4; 15 after 14 (epoch 2 begins at 10)
    assert list(g.badput) == [key for key, _ in BADPUT]
    assert g.productive_s > 0 and g.uncommitted_s == 0
    assert g.productive_s + g.badput_s == pytest.approx(g.total_s)
    # each cause against the records it comes from
    assert g.badput["wasted_progress"] == pytest.approx(sum(c.recomputed_s for c in g.restarts))
    assert g.badput["wasted_progress"] > 0
    assert g.badput["checkpoint_save"] == pytest.approx(sum(c.blocked_seconds for c in journal.commits), abs=1e-6)
    evaluations = [e.seconds for e in journal.of_kind(Evaluated)]
    assert 0 < g.badput["evaluation"] <= sum(evaluations) + 1e-9
    restored = [s for a in journal.attempts[1:] for phase, s in a.setup if phase == "selection and state load"]
    assert len(restored) == 2 and g.badput["checkpoint_restore"] >= sum(restored) - 1e-6
    engine = [s for a in journal.attempts[1:] for phase, s in a.setup if phase.startswith("DeepSpeed engine")]
    assert g.badput["compilation"] >= sum(engine) - 1e-6 > 0


def test_the_summary_the_events_and_the_plot_show_the_same_numbers(interrupted_twice, capsys):
    journal = EventLog(RunStorage(interrupted_twice.run_url)).journal()
    g = goodput(journal)
    headline = goodput_headline(g)
    summary = summarize(journal)
    assert summary is not None and summary.goodput == g and summary.restarts == 2
    assert f", {headline}, 2 restarts" in format_summary("linear", summary, None, None)
    rc, out, _ = cli(capsys, "events", interrupted_twice.run_url)
    assert rc == 0 and f"{headline}: productive {g.productive_s:.2f} s of {g.total_s:.2f} s" in out
    for line in badput_lines(g):
        assert line in out
    fig = draw(journal)
    try:
        box = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert box.startswith(f"{headline} ({g.productive_s:.1f} s of {g.total_s:.1f} s)")
    for label, seconds in g.losses.items():
        if seconds > 0:
            assert f"{label} {seconds:.1f} s" in box
