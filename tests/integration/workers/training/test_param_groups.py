"""Parameter groups and schedules (issue 17.1): your optimizer, your groups, your schedule, resumed exactly.

* ``Task.optimizer`` with two groups of different lr and weight decay, and the built-in optimizer
  with its default ``no_decay`` split: resumed == uninterrupted (per-step losses, lrs, weights,
  digest) at ZeRO 0 and 2 (two ranks and offload: slow);
* every new schedule (wsd, inverse_sqrt, polynomial, step, custom) at ZeRO 0 and 2, each group's
  rate the schedule's factor times its own base rate;
* config wins per group (a Task's edited group lr / weight decay takes effect after a resume);
* another group layout is refused at selection naming ``train.optimizer.no_decay`` / ``Task.optimizer``
  and ``resume.reset_optimizer`` (states written before the layout was recorded: one group);
* another schedule type or decay shape is refused naming ``resume.reset_schedule``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.tiny_lm import TinyLM
from syncpoint.policies.contracts.errors import JobConfigError, ResumeRefused, TaskError
from syncpoint.policies.contracts.spec import SchedulerSpec
from syncpoint.policies.decisions.candidates import Verdict, classify
from syncpoint.workers.integrity.digest import load_deepspeed_file
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from syncpoint.workers.training.param_groups import builtin_groups, decay_split, default_no_decay
from syncpoint.workers.training.schedule import factor_at
from tests.helpers import digest, lm_spec, run, run_until_crash, step_history, trainer_json, with_overrides
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run
from tests.meta import candidate_for, changed, live

SAVE = "{value: 3, unit: micro_steps}"
TWO_GROUPS = "task.path=tests.group_tasks:lm_two_groups"


def _spec(tmp, zero, *extra, workers=1):
    """10 micro-batches per epoch, accumulation 2, two epochs: 10 optimizer steps."""
    return lm_spec(
        tmp,
        f"task.config.num_samples={20 * workers}",
        "train.grad_accum=2",
        "train.epochs=2",
        f"checkpoint.save_every={SAVE}",
        f"deepspeed.zero_stage={zero}",
        *extra,
        workers=workers,
    )


def _crash_and_resume(tmp_path, zero, *extra, crash_at=9):
    ref = _spec(tmp_path / "ref", zero, *extra)
    ref_final = run(ref).final_state
    spec = _spec(tmp_path / "run", zero, *extra, f"faults=[{{at_micro_step: {crash_at}, mode: raise}}]")
    assert run_until_crash(spec)
    result = run(spec)
    assert result.resumed_from is not None
    assert_same_run(ref, ref_final, spec, result.final_state)
    return spec, result


def _saved_groups(spec, name):
    data = RunStorage(spec.run_url).read_bytes("states", name, "engine/mp_rank_00_model_states.pt", limit=1 << 30)
    optimizer = load_deepspeed_file(data)["optimizer"]
    # ZeRO 0: the torch optimizer's state dict; ZeRO 1/2 keep theirs in the per-rank shards
    return optimizer["param_groups"] if optimizer else None


def _zero_groups(spec, name):
    data = RunStorage(spec.run_url).read_bytes(
        "states", name, "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt", limit=1 << 30
    )
    return load_deepspeed_file(data)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]


def _groups(spec, name, zero):
    return _saved_groups(spec, name) if zero == 0 else _zero_groups(spec, name)


# ------------------------------------------------------------------ the default no_decay split


def test_default_no_decay_is_biases_and_norm_parameters():
    model = TinyLM(d_model=16, seq_len=8)
    excluded = default_no_decay(model)
    names = dict(model.named_parameters())
    assert all(n.endswith("bias") or ".norm" in n for n in excluded)
    assert {
        "blocks.layers.0.norm1.weight",
        "blocks.layers.0.norm2.weight",
        "head.bias",
        "blocks.layers.0.self_attn.in_proj_bias",
    } <= excluded
    assert not {"embed.weight", "pos", "head.weight", "blocks.layers.0.linear1.weight"} & excluded
    assert len(excluded) == sum(1 for n in names if n.endswith("bias") or ".norm" in n)

    class RMSNormLike(torch.nn.Module):  # HF's own norm classes: detected by class name
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), RMSNormLike())
    assert default_no_decay(m) == {"0.bias", "1.scale"}
    # explicit patterns replace the default; [] keeps one group; the split ignores weight_decay
    decay, no = decay_split(m, ["*.scale"])
    assert [n for n, _ in no] == ["1.scale"] and [n for n, _ in decay] == ["0.weight", "0.bias"]
    assert len(builtin_groups(m, 0.1, [])) == 1
    assert [g["weight_decay"] for g in builtin_groups(m, 0.0, None)] == [0.0, 0.0]
    assert [len(g["params"]) for g in builtin_groups(m, 0.1, None)] == [1, 2]


@pytest.mark.parametrize("zero", [0, 2])
def test_builtin_optimizer_with_default_no_decay_resumes_exactly(tmp_path, zero):
    spec, result = _crash_and_resume(tmp_path, zero, "train.scheduler={type: cosine, warmup: 2}")
    groups = _groups(spec, result.final_state, zero)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]  # the example's adamw weight_decay 0.01
    recorded = trainer_json(spec, result.final_state)["optimizer"]
    assert recorded["type"] == "adamw" and len(recorded["param_groups"]) == 2
    model = TinyLM(d_model=16, seq_len=8)
    no_decay = default_no_decay(model)
    assert recorded["param_groups"][1]["params"] == len(no_decay)
    assert recorded["param_groups"][1]["numel"] == sum(p.numel() for n, p in model.named_parameters() if n in no_decay)


def test_no_decay_empty_list_is_one_group(tmp_path):
    spec = _spec(tmp_path, 0, "train.optimizer.no_decay=[]", "train.max_steps=2")
    final = run(spec).final_state
    assert len(_saved_groups(spec, final)) == 1
    assert len(trainer_json(spec, final)["optimizer"]["param_groups"]) == 1


# ------------------------------------------------------------------ Task.optimizer


@pytest.mark.parametrize("zero", [0, 2])
def test_task_optimizer_with_two_groups_resumes_exactly(tmp_path, zero):
    spec, result = _crash_and_resume(tmp_path, zero, TWO_GROUPS, "train.scheduler={type: linear, warmup: 3}")
    groups = _groups(spec, result.final_state, zero)
    assert [(g["weight_decay"], tuple(g["betas"])) for g in groups] == [(0.1, (0.9, 0.99)), (0.0, (0.9, 0.99))]
    assert trainer_json(spec, result.final_state)["optimizer"]["type"] == "AdamW"
    # each group's rate is the schedule's factor times its own base rate (not train.lr)
    s, total = spec.train.scheduler, 10
    for step, rec in step_history(spec).items():
        f = factor_at(step - 1, s, total)
        assert rec.lrs == [2e-3 * f, 5e-4 * f] and rec.lr == 2e-3 * f


def test_task_optimizer_edited_group_hyperparameters_win_after_resume(tmp_path, capsys):
    """Config wins, per group: the live task's group lr and weight decay, not the state's."""
    spec = _spec(
        tmp_path, 2, TWO_GROUPS, "train.scheduler={type: constant}", "faults=[{at_micro_step: 9, mode: raise}]"
    )
    assert run_until_crash(spec)
    changed = with_overrides(spec, "task.config.rest_wd=0.05", "task.config.embed_lr=0.004", "faults=[]")
    capsys.readouterr()
    result = run(changed)
    err = capsys.readouterr().err
    assert "Task.optimizer param group 1 weight_decay: the state had 0.0, the task says 0.05; the task wins" in err
    groups = _zero_groups(spec, result.final_state)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.05]
    hist, at = step_history(spec), trainer_json(spec, result.resumed_from)["optimizer_step"]
    assert at >= 1 and max(hist) > at
    for step, rec in hist.items():  # a constant schedule: each group's base rate as the live task says
        assert rec.lrs == ([0.004, 5e-4] if step > at else [2e-3, 5e-4]), step


def test_task_optimizer_must_return_an_optimizer(tmp_path):
    spec = _spec(tmp_path, 0, "task.path=tests.group_tasks:lm_returns_no_optimizer")
    with pytest.raises(JobConfigError, match=r"Task\.optimizer returned str.*torch\.optim\.Optimizer"):
        run(spec)


def test_task_optimizer_must_be_callable(tmp_path, monkeypatch):
    import tests.group_tasks as g

    def not_callable(config):
        task = g.build(config)
        task.optimizer = 3
        return task

    monkeypatch.setattr(g, "lm_returns_no_optimizer", not_callable)
    with pytest.raises(TaskError, match="optimizer is not callable"):
        run(_spec(tmp_path, 0, "task.path=tests.group_tasks:lm_returns_no_optimizer"))


# ------------------------------------------------------------------ the layout is identity


def test_another_group_layout_is_refused_at_selection_with_the_opt_out(tmp_path):
    spec = _spec(tmp_path, 2, "faults=[{at_micro_step: 9, mode: raise}]")
    assert run_until_crash(spec)
    one_group = with_overrides(spec, "train.optimizer.no_decay=[]", "faults=[]")
    with pytest.raises(ResumeRefused) as refused:
        run(one_group)
    reason = str(refused.value)
    assert "parameter groups differ" in reason and "train.optimizer.no_decay" in reason
    assert "Task.optimizer" in reason and "resume.reset_optimizer" in reason
    # the default split spelled out as patterns is the same layout: it resumes
    spelled_out = with_overrides(spec, "train.optimizer.no_decay=['*bias', '*.norm*']", "faults=[]")
    assert run(spelled_out).resumed_from is not None
    spec2 = _spec(tmp_path / "b", 2, "faults=[{at_micro_step: 9, mode: raise}]")
    assert run_until_crash(spec2)
    result = run(with_overrides(spec2, "train.optimizer.no_decay=[]", "resume.reset_optimizer=true", "faults=[]"))
    assert result.resumed_from is not None and len(_zero_groups(spec2, result.final_state)) == 1


def test_task_optimizer_instead_of_the_spec_is_another_optimizer_type(tmp_path):
    spec = _spec(tmp_path, 0, TWO_GROUPS, "task.config.own_optimizer=false", "faults=[{at_micro_step: 9, mode: raise}]")
    assert run_until_crash(spec)
    assert trainer_json(spec, "000000000006")["optimizer"]["type"] == "adamw"
    with pytest.raises(ResumeRefused, match=r"train\.optimizer\.type.*Task\.optimizer.*resume\.reset_optimizer"):
        run(with_overrides(spec, "task.config.own_optimizer=true", "faults=[]"))


EXP = live("j", 1, 2, 2, 10, 2, "f", 1, optimizer_type="adamw", scheduler_type="cosine", scheduler_phases=("cosine",))


def test_legacy_state_without_a_layout_resumes_only_into_one_group():
    legacy = candidate_for(4, EXP)  # written before the field: no param_groups recorded
    assert legacy.trainer["optimizer"]["param_groups"] is None
    one = changed(EXP, param_groups=((7, 100, "aa"),))
    two = changed(EXP, param_groups=((5, 90, "aa"), (2, 10, "bb")))
    assert classify(candidate_for(4, EXP), one).verdict is Verdict.RESUMABLE
    c = classify(candidate_for(4, EXP), two)
    assert c.verdict is Verdict.INCOMPATIBLE
    assert "train.optimizer.no_decay: []" in c.reason and "resume.reset_optimizer" in c.reason
    assert classify(candidate_for(4, EXP), dataclasses.replace(two, reset_optimizer=True)).verdict is Verdict.RESUMABLE
    # recorded layouts: equal resumes, other members with the same sizes are named as such
    assert classify(candidate_for(4, two), two).verdict is Verdict.RESUMABLE
    other = classify(candidate_for(4, two), changed(two, param_groups=((5, 90, "cc"), (2, 10, "bb"))))
    assert other.verdict is Verdict.INCOMPATIBLE and "same sizes, other parameters" in other.reason


def test_a_states_identity_reads_the_layout_back():
    from syncpoint.policies.contracts.state_format import TrainState

    two = changed(EXP, param_groups=((5, 90, "aa"), (2, 10, "bb")))
    state = TrainState.model_validate(candidate_for(4, two).trainer)
    assert state.identity().optimizer.param_groups == two.identity.optimizer.param_groups


# ------------------------------------------------------------------ schedules

SCHEDULES = {
    "wsd": "{type: wsd, warmup: 2, decay_fraction: 0.4, decay_shape: cosine, min_lr_ratio: 0.1}",
    "inverse_sqrt": "{type: inverse_sqrt, warmup: 3}",
    "polynomial": "{type: polynomial, warmup: 1, power: 2.0, min_lr_ratio: 0.05}",
    "step": "{type: step, warmup: 1, step_size: 3, gamma: 0.5}",
    "custom": "{type: custom, path: 'tests.group_tasks:half_then_quarter'}",
}


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("kind", list(SCHEDULES))
def test_each_schedule_resumes_exactly_and_scales_each_group(tmp_path, kind, zero):
    spec, _ = _crash_and_resume(tmp_path, zero, f"train.scheduler={SCHEDULES[kind]}", "train.lr=0.002", crash_at=11)
    from tests.group_tasks import half_then_quarter

    s, hist = spec.train.scheduler, step_history(spec)
    expected = {
        step: (half_then_quarter(step - 1, 10) if kind == "custom" else factor_at(step - 1, s, 10)) for step in hist
    }
    for step, rec in hist.items():
        assert rec.lrs == [0.002 * expected[step]] * 2, (step, rec.lrs)
    assert len(set(expected.values())) >= 3  # the schedule really moves


def test_schedule_factors():
    def f(position, total=10, **kw):
        return factor_at(position, SchedulerSpec(**kw), total)

    # wsd: warmup 2, stable until 10 - 4 = 6, then linear decay to min over 4 steps
    wsd = [f(p, type="wsd", warmup=2, decay=4) for p in range(10)]
    assert wsd[:2] == [0.5, 1.0] and wsd[2:6] == [1.0] * 4 and wsd[6:] == [1.0, 0.75, 0.5, 0.25]
    assert f(9, type="wsd", decay_fraction=0.5, min_lr_ratio=0.2) == pytest.approx(0.2 + 0.8 * 0.2)
    assert [f(p, type="inverse_sqrt", warmup=4) for p in (3, 15)] == [1.0, 0.5]
    assert f(5, type="polynomial", power=2.0) == pytest.approx(0.25)
    assert [f(p, type="step", step_size=2, gamma=0.5) for p in range(5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    assert [f(p, type="step", step_size=2) for p in (1, 2)] == [1.0, pytest.approx(0.1)]
    assert f(5, type="polynomial") == f(5, type="linear")


def test_custom_schedule_errors_name_the_function(tmp_path):
    bad = _spec(tmp_path / "a", 0, "train.scheduler={type: custom, path: 'tests.group_tasks:missing'}")
    with pytest.raises(JobConfigError, match=r"train\.scheduler\.path: .*no attribute 'missing'"):
        run(bad)
    not_fn = _spec(tmp_path / "b", 0, "train.scheduler={type: custom, path: 'tests.group_tasks:NOT_A_FUNCTION'}")
    with pytest.raises(JobConfigError, match="not a function written in Python; it is not called"):
        run(not_fn)
    nan = _spec(tmp_path / "c", 0, "train.scheduler={type: custom, path: 'tests.group_tasks:not_finite'}")
    with pytest.raises(JobConfigError, match=r"tests\.group_tasks:not_finite returned nan at position 1"):
        run(nan)


def test_another_schedule_type_or_decay_shape_is_refused_naming_reset_schedule(tmp_path):
    spec = _spec(tmp_path, 0, "train.scheduler={type: wsd, decay: 3}", "faults=[{at_micro_step: 9, mode: raise}]")
    assert run_until_crash(spec)
    for change in ("train.scheduler={type: wsd, decay: 3, decay_shape: cosine}", "train.scheduler={type: cosine}"):
        with pytest.raises(ResumeRefused, match=r"resume\.reset_schedule"):
            run(with_overrides(spec, change, "faults=[]"))
    # the decay's length is a value, not the shape: it resumes (config wins)
    assert run(with_overrides(spec, "train.scheduler={type: wsd, decay_fraction: 0.5}", "faults=[]")).resumed_from


# ------------------------------------------------------------------ offload and two ranks (slow)


@pytest.mark.slow
def test_two_ranks_task_optimizer_hard_crash_resumes_exactly(tmp_path):
    extra = (TWO_GROUPS, "train.scheduler={type: wsd, warmup: 1, decay: 3}")
    ref = _spec(tmp_path / "ref", 2, *extra, workers=2)
    assert run_spawned(ref) == [0, 0]
    ref_final = max(RunStorage(ref.run_url).list_dirs("states"))
    spec = _spec(tmp_path / "run", 2, *extra, "faults=[{rank: 1, at_micro_step: 13}]", workers=2)
    assert run_spawned(spec)[1] == 17
    assert run_spawned(spec) == [0, 0]
    final = max(RunStorage(spec.run_url).list_dirs("states"))
    assert_same_run(ref, ref_final, spec, final)
    assert digest(spec, final) == digest(ref, ref_final)


def test_validate_refuses_a_custom_schedule_whose_module_cannot_be_found(capsys, monkeypatch):
    """``syncpoint validate`` / ``run`` check train.scheduler.path like every import path, before Ray starts."""
    from syncpoint.orchestrator.cli import main
    from tests.helpers import ROOT

    monkeypatch.chdir(ROOT)
    custom = "train.scheduler={type: custom, path: 'no_such_schedules:fn'}"
    light = (
        "--set",
        "task.path=tests.light_tasks:linear",
    )  # the scheduler's path is the subject: no torch for the task's
    assert main(["validate", "examples/tiny_lm.yaml", "--set", custom, *light]) == 2
    err = capsys.readouterr().err
    assert "train.scheduler.path: 'no_such_schedules:fn' cannot be imported" in err and "Traceback" not in err
    ok = "train.scheduler={type: custom, path: 'tests.group_tasks:half_then_quarter'}"
    assert main(["validate", "examples/tiny_lm.yaml", "--set", ok, *light]) == 0
