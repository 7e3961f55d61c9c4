"""The first hour, round 2 (issue 29): a user's mistakes end fast, with their reason on the last line.

* ``validate`` (and ``run``/``drill`` before Ray starts) resolves every import path to its object in
  a child Python, bounded in time, naming the attribute, the module's own error or the missing
  dependency;
* a bug that repeats (the same exception at the same micro-step, no new state in between) is not
  retried; ``Task.loss`` returning the wrong kind of value is refused at once;
* a diverging run fails after ``train.max_nonfinite_steps`` non-finite steps, naming the first, and
  never commits a non-finite state;
* the last line names the place (the user's file:line and function, rank, micro-step).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers import EXAMPLE, cli

# ---------------------------------------------------------------- 1. import paths resolve to their objects


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory with a job file and the user's own modules, as the working directory."""
    tag = uuid.uuid4().hex[:8]
    (tmp_path / "job.yaml").write_text(EXAMPLE)
    modules = {
        f"task_{tag}": "def build(config):\n    return None\n\ndef schedule(position, total):\n    return 1.0\n\n"
        "class Trigger:\n    def wants_save(self, tick):\n        return False\n",
        f"broken_{tag}": "x = 1\nraise ValueError('my module is broken')\n",
        f"needsdep_{tag}": "import json\nimport not_installed_pkg_" + tag + "\n\ndef build(config): ...\n",
        f"hangs_{tag}": "import time\ntime.sleep(600)\n\ndef build(config): ...\n",
    }
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    yield tmp_path, tag
    for name in [m for m in sys.modules if tag in m]:
        del sys.modules[name]


def test_validate_names_a_missing_attribute_with_its_close_match(user_dir, capsys):
    _, tag = user_dir
    rc, out, err = cli(
        capsys,
        "validate",
        "job.yaml",
        "--set",
        f"task.path=task_{tag}:buidl",
        "--set",
        f"train.scheduler={{type: custom, path: task_{tag}:schedul}}",
    )
    assert rc == 2 and not out
    assert f"task.path: 'task_{tag}:buidl': module 'task_{tag}' has no attribute 'buidl'; did you mean 'build'?" in err
    assert (
        f"train.scheduler.path: 'task_{tag}:schedul': module 'task_{tag}' has no attribute 'schedul'; did you "
        "mean 'schedule'?"
    ) in err
    assert f"task_{tag}" not in sys.modules  # the CLI's process never imports the user's module


def test_validate_names_the_error_of_a_module_whose_own_import_fails(user_dir, capsys):
    _, tag = user_dir
    rc, _, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=broken_{tag}:build")
    assert rc == 2
    assert (
        f"task.path: 'broken_{tag}:build' cannot be imported: importing 'broken_{tag}' raised ValueError: my "
        f"module is broken (at broken_{tag}.py:2)"
    ) in err.strip().splitlines()[-1]  # the reason is the last line, no traceback before it
    assert "Traceback" not in err


def test_a_missing_dependency_says_install_it_not_ship_the_code(user_dir, capsys):
    _, tag = user_dir
    rc, _, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=needsdep_{tag}:build")
    assert rc == 2
    assert (
        f"importing 'needsdep_{tag}' raised ModuleNotFoundError: No module named 'not_installed_pkg_{tag}' "
        f"(at needsdep_{tag}.py:2)" in err
    )
    assert f"install it (e.g. `pip install not_installed_pkg_{tag}`" in err.strip().splitlines()[-1]
    assert "working dir" not in err.split("task.path:", 1)[1]


def test_an_import_that_hangs_is_bounded_and_the_other_paths_still_checked(user_dir, capsys, monkeypatch):
    _, tag = user_dir
    monkeypatch.setenv("SYNCPOINT_IMPORT_CHECK_TIMEOUT_S", "2")
    began = time.monotonic()
    rc, _, err = cli(
        capsys,
        "validate",
        "job.yaml",
        "--set",
        f"task.path=hangs_{tag}:build",
        "--set",
        f"checkpoint.save_trigger=task_{tag}:build",
    )
    assert rc == 2 and time.monotonic() - began < 30
    assert (
        f"task.path: importing 'hangs_{tag}' (for 'hangs_{tag}:build') did not finish within 2 s "
        "(SYNCPOINT_IMPORT_CHECK_TIMEOUT_S)"
    ) in err
    # the next path, checked in a fresh child after the hang: a function where a trigger class belongs
    assert f"checkpoint.save_trigger: 'task_{tag}:build' is a function, not a class with a wants_save() method" in err


def test_validate_accepts_what_resolves_and_marks_what_a_task_optimizer_replaces(user_dir, capsys):
    _, tag = user_dir
    rc, out, err = cli(
        capsys,
        "validate",
        "job.yaml",
        "--set",
        f"task.path=task_{tag}:build",
        "--set",
        f"checkpoint.save_trigger=task_{tag}:Trigger",
        "--set",
        "checkpoint.async=true",
    )
    assert rc == 0, err
    assert '"async": true' in out and "async_save" not in out  # the spec field as the docs spell it
    # the builder's source does not build a Task: validate cannot tell, and says the rule
    assert "train.lr and train.optimizer build the optimizer only for a task without Task.optimizer" in err


def test_validate_marks_train_lr_and_optimizer_unused_where_the_task_sets_its_own(user_dir, capsys):
    """Read from the builder's source: optimizer= passed to Task(...) or .optimizer assigned names its
    line; a Task(...) without one leaves train.lr in effect and says nothing."""
    tmp_path, tag = user_dir
    (tmp_path / f"opt_{tag}.py").write_text(
        "from syncpoint import Task\n\n"
        "def build(config):\n"
        "    return Task(\n"
        "        model=None, dataset=[], loss=None,\n"
        "        optimizer=lambda m: None,\n"
        "    )\n\n"
        "def assigned(config):\n"
        "    task = Task(model=None, dataset=[], loss=None)\n"
        "    task.optimizer = lambda m: None\n"
        "    return task\n\n"
        "def plain(config):\n"
        "    return Task(model=None, dataset=[], loss=None, optimizer=None)\n"
    )
    for attr, line in (("build", 6), ("assigned", 11)):
        rc, out, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=opt_{tag}:{attr}")
        assert rc == 0, err
        assert (
            "train.lr and train.optimizer (its type, weight_decay, betas, no_decay) are not in effect: the task "
            f"sets Task.optimizer (at opt_{tag}.py:{line})"
        ) in err, err
    rc, out, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=opt_{tag}:plain")
    assert rc == 0 and "train.lr" not in err, err


def test_run_refuses_a_misspelt_attribute_before_ray_starts(user_dir, capsys):
    tmp_path, tag = user_dir
    runs = tmp_path / "runs"
    for command in (["run"], ["drill", "--preempt-at", "3"]):
        rc, _, err = cli(
            capsys,
            *command[:1],
            "job.yaml",
            *command[1:],
            "--set",
            f"task.path=task_{tag}:buidl",
            "--set",
            f"storage={runs}",
        )
        assert rc == 2 and "has no attribute 'buidl'" in err
    assert not runs.exists()


# ---------------------------------------------------------------- 2. a bug that repeats is not retried


def _worker_failures(**by_rank: BaseException) -> BaseException:
    """A worker group's failure as Ray Train v2 hands it over
    (tests/integration/orchestrator/test_failure_policy.py)."""
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import WorkerGroupError

    return WorkerGroupError(
        "snippet", {int(rank[4:]): UserExceptionWithTraceback(e, "Traceback ...") for rank, e in by_rank.items()}
    )


def _sited(error: BaseException, rank: int, micro_step: int | None, where: str | None = "mytask.py:14 in loss"):
    error.syncpoint_site = {"rank": rank, "micro_step": micro_step, "where": where}  # type: ignore[attr-defined]
    return error


def test_the_same_failure_at_the_same_micro_step_with_no_new_state_is_not_retried():
    """The policy decides from the journal: the previous application failure of this submission had
    the same exception at the same micro-step and nothing was committed since: raise, journaled as
    repeated. A new commit in between, another micro-step, another message or another submission:
    retried as before (Ray's max_failures)."""
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.config import FailureConfig

    from syncpoint.orchestrator.failure_policy import SyncpointFailurePolicy, _repetition
    from syncpoint.policies.contracts.journal import Failure, Journal, StateCommitted
    from syncpoint.policies.decisions.failures import FailureFacts, failure_signature
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    def bug(micro_step: int = 3, text: str = "bad label encoding in batch (call 3)") -> BaseException:
        return _worker_failures(rank0=_sited(ValueError(text), 0, micro_step))

    def journal(*extra, submission: str = "sub") -> Journal:
        cause = _sited(ValueError("bad label encoding in batch (call 3)"), 0, 3)
        first = Failure(
            time=10.0,
            classified="application",
            reason="x",
            decision="RETRY",
            ranks=[0],
            messages=[],
            dead_nodes=[],
            submission=submission,
            signature=failure_signature(cause),
            micro_step=3,
        )
        return Journal([first, *extra])

    assert _repetition(bug(), journal(), "sub")[1:] == (3, True)
    assert _repetition(bug(micro_step=4), journal(), "sub")[2] is False
    assert _repetition(bug(text="another message"), journal(), "sub")[2] is False
    assert _repetition(bug(), journal(submission="earlier"), "sub")[2] is False
    committed = StateCommitted(
        time=11.0,
        state="000000000002",
        global_micro_step=2,
        optimizer_step=1,
        bytes=1,
        seconds=0.1,
        blocked_seconds=0.1,
        reasons=["interval"],
    )
    assert _repetition(bug(), journal(committed), "sub")[2] is False
    assert _repetition(_worker_failures(rank0=_sited(ValueError("x"), 0, None)), journal(), "sub")[2] is False

    url = f"memory://repeat-{uuid.uuid4().hex[:8]}"
    policy = SyncpointFailurePolicy(FailureConfig(max_failures=5), url, submission="sub")
    signature, micro_step, repeats = _repetition(bug(), journal(), "sub")
    base = dict(
        ray_says_preempted=False,
        dead_attempt_nodes=(),
        notice_logged=False,
        messages=("ValueError: x",),
        signature=signature,
        micro_step=micro_step,
    )
    assert policy.decide(FailureFacts(**base, repeats=False), bug()) == FailureDecision.RETRY
    assert policy.decide(FailureFacts(**base, repeats=True), bug()) == FailureDecision.RAISE
    recorded = EventLog(RunStorage(url)).journal().failures
    assert [(f.repeated, f.micro_step, f.submission) for f in recorded] == [(False, 3, "sub"), (True, 3, "sub")]
    assert recorded[0].signature == "builtins.ValueError: bad label encoding in batch (call 3)"


def test_the_last_line_names_the_place_and_a_failing_ranks_own_error_comes_first():
    """The failing rank's own exception with where it was, one line; a peer's broken collective
    (the symptom) never hides it."""
    from syncpoint.orchestrator.failure_report import failure_report

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    error = _worker_failures(rank0=gloo, rank1=_sited(ValueError("bad label encoding in batch (call 3)"), 1, 3))
    assert failure_report(error) == (
        "ValueError: bad label encoding in batch (call 3) at mytask.py:14 in loss (rank 1, micro-step 3)",
        "",
    )
    assert (
        failure_report(_worker_failures(rank0=_sited(KeyError("y"), 0, None, "mytask.py:3 in build")))[0]
        == "KeyError: 'y' at mytask.py:3 in build (rank 0)"
    )
    # syncpoint's own refusal at set-up: nothing to add
    from syncpoint.policies.contracts.errors import TaskError

    assert failure_report(_worker_failures(rank0=_sited(TaskError("task.path: x"), 0, None, None)))[0] == "task.path: x"


def _linear(tmp_path, task: str, *overrides: str):
    from tests.helpers import linear_spec

    return linear_spec(tmp_path, f"task.path=tests.tasks:{task}", *overrides)


def test_a_rank_attaches_where_it_failed_to_the_exception(tmp_path):
    """What the driver's last line and the failure policy read: the rank, the micro-step, and the
    innermost frame of the user's code (here tests/tasks.py's loss), not syncpoint's or torch's."""
    from syncpoint.workers.supervision.launch import run_in_process

    spec = _linear(tmp_path, "failing_loss", "task.config.fail_at=3", "task.config.num_samples=16")
    with pytest.raises(ValueError, match="bad batch at call 3") as caught:
        run_in_process(spec, print_progress=False)
    site = caught.value.syncpoint_site  # type: ignore[attr-defined]
    assert site["rank"] == 0 and site["micro_step"] == 3
    assert site["where"].startswith("tests/tasks.py:") and site["where"].endswith(" in loss"), site


@pytest.mark.parametrize(
    "task,says",
    [
        ("unreduced_loss", r"returned a tensor of shape \(1, 1\)\. Reduce it to the batch's mean"),
    ],
)
def test_a_loss_of_the_wrong_kind_is_refused_at_the_first_micro_step(tmp_path, task, says):
    """A refusal (TaskError: not retried) at micro-step 1, naming the shape it got."""
    from syncpoint.policies.contracts.errors import TaskError
    from syncpoint.workers.supervision.launch import run_in_process

    spec = _linear(tmp_path, task, "task.config.num_samples=16")
    with pytest.raises(TaskError, match=says) as caught:
        run_in_process(spec, print_progress=False)
    assert caught.value.syncpoint_site["micro_step"] == 1  # type: ignore[attr-defined]


def test_check_loss_names_what_came_back():
    import torch

    from syncpoint.policies.contracts.errors import TaskError
    from syncpoint.workers.task import check_loss

    w = torch.ones(2, requires_grad=True)
    check_loss((w * 2).sum(), "t:build")
    for value, says in [
        (0.5, "returned float"),
        ((w * 2), r"shape \(2,\)"),
        (torch.tensor(3), "returned a int64 tensor"),
        (torch.tensor(1.0), "no gradient reaches"),
    ]:
        with pytest.raises(TaskError, match=says):
            check_loss(value, "t:build")


# ---------------------------------------------------------------- 3. a diverging run fails, commits nothing non-finite


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_a_loss_that_turns_nan_fails_naming_its_first_step_and_commits_nothing_non_finite(tmp_path, zero):
    """ZeRO 0 applies the NaN update (the weights become NaN), ZeRO 2 skips it (DeepSpeed's overflow
    check): either way the run fails after train.max_nonfinite_steps non-finite steps, naming the
    first, and every committed state is finite (the saves requested meanwhile waited)."""

    from syncpoint.policies.contracts.errors import TrainingDiverged
    from syncpoint.workers.supervision.launch import run_in_process
    from tests.helpers import committed_steps

    spec = _linear(
        tmp_path,
        "diverging_loss",
        "task.config.nan_from=9",
        f"deepspeed.zero_stage={zero}",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "train.max_nonfinite_steps=3",
    )
    with pytest.raises(TrainingDiverged) as caught:
        run_in_process(spec, print_progress=False)
    message = str(caught.value)
    # micro-step 9 is the first of optimizer step 3 (accumulation 4): its loss is the first non-finite
    assert "3 optimizer steps in a row" in message and "from optimizer step 3 (micro-step 12: loss nan)" in message
    assert caught.value.syncpoint_site["micro_step"] == 20  # type: ignore[attr-defined]  # steps 3, 4, 5
    assert committed_steps(spec) == [4, 8]  # 12, 16 and 20 were requested and not committed


def test_a_state_with_a_non_finite_parameter_or_moment_is_seen():
    """What a save checks on each rank besides the agreed loss: the module's parameters and every
    tensor of the innermost torch optimizer (its parameters, its moments)."""
    import types

    import torch

    from syncpoint.workers.training.finite import agreed_finite, tensors_finite

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    engine = types.SimpleNamespace(module=model, optimizer=types.SimpleNamespace(optimizer=optimizer), device="cpu")
    assert tensors_finite(engine) and agreed_finite(engine, 0.5)  # type: ignore[arg-type]
    assert not agreed_finite(engine, float("inf"))  # type: ignore[arg-type]
    optimizer.state[model.weight]["exp_avg_sq"][0, 1] = float("nan")
    assert not tensors_finite(engine)  # type: ignore[arg-type]


# ---------------------------------------------------------------- 8. small things that confused


def _journal_with_groups_and_a_restart():
    from syncpoint.policies.contracts.journal import (
        AttemptStarted,
        Failure,
        Journal,
        Progress,
        ProgressRecord,
        StateCommitted,
        Submitted,
    )

    def rec(step: int) -> ProgressRecord:
        return ProgressRecord(
            optimizer_step=step,
            global_micro_step=4 * step,
            epoch=0,
            loss=2.0 / step,
            lr=0.1 * step,
            lrs=[0.1 * step, 0.01 * step],
            time=100.0 + step,
        )

    return Journal(
        [
            Submitted(time=99.0, source="driver", name="groups", address="embedded"),
            AttemptStarted(
                time=100.0, attempt=1, world_size=1, resumed_from=None, global_micro_step=0, optimizer_step=0
            ),
            Progress(time=103.5, attempt=1, records=[rec(1), rec(2), rec(3)]),
            StateCommitted(
                time=103.0,
                attempt=1,
                state="000000000008",
                global_micro_step=8,
                optimizer_step=2,
                bytes=1,
                seconds=0.1,
                blocked_seconds=0.1,
                reasons=["interval"],
            ),
            Failure(
                time=104.0,
                classified="application",
                decision="RETRY",
                reason="x",
                ranks=[0],
                messages=[],
                dead_nodes=[],
            ),
            AttemptStarted(
                time=105.0, attempt=2, world_size=1, resumed_from="000000000008", global_micro_step=8, optimizer_step=2
            ),
            Progress(time=108.0, attempt=2, records=[rec(3), rec(4)]),
        ]
    )


def test_the_plot_is_against_the_optimizer_step_with_every_groups_rate():
    """TensorBoard's x-axis, labelled; each param group's LR a line of its own; a restart at its
    fraction of a step (the crash at micro-step 14 of step 4)."""
    import matplotlib.pyplot as plt

    from syncpoint.orchestrator.plot import draw, step_of

    journal = _journal_with_groups_and_a_restart()
    fig = draw(journal, "groups")
    try:
        ax, ax2 = fig.axes[0], fig.axes[1]
        assert ax.get_xlabel() == "optimizer step"
        assert list(ax.lines[0].get_xdata()) == [1, 2, 3, 4]
        lrs = {line.get_label(): list(line.get_ydata()) for line in ax2.lines}
        assert lrs == {
            "lr group 0": pytest.approx([0.1, 0.2, 0.3, 0.4]),
            "lr group 1": pytest.approx([0.01, 0.02, 0.03, 0.04]),
        }
        committed = [line for line in ax.lines if line.get_label() == "state committed"]
        assert list(committed[0].get_xdata()) == [2, 2]
    finally:
        plt.close(fig)
    steps = list(journal.steps().values())
    assert step_of(steps)(14) == pytest.approx(3.5) and step_of(steps)(20) == pytest.approx(5.0)


def test_the_timeline_shows_the_submission():
    from syncpoint.orchestrator.timeline import format_timeline

    first = format_timeline(_journal_with_groups_and_a_restart()).splitlines()[0]
    assert first.split()[2:] == ["submitted", "groups", "to", "embedded"], first


@pytest.mark.slow
def test_a_resume_that_changes_the_schedule_horizon_says_so(tmp_path, capsys):
    """A finished run extended (train.max_steps raised): the cosine schedule's rate from the resumed
    step on follows the new horizon; one line says so. The same horizon says nothing."""
    from syncpoint.workers.supervision.launch import run_in_process

    sets = [
        "train.scheduler={type: cosine}",
        "checkpoint.save_every={value: 4, unit: optimizer_steps}",
        "task.config.num_samples=64",
    ]
    run_in_process(_linear(tmp_path, "linear", *sets, "train.max_steps=4"), print_progress=False)
    capsys.readouterr()
    run_in_process(_linear(tmp_path, "linear", *sets, "train.max_steps=4"), print_progress=False)
    assert "horizon changed" not in capsys.readouterr().out
    run_in_process(_linear(tmp_path, "linear", *sets, "train.max_steps=8"), print_progress=False)
    out = capsys.readouterr().out
    assert (
        "[syncpoint] the LR schedule's horizon changed from 4 to 8 optimizer_steps since the resumed state "
        "(train.max_steps, train.epochs or train.scheduler.total): from position 4 on the learning rate follows "
        "the new horizon (factor 0 -> 0.5 here)"
    ) in out, out


# ---------------------------------------------------------------- the mistakes through the CLI, on a real Ray


# ---------------------------------------------------------------- 7. submit right after `ray start`


class _AgentStartingClient:
    """What the Job SDK client does while a new head's job agent registers: ``submit_job`` raises
    Ray's own RuntimeError for the API's HTTP 500 (ray.dashboard.modules.job.sdk, `_raise_error`)."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.calls = refusals, 0

    def submit_job(self, **job):
        self.calls += 1
        if self.calls <= self.refusals:
            raise RuntimeError(
                "Request failed with status code 500: No available agent to submit job, please try again later.."
            )
        return "raysubmit_ok"


def test_submit_waits_for_a_new_heads_job_agent_bounded_and_says_so(capsys):
    from syncpoint.orchestrator.submit import submit_job
    from syncpoint.policies.contracts.errors import SpecError

    client = _AgentStartingClient(refusals=3)
    assert submit_job(client, "http://127.0.0.1:8265", wait_s=30, poll_s=0.01, entrypoint="x") == "raysubmit_ok"
    err = capsys.readouterr().err
    assert client.calls == 4 and err.count("job agent is not up yet") == 1, err  # said once
    began = time.monotonic()
    with pytest.raises(SpecError) as refused:
        submit_job(
            _AgentStartingClient(refusals=10**6), "http://127.0.0.1:8265", wait_s=0.3, poll_s=0.05, entrypoint="x"
        )
    assert time.monotonic() - began < 5
    assert "the cluster's job agent did not come up within 0.3 s (SYNCPOINT_JOB_AGENT_WAIT_S)" in str(refused.value)
    assert "nothing was submitted" in str(refused.value)
    other = _AgentStartingClient(refusals=0)
    other.submit_job = lambda **job: (_ for _ in ()).throw(RuntimeError("Request failed with status code 400: bad"))
    with pytest.raises(RuntimeError, match="400"):  # any other error is not waited on
        submit_job(other, "http://127.0.0.1:8265", wait_s=30, entrypoint="x")


# ---------------------------------------------------------------- 6. noise, quieted at its source


def test_zero3s_deprecated_collectives_are_quieted_in_a_worker_and_other_warnings_are_not():
    """torch 2.13 deprecates the collectives DeepSpeed's ZeRO calls (all_gather_into_tensor, and at
    ZeRO-3 reduce_scatter_tensor): a worker drops exactly those FutureWarnings."""
    import warnings

    import torch
    import torch.distributed as dist

    from syncpoint.orchestrator.quiet import quiet_worker
    from syncpoint.workers.supervision.launch import ensure_single_process_group
    from tests.helpers import linear_spec

    ensure_single_process_group("gloo")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_worker(linear_spec("memory://quiet"))
        for call in (
            lambda: dist.reduce_scatter_tensor(torch.zeros(1), torch.zeros(1)),
            lambda: dist.all_gather_into_tensor(torch.zeros(1), torch.zeros(1)),
        ):
            try:
                call()
            except RuntimeError:  # gloo may not implement it: the deprecation warning comes first anyway
                pass
        warnings.warn("`torch.distributed.something_else` is deprecated", FutureWarning, stacklevel=1)
    shown = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    assert shown == ["`torch.distributed.something_else` is deprecated"], shown


def test_the_cli_process_imports_deepspeed_without_its_accelerator_line():
    """digest and drill import DeepSpeed in the CLI's own process (no DS_ACCELERATOR there): its
    "Setting accelerator to CPU" warning is dropped at its logger, by its exact text."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    code = "import deepspeed.accelerator as a; a.get_accelerator()"
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    quieted = "from syncpoint.orchestrator.quiet import quiet_cli; quiet_cli(); " + code
    quiet = subprocess.run([sys.executable, "-c", quieted], env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == quiet.returncode == 0, plain.stderr + quiet.stderr
    assert "Setting accelerator to CPU" in plain.stdout + plain.stderr  # what it says unquieted, on this machine
    assert "Setting accelerator to CPU" not in quiet.stdout + quiet.stderr
