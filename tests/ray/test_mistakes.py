"""A user's mistakes through the CLI on a real Ray run: each ends fast with its reason and place,
and a drill's crash prints its table, not tracebacks (in-process:
tests/integration/orchestrator/test_cli_mistakes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

USER_TASK = """
import torch
from syncpoint.workers.task import Task


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return x, x.sum(dim=0, keepdim=True)


def _task(loss):
    return Task(model=torch.nn.Linear(4, 1), dataset=Pairs(), loss=loss)


def buggy(config):
    calls = {"n": 0}

    def loss(model, batch):
        calls["n"] += 1
        x, y = batch
        if calls["n"] == 3:
            raise ValueError("my bug: bad label encoding in batch (call 3)")
        return torch.nn.functional.mse_loss(model(x), y)
    return _task(loss)


def diverging(config):
    calls = {"n": 0}

    def loss(model, batch):
        calls["n"] += 1
        x, y = batch
        value = torch.nn.functional.mse_loss(model(x), y)
        return value * float("nan") if calls["n"] >= 5 else value
    return _task(loss)


def unreduced(config):
    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y, reduction="none")
    return _task(loss)
"""


USER_JOB = """
name: {name}
storage: {storage}
scaling: {{num_workers: 1}}
task: {{path: "mytask:{task}"}}
train: {{micro_batch_size: 2, grad_accum: 2, epochs: 1, log_every: 1000}}
deepspeed: {{zero_stage: 0}}
checkpoint: {{save_every: {{value: 8, unit: micro_steps}}, export_final: false}}
failure: {{max_failures: 5}}
"""


# each mistake: the attempts it takes and its last line. make test runs the one Ray retries (a bug
# failing twice at the same place is not retried a third time); the in-process tier checks the other
# two's reasons (tests/integration/orchestrator/test_cli_mistakes.py), their path through the CLI on Ray is `long`.
MISTAKES = [
    pytest.param(
        "buggy",
        2,
        "ValueError: my bug: bad label encoding in batch (call 3) at mytask.py:26 in loss (rank 0, "
        "micro-step 3); it failed twice the same way at micro-step 3 with no new state in between: not "
        "retried (a bug, not a preemption)",
        id="buggy",
    ),
    pytest.param(
        "diverging",
        1,
        "the run diverged: 10 optimizer steps in a row had a non-finite loss or an update DeepSpeed "
        "skipped for overflowing gradients, from optimizer step 3 (micro-step 6: loss nan) on",
        id="diverging",
        marks=pytest.mark.long,
    ),
    pytest.param(
        "unreduced",
        1,
        "Task.loss must return the batch's loss as a 0-d floating tensor computed from the model; "
        "mytask:unreduced returned a tensor of shape (2, 1).",
        id="unreduced",
        marks=pytest.mark.long,
    ),
]


@pytest.fixture(scope="module")
def user_head(shared_head, tmp_path_factory) -> tuple[Any, dict[str, str], Path]:
    """The Ray tests' shared head (tests/ray/conftest.py), its environment, and the user's task module
    for every mistake of the module."""
    head, env = shared_head
    where = tmp_path_factory.mktemp("user")
    (where / "mytask.py").write_text(USER_TASK)
    return head, env, where


@pytest.mark.parametrize("task,attempts,last_line", MISTAKES)
def test_the_mistakes_end_fast_through_the_cli_with_their_reason_and_place(user_head, task, attempts, last_line):
    """A user's own task module and job file, run with `syncpoint run` against a Ray head: the mistake
    ends with exit 1 and its reason on the last line, within at most two attempts although
    max_failures is 5; nothing of Ray's State API noise (another Ray runs on the machine: this head)
    shows."""
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    head, env, tmp_path = user_head
    job = tmp_path / f"{task}.yaml"
    job.write_text(USER_JOB.format(name=task, storage=tmp_path / "runs", task=task))
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "syncpoint", "run", str(job), "--address", head.gcs_address],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    took = time.monotonic() - began
    out = r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 1, out[-4000:]
    assert last.startswith(f"syncpoint: job {task!r} failed: {last_line}"), (last, out[-3000:])
    journal = EventLog(RunStorage(f"file://{tmp_path}/runs/{task}")).journal()
    assert len(journal.attempts) == attempts, out[-3000:]
    assert "Found multiple active Ray instances" not in out and "PlacementGroupCleaner" not in out, out
    assert "Graceful shutdown of backend failed" not in out and "[FailurePolicy]" not in out, out
    assert out.count("Traceback (most recent call last)") <= attempts, out  # the failing rank's own, once each
    print(f"{task}: {took:.0f} s, {len(out.splitlines())} lines")


# make test: the drill's verdict and table from its two runs' journals and digests (tests/unit/orchestrator/
# test_drill_verdict.py), a crash's recovery on Ray (tests/ray/test_in_place_on_ray.py), the CLI's quiet
# output on Ray (the mistake above, the quick start)
@pytest.mark.long
def test_a_drills_crash_prints_no_tracebacks_before_its_table(tmp_path):
    """`syncpoint drill --preempt-at P` crashes rank 1 on purpose: the survivor's broken collective,
    Ray's failure-policy dump and the controller's shutdown warning said nothing the table does not;
    what remains is syncpoint's lines, Ray's start-up lines and the raylet's one line about the death."""
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/tiny_lm.yaml",
        "--preempt-at",
        "6",
        "--set",
        f"storage={tmp_path}",
        "--set",
        "task.config.num_samples=40",
        "--set",
        "task.config.seq_len=8",
        "--set",
        "task.config.d_model=16",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "train.epochs=1",
        "--set",
        "checkpoint.export_final=false",
        "--set",
        "task.config.eval_samples=8",
        "--set",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DS_ACCELERATOR")}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "RESULT: the interrupted run is bitwise the uninterrupted one" in r.stdout
    for noise in (
        "Traceback",
        "Graceful shutdown of backend failed",
        "[FailurePolicy]",
        "Error Snippet",
        "Setting accelerator to CPU",
    ):
        assert noise not in out, (noise, out[-6000:])
    assert len(out.splitlines()) < 60, out


# make test: the verdict and report of a failed reference run (tests/unit/orchestrator/test_drill_verdict.py)
# and a drill on Ray printing its report (the test above)
@pytest.mark.long
def test_a_drill_whose_reference_run_fails_says_so_with_its_last_line(tmp_path):
    """`syncpoint drill` on a task the workers refuse: the reference run fails, so the report is that
    failure and its last line, not a comparison ("per-step losses: MISMATCH (0 optimizer steps)"), and
    no interrupted run is started."""
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    (tmp_path / "mytask.py").write_text(USER_TASK)
    job = tmp_path / "unreduced.yaml"
    job.write_text(USER_JOB.format(name="unreduced", storage=tmp_path / "runs", task="unreduced"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "DS_ACCELERATOR")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run(
        [sys.executable, "-m", "syncpoint", "drill", str(job), "--preempt-at", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    failed = "syncpoint: job 'unreduced-drill-ref' failed: Task.loss must return the batch's loss as a 0-d"
    plan, why, last, result = r.stdout.strip().splitlines()[-4:]
    assert plan == "drill: crash at micro-step 3", out[-4000:]
    assert why == (
        "the reference run (uninterrupted) failed, so there is nothing to compare the interrupted run with; its last "
        "line:"
    )
    assert last.startswith(f"  {failed}") and result == "RESULT: FAILED (the reference run failed)", out[-4000:]
    assert "MISMATCH" not in out and "optimizer steps" not in r.stdout, out[-4000:]
    assert EventLog(RunStorage(f"file://{tmp_path}/runs/unreduced-drill")).journal().attempts == []
