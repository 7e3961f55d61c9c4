"""A preemption notice in the real loop (one process, no Ray): the notice's boundary commits; with a
known deadline the window then trains without saving until the last boundaries before it, and
without one every boundary commits. The numerics never change: the run ends where an
uninterrupted one does.

Why the deadline case checks the loop's decisions and not the wall clock: whether a save commits
before the deadline in real time depends on how starved this process is (``make test`` runs this
half at nice 19 beside the Ray half; CI once saw a commit 1 s late after a step and save took more
than twice what they measured). The policy's promise for the times it measured is its own
hypothesis walk (tests/unit/policies/decisions/test_grace_window.py); here the test checks that the loop feeds it the
right times (the notice's deadline, wall-clock now, the measured step and save) and acts on every
answer it gets.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from syncpoint.policies.decisions import grace_window
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_in_process
from tests.helpers import digest, lm_spec, run, state_names

ACCUM = 2
RUN = (
    "task.path=tests.tasks:paced_lm",
    "task.config.pace_s=0.02",
    "train.epochs=1",
    f"train.grad_accum={ACCUM}",
    "train.eval_every=0",
    "checkpoint.save_every={value: 0, unit: micro_steps}",
)
NOTICE_AT_BOUNDARY = 4
# With a deadline, the window is long enough that a notice save slowed several times over (make
# test's non-Ray half runs at nice 19 beside the Ray half: the policy then plans from what it
# measured, and once planned its next save two boundaries on) still leaves room to train first.
DEADLINE_AFTER_S = 6.0
SAMPLES = {True: 800, False: 480}  # 400 micro-steps (>= 8 s) with a deadline; 240 without


def _notice_after_a_few_boundaries(deadline: bool) -> tuple[Any, dict[str, float]]:
    """Ray's notice as ``get_preemption_info`` gives it, from the 4th boundary on (asked once a boundary)."""
    seen: dict[str, float] = {"calls": 0}

    def notice() -> dict[str, Any] | None:
        seen["calls"] += 1
        if seen["calls"] < NOTICE_AT_BOUNDARY:
            return None
        seen.setdefault("deadline", time.time() + DEADLINE_AFTER_S)
        return {
            "source": "ray-drain",
            "deadline_ms": int(seen["deadline"] * 1000) if deadline else 0,
            "nodes": ["n"],
            "ranks": [0],
        }

    return notice, seen


def _recording_decisions(monkeypatch) -> list[dict[str, Any]]:
    """Every grace-window decision the loop asks for, with its inputs and answer (the real policy answers)."""
    asked: list[dict[str, Any]] = []
    real = grace_window.save_due

    def save_due(now: float, deadline: float | None, step_s: float | None, commit_s: float | None) -> bool:
        due = real(now, deadline, step_s, commit_s)
        asked.append({"now": now, "deadline": deadline, "step_s": step_s, "commit_s": commit_s, "due": due})
        return due

    monkeypatch.setattr(grace_window, "save_due", save_due)
    return asked


def _preemption_commits(spec) -> list[dict[str, Any]]:
    events = EventLog(RunStorage(spec.run_url)).read_all()
    return [e for e in events if e["kind"] == "state_committed" and "preemption" in e["reasons"]]


@pytest.mark.parametrize("deadline", [True, False], ids=["deadline", "no-deadline"])
def test_the_grace_window_saves_at_the_notice_then_near_the_deadline(tmp_path, monkeypatch, deadline):
    spec = lm_spec(tmp_path / "run", *RUN, f"task.config.num_samples={SAMPLES[deadline]}")
    notice, seen = _notice_after_a_few_boundaries(deadline)
    asked = _recording_decisions(monkeypatch)
    started = time.time()
    run_in_process(spec, print_progress=False, preemption_notice=notice)
    ended = time.time()
    commits = _preemption_commits(spec)
    first, later = commits[0], commits[1:]
    assert first["global_micro_step"] == NOTICE_AT_BOUNDARY * ACCUM  # the notice's own boundary commits
    steps = [c["global_micro_step"] for c in commits]
    if not deadline:  # the node may go at any moment: every boundary of the window commits
        assert steps == list(range(steps[0], steps[-1] + 1, ACCUM)) and len(steps) > 10
        assert all(a["deadline"] is None and a["due"] for a in asked)
        return
    assert later, "a save is due again before the deadline"
    gap = later[0]["global_micro_step"] - first["global_micro_step"]
    assert gap >= 5 * ACCUM, f"the window trained on without saving: {steps[:8]}"
    # which later boundaries save is the policy's answer to what was measured there (a step slowed by a
    # loaded machine makes a save due sooner, a faster one later): no fixed pattern is asserted, but each
    # decision's inputs and that every answer is acted on (tests/unit/policies/decisions/test_grace_window.py has the
    # policy
    # itself, on steady inputs)
    # one decision a boundary from the notice's on, made on the right inputs: the notice's deadline,
    # the wall clock (the deadline's base), a measured step of at least its paced micro-steps, and
    # the last save's measured start-to-commit time once the notice's save has committed
    assert len(asked) == steps[-1] // ACCUM - NOTICE_AT_BOUNDARY + 1
    assert all(a["deadline"] == pytest.approx(seen["deadline"], abs=1e-3) for a in asked)
    assert all(started <= a["now"] <= ended for a in asked)
    assert all(a["step_s"] >= ACCUM * 0.02 for a in asked[1:])
    assert asked[0]["commit_s"] is None and all(a["commit_s"] > 0 for a in asked[1:])
    # and every answer acted on: the boundaries that commit are the ones the policy said were due
    due_steps = [(NOTICE_AT_BOUNDARY + k) * ACCUM for k, a in enumerate(asked) if a["due"]]
    assert due_steps == steps
    # saves in the window change no numbers
    ref = lm_spec(tmp_path / "ref", *RUN, f"task.config.num_samples={SAMPLES[deadline]}")
    run(ref)
    final = state_names(spec)[-1]
    assert final == state_names(ref)[-1] and digest(spec, final) == digest(ref, final)
