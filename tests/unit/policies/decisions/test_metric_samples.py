"""The run's ``syncpoint_*`` series over hand-built journals (``syncpoint.policies.decisions.metric_samples``):
every goodput value is ``goodput(journal)``'s, restarts are counted by kind, and every sample names a
defined series with bounded labels. Over a real run's journal: tests/integration/orchestrator/
test_metrics_export.py; scraped from Ray's endpoint: tests/ray/test_metrics_on_ray.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Failure,
    Finished,
    Journal,
    Progress,
    ProgressRecord,
    StateCommitted,
    Submitted,
)
from syncpoint.policies.decisions.goodput import BADPUT, goodput
from syncpoint.policies.decisions.metric_samples import (
    BASE_LABELS,
    RESTART_KINDS,
    RESTORE_SOURCES,
    SERIES,
    SERIES_NAMES,
    restore_seconds,
    samples,
    throughput,
)
from tests.unit.policies.decisions.test_goodput import _attempt as goodput_attempt


def _attempt(t: float, n: int, step: int = 0, launched: float | None = None, load_s: float = 0.0) -> AttemptStarted:
    """test_goodput's attempt with rank 0's start-up phases (the restore's among them) and where each rank
    read the state it resumed (rank 1's node had no memory copy)."""
    return goodput_attempt(t, n, step, launched).model_copy(
        update={
            "setup": [("DeepSpeed engine", 0.5), ("selection and state load", load_s)] if launched is not None else [],
            "restored_from": ["memory", "storage"] if step else [],
        }
    )


def _progress(t: float, n: int, *micro_steps: int, dt: float = 0.0) -> Progress:
    """Records of these micro-steps, the last at ``t`` and each ``dt`` before the next."""
    k = len(micro_steps)
    return Progress(
        time=t,
        attempt=n,
        records=[
            ProgressRecord(
                optimizer_step=g // 4, global_micro_step=g, epoch=0, loss=1.0, lr=0.1, time=t - (k - 1 - i) * dt
            )
            for i, g in enumerate(micro_steps)
        ],
    )


def _commit(
    t: float, n: int, step: int, seconds: float = 0.5, blocked: float = 0.2, size: int = 1000
) -> StateCommitted:
    return StateCommitted(
        time=t,
        attempt=n,
        state=f"{step:012d}",
        global_micro_step=step,
        optimizer_step=step // 4,
        bytes=size,
        seconds=seconds,
        blocked_seconds=blocked,
        committed_at_micro_step=step,
        reasons=["interval"],
    )


def _failure(t: float, in_place: bool) -> Failure:
    return Failure(
        time=t,
        classified="application" if in_place else "preemption",
        reason="crash" if in_place else "node lost",
        decision="RETRY",
        ranks=[1],
        messages=[],
        dead_nodes=[] if in_place else ["b"],
        in_place=in_place,
    )


def two_interruptions() -> Journal:
    """Attempt 1 crashes after state 8 (recovered in place), attempt 2 loses a node after state 16 (a new
    worker group), attempt 3 finishes at 32."""
    return Journal(
        [
            Submitted(time=0.0, name="job", address="embedded"),
            _attempt(3.0, 1, launched=1.0),
            _progress(6.0, 1, 4, 8, dt=1.0),
            _commit(6.0, 1, 8),
            _progress(7.0, 1, 10),
            _failure(7.5, in_place=True),
            _attempt(9.0, 2, step=8, launched=8.0, load_s=0.4),
            _progress(12.0, 2, 12, 16, dt=1.5),
            _commit(12.0, 2, 16, seconds=0.8, blocked=0.3, size=2000),
            _progress(13.0, 2, 18),
            _failure(14.0, in_place=False),
            _attempt(18.0, 3, step=16, launched=16.0, load_s=0.6),
            _progress(22.0, 3, 20, 24, 28, 32, dt=1.0),
            _commit(22.0, 3, 32, seconds=0.7, blocked=0.25, size=3000),
            Finished(time=22.5, attempt=3, state=f"{32:012d}", global_micro_step=32, optimizer_step=8),
        ]
    )


def _values(journal: Journal, micro_batch_size: int = 4) -> dict[tuple[str, ...], float]:
    out = samples(journal, job_name="tiny-lm", submission="s", micro_batch_size=micro_batch_size)
    return {(s.series, *(v for k, v in s.labels if k not in BASE_LABELS)): s.value for s in out}


def test_goodput_and_badput_are_goodputs_own_numbers():
    j = two_interruptions()
    g = goodput(j)
    v = _values(j)
    assert v[("syncpoint_goodput_ratio",)] == g.ratio
    assert v[("syncpoint_productive_seconds",)] == g.productive_s
    assert v[("syncpoint_wall_seconds",)] == g.total_s == 22.5
    assert {cause: v[("syncpoint_badput_seconds", cause)] for cause, _ in BADPUT} == g.badput
    assert v[("syncpoint_uncommitted_seconds",)] == g.uncommitted_s == 0.0
    assert v[("syncpoint_finished",)] == 1.0
    assert v[("syncpoint_journal_time_seconds",)] == 22.5


def test_restarts_by_kind_with_their_recovery_and_lost_work():
    j = two_interruptions()
    g = goodput(j)
    v = _values(j)
    assert [v[("syncpoint_restarts", k)] for k in RESTART_KINDS] == [1, 1, 0]
    first, second = g.restarts
    assert v[("syncpoint_recovery_seconds", "in_place")] == pytest.approx(first.restart_gap_s + first.startup_s)
    assert v[("syncpoint_recovery_seconds", "new_worker_group")] == pytest.approx(
        second.restart_gap_s + second.startup_s
    )
    assert v[("syncpoint_last_recovery_seconds",)] == pytest.approx(second.restart_gap_s + second.startup_s)
    assert second.startup_s == 2.0  # launched at 16, started at 18
    assert v[("syncpoint_lost_micro_steps",)] == first.lost_micro_steps + second.lost_micro_steps == 2 + 2


def test_saves_restore_throughput_and_the_newest_state():
    v = _values(two_interruptions(), micro_batch_size=4)
    assert v[("syncpoint_saves",)] == 3
    assert (v[("syncpoint_last_save_blocked_seconds",)], v[("syncpoint_last_save_bytes",)]) == (0.25, 3000)
    assert v[("syncpoint_last_save_durable_seconds",)] == 0.7
    assert v[("syncpoint_last_restore_seconds",)] == 0.6  # attempt 3 loaded state 16
    assert (v[("syncpoint_committed_micro_step",)], v[("syncpoint_committed_optimizer_step",)]) == (32, 8)
    # attempt 3: micro-steps 20..32 (optimizer steps 5..8) in 3 s, 2 ranks x 4 samples a micro-step
    assert v[("syncpoint_step_seconds",)] == pytest.approx(1.0)
    assert v[("syncpoint_samples_per_second",)] == pytest.approx(12 * 2 * 4 / 3)
    assert (v[("syncpoint_attempt",)], v[("syncpoint_optimizer_step",)]) == (3, 8)


def test_every_sample_names_a_defined_series_with_bounded_labels():
    labels_of = {s.name: (*BASE_LABELS, *((s.label,) if s.label else ())) for s in SERIES}
    out = samples(two_interruptions(), job_name="tiny-lm", submission="s", micro_batch_size=1)
    assert {s.series for s in out} == SERIES_NAMES  # this journal has every series
    for s in out:
        assert tuple(k for k, _ in s.labels) == labels_of[s.series]
        values = dict(s.labels)
        assert values["job_name"] == "tiny-lm" and values["submission"] == "s"
        assert values.get("cause", "initialization") in {key for key, _ in BADPUT}
        assert values.get("kind", "in_place") in RESTART_KINDS
        assert values.get("source", "memory") in RESTORE_SOURCES
    assert all(name.startswith("syncpoint_") for name in SERIES_NAMES)


def test_nothing_before_the_first_attempt():
    assert (
        samples(
            Journal([Submitted(time=0.0, name="job", address="embedded")]),
            job_name="j",
            submission="s",
            micro_batch_size=1,
        )
        == []
    )
    assert samples(Journal([]), job_name="j", submission="s", micro_batch_size=1) == []


def test_a_run_still_going_has_its_uncommitted_tail_and_no_finish():
    j = Journal(
        [
            Submitted(time=0.0, name="job", address="embedded"),
            _attempt(2.0, 1, launched=1.0),
            _progress(5.0, 1, 4, 8, dt=1.0),
            _commit(5.0, 1, 8),
            _progress(9.0, 1, 12, 16, dt=1.0),
        ]
    )
    g = goodput(j)
    v = _values(j)
    assert v[("syncpoint_uncommitted_seconds",)] == g.uncommitted_s > 0
    assert v[("syncpoint_finished",)] == 0.0
    assert ("syncpoint_last_recovery_seconds",) not in v and ("syncpoint_last_restore_seconds",) not in v
    assert [v[("syncpoint_restarts", k)] for k in RESTART_KINDS] == [0, 0, 0]


def test_a_new_submission_after_a_stop_counts_once_and_keeps_the_state_it_resumed():
    """A finished run, then a submission stopped after its commit at 8, then one that resumes it: one
    restart by a new submission (the finished run before is another run), its newest state 8 until it
    commits its own, its goodput its own submission's."""
    j = Journal(
        [
            Submitted(time=0.0, name="job", address="embedded"),
            _attempt(1.0, 1),
            Finished(time=2.0, attempt=1, state=None, global_micro_step=4, optimizer_step=1),
            Submitted(time=10.0, name="job", address="embedded"),
            _attempt(12.0, 2, launched=11.0),
            _progress(15.0, 2, 4, 8, dt=1.0),
            _commit(15.0, 2, 8),
            Submitted(time=30.0, name="job", address="embedded"),
            _attempt(33.0, 3, step=8, launched=31.0, load_s=0.3),
            _progress(35.0, 3, 10, dt=1.0),
        ]
    )
    v = _values(j)
    assert [v[("syncpoint_restarts", k)] for k in RESTART_KINDS] == [0, 0, 1]
    assert v[("syncpoint_saves",)] == 0 and ("syncpoint_last_save_bytes",) not in v
    assert v[("syncpoint_committed_micro_step",)] == 8
    assert v[("syncpoint_wall_seconds",)] == goodput(j).total_s == 5.0
    assert v[("syncpoint_last_restore_seconds",)] == 0.3


def test_restore_seconds_only_for_a_resumed_attempt():
    assert restore_seconds(_attempt(2.0, 1, launched=1.0, load_s=0.4)) is None  # fresh: nothing restored
    assert restore_seconds(_attempt(2.0, 2, step=8, launched=1.0, load_s=0.4)) == 0.4
    assert restore_seconds(_attempt(2.0, 2, step=8)) is None  # start-up not measured (older logs)


def test_throughput_reads_the_newest_window_only():
    old = _progress(10.0, 1, 4, 8, dt=5.0).records  # 2 micro-steps a second... long ago
    new = _progress(100.0, 1, 40, 44, 48, dt=2.0).records  # 8 micro-steps in 4 s
    step_s, per_s = throughput(old + new, samples_per_micro_step=2)
    assert step_s == pytest.approx(2.0) and per_s == pytest.approx(8 * 2 / 4)
    assert throughput(new[:1], 2) == (None, None)  # one record spans no time
    assert throughput([], 2) == (None, None)


def test_docs_list_every_series_with_its_label():
    root = Path(__file__).resolve().parents[4]
    rows = {
        line.split("|")[1].strip(" `"): line.split("|")[2].strip(" `")
        for line in (root / "docs" / "metrics.md").read_text().splitlines()
        if line.startswith("| `syncpoint_")
    }
    assert rows == {s.name: s.label or "" for s in SERIES}


def test_the_restored_ranks_by_source_are_the_newest_attempts():
    """Where each rank of the newest attempt read its state (``AttemptStarted.restored_from``); none
    from scratch, and none from an older log that does not say."""
    v = {
        (s.series, *dict(s.labels).values()): s.value
        for s in samples(two_interruptions(), job_name="j", submission="s", micro_batch_size=1)
    }
    assert (
        v[("syncpoint_restored_ranks", "j", "s", "memory")],
        v[("syncpoint_restored_ranks", "j", "s", "storage")],
    ) == (1, 1)
    fresh = Journal([Submitted(time=0.0, name="j", address="embedded"), _attempt(1.0, 1)])
    assert not [
        s
        for s in samples(fresh, job_name="j", submission="s", micro_batch_size=1)
        if s.series == "syncpoint_restored_ranks"
    ]
