"""`ray job submit` and `syncpoint submit` against a real local Ray head started by the test
(own ports and temp dir, stopped by its own process ids). A re-submitted job with the same name
and storage continues from its newest resumable state, as a whole-cluster retry would.
The head is the Ray tests' shared one (tests/ray/conftest.py).
`syncpoint submit` first runs a preflight job there (tests/ray/test_first_hour.py: a head whose
`python` lacks syncpoint is refused)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import ROOT, digest, lm_spec, state_names, step_history, with_overrides

BIN = os.path.dirname(sys.executable)


@pytest.fixture
def head(shared_head) -> tuple[str, dict[str, str]]:
    """The Job API address of the Ray tests' shared head (tests/ray/conftest.py) and its clients'
    environment (its token included)."""
    return shared_head[0].address, shared_head[1]


SETS = [
    "task.config.num_samples=80",
    "task.config.seq_len=8",
    "task.config.d_model=16",
    "train.micro_batch_size=2",
    "train.epochs=2",
    "checkpoint.save_every={value: 4, unit: micro_steps}",
    "checkpoint.export_final=false",
]


# make test: a submission through the Job API on a `ray start` head (tests/ray/test_submit_token.py: `syncpoint
# submit`, its working dir shipped, the job's own log streamed back), `syncpoint run --address` training on a
# `ray start` head (tests/ray/test_mistakes.py), a re-submission resuming what an earlier one committed
# (tests/integration/policies/decisions/test_resume_policies_e2e.py)
@pytest.mark.long
def test_ray_job_submit_resumes_what_an_earlier_submission_committed(tmp_path, head):
    """An earlier submission of the job crashed after committing state 20 (here: run by the local
    launcher, which writes the same run directory); `ray job submit` of the same job continues from
    20 rather than starting over, and finishes. (`syncpoint submit`'s log streaming and exit code
    are tests/integration/orchestrator/test_submit_token.py's, over token auth.)"""
    head, head_env = head
    first = lm_spec(tmp_path, *SETS, "failure.max_failures=0", "faults=[{rank: 1, at_micro_step: 21}]", workers=2)
    assert run_spawned(first) != [0, 0]  # the injected crash
    spec = lm_spec(tmp_path, *SETS, workers=2)
    assert state_names(spec)[-1] == f"{20:012d}"
    cmd = [
        f"{BIN}/ray",
        "job",
        "submit",
        "--address",
        head,
        "--working-dir",
        str(ROOT),
        "--",
        "python",
        "-m",
        "syncpoint",
        "run",
        "examples/tiny_lm.yaml",
    ]
    for s in [*SETS, f"storage={tmp_path}", "failure.max_failures=0", "faults=[{rank: 1, at_micro_step: 21}]"]:
        cmd += ["--set", s]
    again = subprocess.run(cmd, cwd=ROOT, env=head_env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[syncpoint] resuming from state 000000000020" in again.stdout  # the job's own log, through Ray
    starts = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "attempt_started"]
    assert starts[-1]["resumed_from"] == f"{20:012d}"  # continued, did not start over
    assert state_names(spec)[-1] == f"{40:012d}"


def test_syncpoint_submit_checks_the_task_path_on_the_cluster_first(tmp_path, head):
    """The preflight job looks the task's module up where the job will: the shipped working dir and
    the cluster's packages. A module that is not there is refused (exit 2) and nothing is submitted."""
    head, head_env = head
    args = [
        sys.executable,
        "-m",
        "syncpoint",
        "submit",
        "examples/tiny_lm.yaml",
        "--address",
        head,
        "--set",
        f"storage={tmp_path}",
        "--set",
        "task.path=examples.no_such_task:build",
    ]
    env = {k: v for k, v in head_env.items() if k != "RAY_AUTH_MODE"}
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert (
        "on the cluster, task.path: 'examples.no_such_task:build' cannot be imported: no module named "
        "'examples.no_such_task'" in r.stderr
    )
    assert "as Ray job" not in r.stdout and not (tmp_path / "tiny-lm" / "events").exists()


def test_the_preflight_wait_is_bounded_and_says_so(tmp_path, head):
    """The preflight job is waited for at most ``SYNCPOINT_PREFLIGHT_TIMEOUT_S``: past it, submit stops
    the probe, refuses in one paragraph naming the variable (exit 2) and submits nothing."""
    head, head_env = head
    args = [
        sys.executable,
        "-m",
        "syncpoint",
        "submit",
        "examples/tiny_lm.yaml",
        "--address",
        head,
        "--set",
        f"storage={tmp_path}",
    ]
    env = {**{k: v for k, v in head_env.items() if k != "RAY_AUTH_MODE"}, "SYNCPOINT_PREFLIGHT_TIMEOUT_S": "0.2"}
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "did not finish within 0.2 s" in r.stderr and "SYNCPOINT_PREFLIGHT_TIMEOUT_S" in r.stderr
    assert "as Ray job" not in r.stdout and not (tmp_path / "tiny-lm" / "events").exists()


# make test: `syncpoint submit` end to end (tests/ray/test_submit_token.py), a submission continuing
# another's state (the first test here), the example's user state, callbacks and MLflow
# (tests/integration/test_own_training_example.py)
@pytest.mark.long
def test_syncpoint_submit_continues_a_run_with_user_state_callbacks_and_mlflow(tmp_path, head):
    """examples/own_training.yaml (an EMA and a loss-spike watch as Task.stateful, a sampling callback,
    MLflow) through `syncpoint submit`: an earlier submission crashed after its state at micro-step 8;
    the submitted job continues from it and ends as the uninterrupted run (every step's loss, the
    digest with every rank's user state), its callback writes what the uninterrupted one wrote, and
    MLflow holds one run."""
    head, head_env = head
    pytest.importorskip("mlflow")
    from tests.integration.test_own_training_example import _spec

    sets = ["task.config.seq_len=8", "task.config.num_samples=96", "task.config.eval_samples=8"]
    sets += ["task.config.sample_every=2"]
    ref = _spec(tmp_path / "ref", tmp_path / "ref.txt")
    assert run_spawned(ref) == [0, 0]
    first = _spec(tmp_path / "run", tmp_path / "run.txt")
    assert run_spawned(with_overrides(first, "faults=[{at_micro_step: 11, mode: exit}]"))[0] == 17
    assert state_names(first)[-1] == f"{8:012d}"
    args = [sys.executable, "-m", "syncpoint", "submit", "examples/own_training.yaml", "--address", head]
    for s in [*sets, f"storage={tmp_path / 'run'}", f"task.config.samples_to={tmp_path / 'run.txt'}"]:
        args += ["--set", s]
    env = {k: v for k, v in head_env.items() if k != "RAY_AUTH_MODE"}
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resuming from state 000000000008" in r.stdout, r.stdout[-3000:]
    final = state_names(ref)[-1]
    assert state_names(first)[-1] == final
    losses = [[x.loss for _, x in sorted(step_history(spec).items())] for spec in (ref, first)]
    assert losses[0] == losses[1] and digest(ref, final) == digest(first, final)
    said = [(tmp_path / f).read_text().splitlines() for f in ("ref.txt", "run.txt")]
    assert said[0] == said[1] and len(said[0]) == 4
    assert len(list((tmp_path / "run" / "own-training" / "mlruns").glob("*/*/meta.yaml"))) == 1
