"""``Task.callbacks``: called at the run's points on every rank, shielded from the trajectory.

The callback (``tests.tasks.RecordingCallback``) draws from every global RNG in every hook, as a
callback that samples would; the task draws randomness every micro-step (dropout, augmentation).
A run with the callback must be the run without it, loss for loss and digest for digest, and so
must a crashed-and-resumed run with it; the callback's own record says what it saw.
"""

from __future__ import annotations

import json

import pytest

from syncpoint.policies.contracts.errors import TaskError
from syncpoint.workers.supervision.launch import run_spawned
from syncpoint.workers.training import callbacks
from syncpoint.workers.training.callbacks import CallbackFailed
from tests.helpers import digest, linear_spec, run, state_names, step_history, with_overrides


def _spec(tmp, *extra, log_dir=None, workers=1):
    config = "{num_samples: 32" + (f", log_dir: '{log_dir}'" if log_dir else "") + "}"
    return linear_spec(
        tmp,
        "task.path=tests.tasks:linear_callbacks",
        f"task.config={config}",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.epochs=2",
        "train.log_every=3",
        "train.eval_every=4 optimizer_steps",
        "checkpoint.save_every={value: 3, unit: micro_steps}",
        *extra,
        workers=workers,
    )


def _losses(spec) -> list[float]:
    return [s.loss for _, s in sorted(step_history(spec).items())]


def _calls(log_dir, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (log_dir / f"rank_{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_callback_that_draws_random_numbers_leaves_the_run_as_it_was(tmp_path):
    plain, called = _spec(tmp_path / "plain"), _spec(tmp_path / "called", log_dir=tmp_path / "log")
    (tmp_path / "log").mkdir()
    run(plain)
    run(called)
    final = state_names(plain)[-1]
    assert _losses(plain) == _losses(called) and digest(plain, final) == digest(called, final)
    calls = _calls(tmp_path / "log")
    hooks = [c["hook"] for c in calls]
    steps = len(_losses(plain))
    assert hooks[0] == "on_start" and hooks[-1] == "on_end" and hooks.count("on_step") == steps
    assert [c["step"] for c in calls if c["hook"] == "on_log"] == [s for s in range(1, steps + 1) if s % 3 == 0] + (
        [steps] if steps % 3 else []
    )
    assert [c["metrics"] for c in calls if c["hook"] == "on_evaluate"][0] == ["eval_loss"]
    committed = [c["state"] for c in calls if c["hook"] == "on_state_committed"]
    assert committed == state_names(called)  # every state, named, in order
    assert not any(c["grad"] for c in calls if c["hook"] == "on_step")  # the model is read under no_grad
    assert calls[-1]["final_state"] == final


@pytest.mark.slow
def test_without_the_shield_the_same_callback_moves_the_run(tmp_path, monkeypatch):
    """What the shield prevents: with the RNG snapshot around each call made a no-op, the callback's
    draws change training's later ones."""
    plain, called = _spec(tmp_path / "plain"), _spec(tmp_path / "called", log_dir=tmp_path / "log")
    (tmp_path / "log").mkdir()
    run(plain)
    monkeypatch.setattr(callbacks.rng, "restore", lambda saved: None)
    run(called)
    assert _losses(plain) != _losses(called)


@pytest.mark.slow
def test_a_resumed_run_with_callbacks_is_the_uninterrupted_one_and_its_callbacks_hear_of_the_resume(tmp_path):
    (tmp_path / "log").mkdir()
    ref = _spec(tmp_path / "ref", workers=2)
    resumed = _spec(tmp_path / "resumed", log_dir=tmp_path / "log", workers=2)
    assert run_spawned(ref) == [0, 0]
    assert run_spawned(with_overrides(resumed, "faults=[{at_micro_step: 9, mode: exit}]"))[0] == 17
    assert run_spawned(resumed) == [0, 0]
    final = state_names(ref)[-1]
    assert _losses(ref) == _losses(resumed) and digest(ref, final) == digest(resumed, final)
    for rank in (0, 1):
        starts = [c for c in _calls(tmp_path / "log", rank) if c["hook"] == "on_start"]
        assert [s["resumed_from"] is None for s in starts] == [True, False], starts
        assert starts[1]["step"] > 0 and starts[1]["attempt"] == 2


@pytest.mark.slow
def test_a_callback_that_raises_fails_the_attempt_naming_it(tmp_path):
    (tmp_path / "log").mkdir()
    spec = _spec(tmp_path / "run", log_dir=tmp_path / "log")
    spec = with_overrides(spec, f"task.config={{num_samples: 32, log_dir: '{tmp_path / 'log'}', raise_in: on_log}}")
    with pytest.raises(CallbackFailed, match=r"Task\.callbacks\[0\] \(RecordingCallback\)\.on_log raised ValueError: "):
        run(spec)


class _Typo:
    def on_stpe(self, info, model):
        pass


class _Nothing:
    pass


class _Fine:
    def on_log(self, record):
        pass


@pytest.mark.parametrize(
    "value,match",
    [
        ([_Typo()], r"Task\.callbacks\[0\] \(_Typo\) has \['on_stpe'\], which is no hook syncpoint calls"),
        ([_Fine(), _Nothing()], r"Task\.callbacks\[1\] \(_Nothing\) has none of the hooks"),
        (_Fine(), r"Task\.callbacks of type _Fine: it must be a list"),
    ],
)
def test_callbacks_that_could_not_run_as_meant_are_refused_at_load(value, match):
    with pytest.raises(TaskError, match=match):
        callbacks.check("tests.tasks:x", value)
    callbacks.check("tests.tasks:x", [_Fine()])
