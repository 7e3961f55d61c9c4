"""Evaluation (issue 17 §2): exact reduction, no effect on training, the same numbers after a resume.

* the rules (``syncpoint.policies.decisions.evaluation``): when an evaluation is due, every eval sample counted once;
* ``syncpoint.workers.training.evaluation.evaluate`` restores every RNG and every submodule's mode, and seeds itself;
* a run with evaluation is bitwise the run without (ZeRO 0/2 here; ZeRO-3 on 2 ranks with uneven
  shards, slow);
* a resumed run reports the same evaluations at the same steps, and its states carry the latest one;
* the reduction is exact against a hand-computed reference; best-metric picks by ``eval_loss``;
* a bad ``Task.metrics`` fails with a message naming it.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from syncpoint.orchestrator.drill import compare_evaluations
from syncpoint.orchestrator.timeline import format_timeline
from syncpoint.policies.contracts.errors import TaskError
from syncpoint.policies.contracts.journal import Evaluated, Journal
from syncpoint.policies.contracts.spec import TrainSpec
from syncpoint.policies.decisions import evaluation as rules
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import ensure_single_process_group
from syncpoint.workers.training import rng
from syncpoint.workers.training.evaluation import evaluate
from tests.helpers import (
    cli,
    digest,
    linear_spec,
    lm_spec,
    run,
    run_until_crash,
    state_names,
    step_history,
    trainer_json,
)

# ----------------------------------------------------------------------------- the rules


def test_due_at_the_unit_and_always_at_the_end_never_when_off():
    steps = [
        s
        for s in range(1, 13)
        if rules.due(4, "optimizer_steps", optimizer_step=s, epoch=0, epoch_end=False, last=s == 13)
    ]
    assert steps == [4, 8, 12]
    assert rules.due(4, "optimizer_steps", optimizer_step=13, epoch=0, epoch_end=False, last=True)
    assert not rules.due(0, "optimizer_steps", optimizer_step=4, epoch=0, epoch_end=True, last=True)
    epochs = [e for e in range(6) if rules.due(2, "epochs", optimizer_step=99, epoch=e, epoch_end=True, last=False)]
    assert epochs == [1, 3, 5]  # 0-indexed epochs 1, 3, 5 end the 2nd, 4th, 6th epoch
    assert not rules.due(1, "epochs", optimizer_step=3, epoch=0, epoch_end=False, last=False)


@pytest.mark.parametrize("n,mbs,world", [(7, 2, 1), (5, 2, 2), (1, 3, 4), (16, 4, 4), (9, 1, 3), (3, 8, 2)])
def test_every_sample_counted_once_and_every_rank_runs_the_same_forwards(n, mbs, world):
    shards = [rules.shard_batches(n, mbs, world, r) for r in range(world)]
    seen = sorted(i for batches in shards for b in batches for i in b)
    assert seen == list(range(n))
    forwards = rules.forwards_per_rank(n, mbs, world)
    assert forwards == max(len(b) for b in shards)
    for batches in shards:
        assert all(0 < len(b) <= mbs for b in batches)
        pad = rules.padding_batch(batches, n, mbs)
        assert pad and all(0 <= i < n for i in pad)


def test_carried_keeps_only_finite_eval_numbers():
    got = rules.carried(
        {"loss": 1.0, "eval_loss": 2.5, "eval_acc": 1, "eval_bad": float("nan"), "eval_s": "x", "eval_b": True}
    )
    assert got == {"eval_loss": 2.5, "eval_acc": 1.0}
    assert rules.carried(None) == {}


def test_eval_every_has_the_shape_of_save_every():
    assert TrainSpec(micro_batch_size=1, epochs=1).eval_every.value == 0
    e = TrainSpec(micro_batch_size=1, epochs=1, eval_every="3 epochs").eval_every
    assert (e.value, e.unit) == (3, "epochs")
    e = TrainSpec(micro_batch_size=1, epochs=1, eval_every={"value": 5, "unit": "optimizer_steps"}).eval_every
    assert (e.value, e.unit) == (5, "optimizer_steps")


# ----------------------------------------------------------------------------- evaluate() leaves training alone


def _rng_snapshot():
    return (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())


def test_evaluate_restores_every_rng_and_mode_and_seeds_itself():
    ensure_single_process_group()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    model.train()
    model[2].eval()  # mixed modes come back as they were, submodule by submodule
    seen_modes, draws = [], []

    def metrics(m, batch):
        seen_modes.append(m.training)
        draws.append(torch.rand(()).item())  # model-side randomness in an eval forward
        x, y = batch
        return {"loss": torch.nn.functional.mse_loss(m(x), y)}

    from tests.tasks import Vectors

    data = Vectors(5)  # augmented: random per fetch
    before = _rng_snapshot()
    first = evaluate(model, data, metrics, None, micro_batch_size=2, world_size=1, rank=0, seed=11)
    after = _rng_snapshot()
    assert before[0] == after[0] and before[1] == after[1] and torch.equal(before[2], after[2])
    assert [m.training for m in model.modules()] == [True, True, True, False]
    assert seen_modes == [False] * 3
    random.random(), np.random.rand(), torch.rand(3)  # another position of every stream: evaluation does not care
    again = evaluate(model, data, metrics, None, micro_batch_size=2, world_size=1, rank=0, seed=11)
    assert again == first and draws[:3] == draws[3:]
    assert evaluate(model, data, metrics, None, micro_batch_size=2, world_size=1, rank=0, seed=12) != first


def test_rng_capture_round_trip_used_by_evaluate():
    saved = rng.capture()
    a = torch.rand(4)
    rng.restore(saved)
    assert torch.equal(a, torch.rand(4))


# ----------------------------------------------------------------------------- a run with evaluation


def _lm(tmp, *extra, zero=2):
    return lm_spec(
        tmp,
        "task.config.num_samples=20",
        "task.config.eval_samples=7",
        "train.grad_accum=3",
        "train.epochs=2",
        f"deepspeed.zero_stage={zero}",
        "checkpoint.save_every={value: 3, unit: optimizer_steps}",
        "train.eval_every=0",
        *extra,
    )


def evaluations(spec) -> dict[int, dict[str, float]]:
    return {k: e.metrics for k, e in EventLog(RunStorage(spec.run_url)).journal().evaluations().items()}


def all_evaluations(spec) -> list[Evaluated]:
    return EventLog(RunStorage(spec.run_url)).journal().of_kind(Evaluated)


def eval_metrics_of_states(spec) -> dict[str, dict[str, float]]:
    return {
        n: {k: v for k, v in trainer_json(spec, n)["metrics"].items() if k.startswith("eval_")}
        for n in state_names(spec)
    }


@pytest.mark.parametrize("zero", [0, 2])
def test_evaluation_does_not_change_the_training_trajectory(tmp_path, zero):
    off = _lm(tmp_path / "off", zero=zero)
    on = _lm(tmp_path / "on", "train.eval_every=2 optimizer_steps", zero=zero)
    final_off, final_on = run(off).final_state, run(on).final_state
    assert final_off == final_on
    assert digest(off, final_off) == digest(on, final_on)
    h_off, h_on = step_history(off), step_history(on)
    assert h_off.keys() == h_on.keys()
    assert all(h_off[k].loss == h_on[k].loss and h_off[k].lr == h_on[k].lr for k in h_off)
    # 2 epochs of 4 optimizer steps (3 + 3 + 3 + a short flush of 1): due at 2, 4, 6 and the end (8, also due)
    assert sorted(evaluations(on)) == [2, 4, 6, 8] and len(all_evaluations(on)) == 4
    assert evaluations(off) == {}
    assert all("eval_loss" not in m for m in eval_metrics_of_states(off).values())
    # each state holds the latest evaluation at or before it
    ev = evaluations(on)
    for name, metrics in eval_metrics_of_states(on).items():
        step = trainer_json(on, name)["optimizer_step"]
        latest = max(k for k in ev if k <= step)
        assert metrics == {"eval_loss": ev[latest]["loss"]}, name


def test_epoch_unit_and_the_end_of_a_max_steps_run(tmp_path):
    spec = _lm(tmp_path / "e", "train.eval_every=1 epochs", "train.epochs=3", "train.max_steps=10")
    run(spec)
    # epochs end at optimizer steps 4 and 8; the run ends at 10 (mid-epoch): evaluated there too
    assert sorted(evaluations(spec)) == [4, 8, 10]


# 2 epochs of 10 micro-steps, accumulation 3: optimizer steps end at micro-steps 3, 6, 9, 10 | 13, 16, 19, 20.
# Evaluations at steps 2, 4, 6, 8 (micro-steps 6, 10, 16, 20).
RESUME_CASES = {
    # saves at steps 3, 6 (micro-steps 9, 16): the crash at 14 falls after the evaluation at step 4
    # and before the next save, so the resumed attempt (from 9) evaluates step 4 again
    "crash-between-evaluation-and-save": ("[{at_micro_step: 14, mode: raise}]",),
    # right after the evaluation at step 4 (micro-step 10, no save there)
    "crash-at-an-evaluated-boundary": ("[{at_micro_step: 10, mode: raise}]",),
    # right after the save at step 3 (micro-step 9)
    "crash-right-after-a-save": ("[{at_micro_step: 9, mode: raise}]",),
    # saves at every step; right after the save at step 2: the resumed attempt's state at step 3
    # carries the evaluation of step 2 from the state it resumed
    "carried-across-the-resume": (
        "[{at_micro_step: 6, mode: raise}]",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    ),
}


@pytest.mark.parametrize("faults,extra", [(c[0], c[1:]) for c in RESUME_CASES.values()], ids=list(RESUME_CASES))
def test_resumed_run_reports_the_same_evaluations(tmp_path, faults, extra):
    ref = _lm(tmp_path / "ref", "train.eval_every=2 optimizer_steps", *extra)
    ref_final = run(ref).final_state
    spec = _lm(tmp_path / "run", "train.eval_every=2 optimizer_steps", *extra, f"faults={faults}")
    assert run_until_crash(spec)
    result = run(spec)
    assert result.resumed_from is not None
    assert result.final_state == ref_final and digest(spec, ref_final) == digest(ref, ref_final)
    assert evaluations(spec) == evaluations(ref)
    expected = evaluations(ref)
    for e in all_evaluations(spec):  # a step evaluated again after the crash reports the same numbers
        assert e.metrics == expected[e.optimizer_step], e
    states = eval_metrics_of_states(spec)
    assert states == eval_metrics_of_states(ref)
    # every state from step 2 on records an evaluation (also those right after the resume: carried)
    assert all(m for n, m in states.items() if trainer_json(spec, n)["optimizer_step"] >= 2)
    ok, line = compare_evaluations(Journal(all_evaluations(ref)), Journal(all_evaluations(spec)))
    assert ok and line and "match" in line


def test_drill_comparison_reports_a_mismatch():
    def ev(step, loss, attempt=1):
        return Evaluated(
            attempt=attempt,
            optimizer_step=step,
            global_micro_step=step * 4,
            metrics={"loss": loss},
            seconds=0.1,
            time=float(step + 10 * attempt),
        )

    ref = Journal([ev(2, 1.0), ev(4, 0.5)])
    assert compare_evaluations(ref, Journal([ev(2, 1.0), ev(4, 0.5)]))[0]
    ok, line = compare_evaluations(ref, Journal([ev(2, 1.0), ev(4, 0.5 + 1e-12)]))
    assert not ok and "MISMATCH" in line and "step 4" in line
    ok, line = compare_evaluations(ref, Journal([ev(2, 1.0)]))
    assert not ok and "reference only" in line
    # a repeated evaluation after a crash that disagrees fails even though the latest one matches
    assert not compare_evaluations(ref, Journal([ev(2, 1.0), ev(4, 0.4), ev(4, 0.5, attempt=2)]))[0]
    assert compare_evaluations(Journal([]), Journal([])) == (True, None)


def test_events_and_plot_show_evaluations(tmp_path, capsys):
    spec = linear_spec(
        tmp_path,
        "task.path=tests.tasks:linear_eval",
        "task.config.metrics=per_sample",
        "train.eval_every=1 optimizer_steps",
        "task.config.num_samples=8",
    )
    run(spec)
    journal = EventLog(RunStorage(spec.run_url)).journal()
    assert sorted(journal.evaluations()) == [1, 2]
    assert re.search(
        r"evaluated\s+optimizer step 2 \(micro-step 8\): abs_err [\d.]+, mse [\d.]+", format_timeline(journal)
    )
    run_dir = spec.run_url[len("file://") :]
    rc, out, _ = cli(capsys, "events", run_dir)
    assert rc == 0 and "evaluated" in out and "abs_err" in out
    rc, _, _ = cli(capsys, "events", run_dir, "--plot", str(tmp_path / "plot.png"))
    assert rc == 0 and (tmp_path / "plot.png").stat().st_size > 0


# ----------------------------------------------------------------------------- exact reduction


def test_reduction_is_exact_over_the_whole_eval_set(tmp_path):
    """7 eval samples in batches of 2 (2, 2, 2, 1): the weighted sums give the mean over samples,
    where an average of batch means would not."""
    spec = linear_spec(
        tmp_path,
        "task.path=tests.tasks:linear_eval",
        "task.config.metrics=per_sample",
        "train.eval_every=1 epochs",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "task.config.num_samples=8",
    )
    final = run(spec).final_state
    got = evaluations(spec)[trainer_json(spec, final)["optimizer_step"]]
    from tests.integration.workers.training.test_loop_exact_resume import module_params
    from tests.tasks import CleanVectors

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    model.load_state_dict(module_params(spec, final))
    model.eval()
    data = CleanVectors(7)
    with torch.no_grad():
        errs = torch.stack([(model(data[i][0][None]) - data[i][1]).squeeze() for i in range(7)]).double()
    assert got["mse"] == pytest.approx(float((errs**2).mean()), rel=1e-6, abs=0)
    assert got["abs_err"] == pytest.approx(float(errs.abs().mean()), rel=1e-6, abs=0)
    batch_means = [float((errs[i : i + 2] ** 2).mean()) for i in range(0, 7, 2)]
    assert abs(sum(batch_means) / len(batch_means) - got["mse"]) > 1e-4 * got["mse"]  # the test can tell
    metrics = trainer_json(spec, final)["metrics"]
    assert metrics["eval_mse"] == got["mse"] and metrics["eval_abs_err"] == got["abs_err"]


# ----------------------------------------------------------------------------- best-metric


def test_best_metric_picks_by_eval_loss(tmp_path, capsys):
    spec = _lm(
        tmp_path,
        "train.eval_every=1 optimizer_steps",
        "train.lr=0.05",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    )
    run(spec)
    by_state = {n: trainer_json(spec, n)["metrics"]["eval_loss"] for n in state_names(spec)}
    assert len(set(by_state.values())) == len(by_state)  # every state evaluated, each different
    best = min(by_state, key=by_state.get)
    rc, out, _ = cli(
        capsys,
        "states",
        spec.run_url[len("file://") :],
        "--policy",
        "best-metric",
        "--policy-args",
        json.dumps({"metric": "eval_loss", "mode": "min"}),
    )
    assert rc == 0
    assert re.search(rf"(chose|choice|->).*{best}|{best}.*best eval_loss", out, re.S), out
    assert f"best eval_loss (min) = {by_state[best]:.6g}" in out, out


# ----------------------------------------------------------------------------- bad Task.metrics


@pytest.mark.parametrize(
    "kind,message",
    [
        ("float", r"Task\.metrics returned 'loss' as float on eval samples \[0, 1\]; every value must be a tensor"),
        ("nan", r"Task\.metrics returned a non-finite 'loss' on eval samples \[0, 1\] \(nan or inf\)"),
        ("matrix", r"Task\.metrics returned 'out' with shape \(2, 1\) .*must be 0-d .* or 1-d"),
        (
            "list",
            r"Task\.metrics returned list on eval samples \[0, 1\]; it must return a non-empty dict\[str, Tensor\]",
        ),
    ],
)
def test_bad_task_metrics_fail_naming_task_metrics(tmp_path, kind, message):
    spec = linear_spec(
        tmp_path,
        "task.path=tests.tasks:linear_eval",
        f"task.config.metrics={kind}",
        "train.eval_every=1 epochs",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "task.config.num_samples=8",
    )
    with pytest.raises(TaskError, match=message):
        run(spec)


# ----------------------------------------------------------------------------- ZeRO-3, two ranks, uneven shards
