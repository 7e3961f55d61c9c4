"""What a new user meets between `make example` and a real cluster (issue 18).

* `validate`, `run` and `drill` refuse an import path whose module cannot be found, before Ray
  starts, without running the module;
* a run's output is syncpoint's own lines (plus Ray's few start-up lines) and ends in one summary
  line: final state, steps, wall time, restarts and lost work, where the model and plot are;
* `syncpoint submit` to a head whose `python` lacks syncpoint is refused before anything is
  submitted (a real head, started by the test with such a `python` first on its PATH, stopped by
  its own process ids).
"""

from __future__ import annotations

import sys
import uuid

import pytest

from syncpoint.orchestrator.cli import main
from syncpoint.orchestrator.timeline import format_summary, summarize
from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Failure,
    FaultFired,
    Finished,
    Journal,
    Progress,
    ProgressRecord,
    StateCommitted,
    Submitted,
)
from tests.helpers import EXAMPLE, ROOT

# ---------------------------------------------------------------- import paths, before Ray starts


def _write_job(tmp_path, text: str = EXAMPLE) -> str:
    job = tmp_path / "job.yaml"
    job.write_text(text)
    return str(job)


@pytest.mark.parametrize(
    "field,value,missing",
    [
        ("task.path", "no.such.module:task", "no"),
        ("task.path", "examples.no_such_module:build", "examples.no_such_module"),
        ("resume.policy", "no_such_policies.mod:Policy", "no_such_policies"),
        ("checkpoint.save_trigger", "no_such_triggers:Every", "no_such_triggers"),
    ],
)
def test_validate_refuses_an_import_path_whose_module_cannot_be_found(field, value, missing, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = main(["validate", "examples/tiny_lm.yaml", "--set", f"{field}={value}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{field}: {value!r} cannot be imported: no module named {missing!r}" in err
    assert str(ROOT) in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.startswith("  - ")]) == 1  # one paragraph


def test_validate_accepts_the_example_and_builtin_policies(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert (
        main(
            [
                "validate",
                "examples/tiny_lm.yaml",
                "--set",
                "resume.policy=pinned",
                "--set",
                "resume.policy_args={state: 4}",
            ]
        )
        == 0
    )
    assert '"path": "examples.tiny_lm:build"' in capsys.readouterr().out


def test_run_refuses_before_ray_starts_or_storage_is_touched(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    runs = tmp_path / "runs"
    rc = main(["run", "examples/tiny_lm.yaml", "--set", "task.path=no.such.module:task", "--set", f"storage={runs}"])
    err = capsys.readouterr().err
    assert rc == 2 and "task.path: 'no.such.module:task' cannot be imported" in err
    assert not runs.exists()  # the storage probe and the driver's first event come after the check
    assert (
        main(
            [
                "drill",
                "examples/tiny_lm.yaml",
                "--preempt-at",
                "3",
                "--set",
                "task.path=no.such.module:task",
                "--set",
                f"storage={runs}",
            ]
        )
        == 2
    )
    assert not runs.exists()


def test_the_check_finds_modules_next_to_the_job_and_imports_them_in_a_child(tmp_path, capsys, monkeypatch):
    """The check imports the task module, as every worker will, but in a child Python: the CLI's
    own process never runs it; its parent package's __init__ raising is reported, not raised."""
    pkg, broken = f"sp_task_{uuid.uuid4().hex[:8]}", f"sp_broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    ran = tmp_path / "module-ran"
    (tmp_path / pkg / "task.py").write_text(f"open({str(ran)!r}, 'w').close()\ndef build(config): ...\n")
    (tmp_path / broken).mkdir()
    (tmp_path / broken / "__init__.py").write_text("raise RuntimeError('boom in __init__')\n")
    (tmp_path / broken / "task.py").write_text("")
    job = _write_job(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", job, "--set", f"task.path={pkg}.task:build"]) == 0
    assert ran.exists() and pkg not in sys.modules  # imported by the child only
    capsys.readouterr()
    assert main(["validate", job, "--set", f"task.path={broken}.task:build"]) == 2
    err = capsys.readouterr().err
    assert (
        f"task.path: '{broken}.task:build' cannot be imported: importing '{broken}.task' raised RuntimeError: "
        f"boom in __init__ (at {broken}/__init__.py:1)" in err
    )
    assert str(tmp_path) not in sys.path and broken not in sys.modules


# ---------------------------------------------------------------- the end-of-run summary


def _attempt(t: float, attempt: int, step: int, resumed_from: str | None) -> AttemptStarted:
    return AttemptStarted(
        time=t,
        attempt=attempt,
        world_size=1,
        resumed_from=resumed_from,
        global_micro_step=step,
        optimizer_step=step // 4,
    )


def _finished(t: float, attempt: int) -> Finished:
    return Finished(time=t, attempt=attempt, state="000000000024", global_micro_step=24, optimizer_step=6)


def _events_with_a_restart() -> list:
    """Attempt 1 commits state 8 (snapshot at t=113, a 1 s save), crashes at micro-step 13 and fails
    at t=122; attempt 2 resumes from 8 and finishes at micro-step 24 (optimizer step 6)."""

    def rec(step: int, gms: int, t: float) -> ProgressRecord:
        return ProgressRecord(optimizer_step=step, global_micro_step=gms, epoch=0, loss=1.0, lr=0.1, time=t)

    return [
        Submitted(time=100.0, source="driver", name="tiny-lm", address="embedded"),
        _attempt(110.0, 1, 0, None),
        StateCommitted(
            time=114.0,
            attempt=1,
            state="000000000008",
            global_micro_step=8,
            optimizer_step=2,
            bytes=1000,
            seconds=1.0,
            blocked_seconds=1.0,
            committed_at_micro_step=8,
            reasons=["interval"],
        ),
        Progress(time=120.0, attempt=1, records=[rec(2, 8, 113.0), rec(3, 12, 120.0)]),
        FaultFired(time=121.0, attempt=1, global_micro_step=13, rank=1, mode="exit", fault="f", where="micro-step 13"),
        Failure(
            time=122.0,
            classified="application",
            decision="retry",
            reason="crash",
            ranks=[1],
            messages=["crash"],
            dead_nodes=[],
        ),
        _attempt(130.0, 2, 8, "000000000008"),
        _finished(160.5, 2),
    ]


def test_summary_counts_restarts_and_lost_work_from_the_event_log():
    s = summarize(Journal(_events_with_a_restart()))
    assert (s.state, s.optimizer_step, s.micro_step, s.restarts, s.lost_micro_steps) == ("000000000024", 6, 24, 1, 5)
    assert s.wall_seconds == pytest.approx(60.5)  # first event of the run to its finish
    assert s.lost_seconds == pytest.approx(122.0 - 113.0)  # the failure's time minus the state's snapshot time
    line = format_summary("tiny-lm", s, "runs/tiny-lm/final/model.safetensors", "runs/tiny-lm/plot.png")
    assert line == (
        "syncpoint: job 'tiny-lm' finished: state 000000000024, 6 optimizer steps (24 micro-steps) in "
        f"1m00s, goodput {100 * s.goodput.ratio:.1f}%, 1 restart (lost 5 micro-steps, 9.0 s); "
        "model runs/tiny-lm/final/model.safetensors; "
        "plot runs/tiny-lm/plot.png"
    )
    assert summarize(Journal(_events_with_a_restart()[:-1])) is None  # not finished: no summary


def test_a_finished_run_run_again_is_summarized_from_its_new_submission():
    """`make example` twice: the second run resumes the final state and finishes at once; its summary
    is that submission's, not a restart of the first."""
    again = [
        Submitted(time=900.0, source="driver", name="tiny-lm", address="embedded"),
        _attempt(910.0, 3, 24, "000000000024"),
        _finished(912.0, 3),
    ]
    s = summarize(Journal(_events_with_a_restart() + again))
    assert (s.state, s.optimizer_step, s.restarts, s.lost_micro_steps) == ("000000000024", 6, 0, 0)
    assert s.wall_seconds == pytest.approx(12.0)


def test_a_good_run_after_failed_submissions_counts_only_its_own_attempts():
    """The issue's case: a bug failed two attempts of the first submission (no finish); the fixed job,
    submitted again, finishes without a restart and says so; a restart inside it still counts."""
    failed = [e for e in _events_with_a_restart() if not isinstance(e, Finished)][:-1]  # attempt 1 fails for good
    failed.append(_attempt(125.0, 2, 8, "000000000008"))
    failed.append(
        Failure(
            time=127.0, classified="application", decision="FAIL", reason="bug", ranks=[0], messages=[], dead_nodes=[]
        )
    )
    fixed = [Submitted(time=500.0, source="driver", name="tiny-lm", address="embedded"), _attempt(510.0, 3, 8, None)]
    s = summarize(Journal([*failed, *fixed, _finished(540.0, 3)]))
    assert (s.restarts, s.lost_micro_steps, s.lost_seconds) == (0, 0, 0.0)
    assert s.wall_seconds == pytest.approx(40.0)  # this submission's, not the first one's
    crash = Failure(
        time=520.0, classified="application", decision="RETRY", reason="x", ranks=[0], messages=[], dead_nodes=[]
    )
    again = summarize(Journal([*failed, *fixed, crash, _attempt(525.0, 4, 0, None), _finished(540.0, 4)]))
    assert again.restarts == 1 and again.wall_seconds == pytest.approx(40.0)


# ---------------------------------------------------------------- a whole run's output (embedded Ray)


# ---------------------------------------------------------------- submit to a head whose python lacks syncpoint
