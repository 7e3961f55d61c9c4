"""Running state the state supplies on resume (issue 27.1, 27.5).

* Optimizers that keep running state in their param groups (``tests.tasks.GrowingSteps``, shaped
  like Prodigy: ``d`` grows, ``k`` counts, ``norm`` appears at the first step; and the real
  Prodigy): resumed after a crash == uninterrupted, weights and group values bitwise, at ZeRO 0-3
  (Prodigy: 0 and 2), with no "the task wins" line when nothing in the task changed; after an
  elastic resize (ZeRO 2, two workers to one) the groups' running values carry on;
* a real change of a hyper-parameter (weight_decay) still wins and is logged, and a running value
  whose initial value changed is kept with one info line;
* DeepSpeed's step counters (``micro_steps``, ``global_steps``, ``global_samples``,
  ``skipped_steps``) read by the loss: resumed == uninterrupted; after ``init_from`` they start at 0.
"""

from __future__ import annotations

import pytest
import torch

from syncpoint.workers.integrity.digest import load_deepspeed_file
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.training.param_groups import GroupSettings
from tests.helpers import linear_spec, run, run_until_crash, state_names, trainer_json, with_overrides
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run
from tests.integration.workers.training.test_param_groups import _groups as _groups_0_to_2

RUNNING = "task.path=tests.tasks:linear_running_groups"


def _spec(tmp, zero, *extra):
    """24 samples, accumulation 2: 12 optimizer steps; a state every 2 steps."""
    return linear_spec(
        tmp,
        "task.config.num_samples=24",
        "train.grad_accum=2",
        "checkpoint.save_every={value: 2, unit: optimizer_steps}",
        f"deepspeed.zero_stage={zero}",
        "train.scheduler={type: constant}",
        *extra,
    )


def _groups(spec, name, zero):
    """The base optimizer's param groups as DeepSpeed saved them (rank 0's file)."""
    if zero != 3:
        return _groups_0_to_2(spec, name, zero)
    data = RunStorage(spec.run_url).read_bytes(
        "states", name, "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt", limit=1 << 30
    )
    return load_deepspeed_file(data)["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]


def _values(groups):
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _crash_and_resume(tmp_path, capsys, zero, *extra):
    ref = _spec(tmp_path / "ref", zero, *extra)
    ref_final = run(ref).final_state
    spec = _spec(tmp_path / "run", zero, *extra, "faults=[{at_micro_step: 15, mode: raise}]")
    assert run_until_crash(spec)
    capsys.readouterr()
    result = run(spec)
    err = capsys.readouterr().err
    assert result.resumed_from == "000000000012"
    assert_same_run(ref, ref_final, spec, result.final_state)
    assert "wins" not in err, err  # nothing in the task changed: no config-wins line
    return ref, ref_final, spec, result


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_running_state_in_param_groups_resumes_exactly(tmp_path, capsys, zero):
    ref, ref_final, spec, result = _crash_and_resume(tmp_path, capsys, zero, RUNNING)
    got, want = _values(_groups(spec, result.final_state, zero)), _values(_groups(ref, ref_final, zero))
    assert got == want
    assert got[0]["k"] == 12 and got[0]["d"] > 1.0 and "norm" in got[0]
    # the state records which group keys are the optimizer's running state, with their as-built values
    assert trainer_json(spec, result.final_state)["optimizer"]["running"] == [{"d": 1.0, "k": 0}]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_prodigy_resumes_exactly(tmp_path, capsys, zero):
    pytest.importorskip("prodigyopt")
    ref, ref_final, spec, result = _crash_and_resume(tmp_path, capsys, zero, RUNNING, "task.config.optimizer=prodigy")
    got, want = _values(_groups(spec, result.final_state, zero)), _values(_groups(ref, ref_final, zero))
    assert got == want and got[0]["k"] == 12 and got[0]["d"] != got[0]["d0"]
    running = trainer_json(spec, result.final_state)["optimizer"]["running"][0]
    assert {"d", "d_max", "d_numerator", "k"} <= running.keys() and "weight_decay" not in running


@pytest.mark.slow
def test_a_changed_weight_decay_wins_and_running_values_are_kept(tmp_path, capsys):
    spec = _spec(tmp_path, 2, RUNNING, "faults=[{at_micro_step: 15, mode: raise}]")
    assert run_until_crash(spec)
    saved = _values(_groups(spec, "000000000012", 2))[0]
    assert saved["k"] == 6
    changed = with_overrides(spec, "task.config.weight_decay=0.05", "task.config.d0=2.0", "faults=[]")
    capsys.readouterr()
    result = run(changed)
    out, err = capsys.readouterr()
    assert "Task.optimizer param group 0 weight_decay: the state had 0.01, the task says 0.05; the task wins" in err
    assert "Task.optimizer param group 0 d0: the state had 1.0, the task says 2.0; the task wins" in err
    assert " d:" not in err and " k:" not in err  # running state: never a config-wins warning
    assert "param group 0 d: running state" in out and "changed from 1.0 to 2.0" in out
    final = _values(_groups(spec, result.final_state, 2))[0]
    assert final["weight_decay"] == 0.05 and final["d0"] == 2.0
    assert final["k"] == 12 and final["d"] == pytest.approx(saved["d"] * 1.05**6, rel=1e-12)


def _group(p, **values):
    return {
        "params": [p],
        "lr": 0.1,
        "initial_lr": 0.1,
        "weight_decay": 0.0,
        "d": 1.0,
        "k": 0,
        "betas": (0.9, 0.99),
        "t": torch.tensor(1.0),
    } | values


def test_running_keys_are_what_the_optimizer_changed():
    """The rule without a list per optimizer: keys changed since build are running state (the
    schedule's lr excluded), kept on restore; keys added at the first step are no snapshot key
    and keep the state's value; every other key takes the live value, logged when it changed."""
    p = torch.nn.Parameter(torch.zeros(2))
    live = [_group(p)]
    settings = GroupSettings.snapshot(live, (), "Opt")
    live[0].update(lr=0.05, d=1.5, k=3, norm=2.0, t=torch.tensor(2.0))  # as a step and the schedule leave it
    running = settings.running_record(live)
    assert running == [{"d": 1.0, "k": 0, "t": None}]  # as-built values; a tensor: not JSON, not known
    # a new attempt: the live group as built, then the state's groups loaded over it
    fresh = GroupSettings.snapshot([_group(p)], (), "Opt")
    loaded = [_group(p, lr=0.07, weight_decay=0.3, d=9.0, k=7, norm=4.0, betas=[0.9, 0.99], t=torch.tensor(5.0))]
    restored = fresh.restore(loaded, lambda key: True, running)
    assert (loaded[0]["d"], loaded[0]["k"], loaded[0]["norm"], float(loaded[0]["t"])) == (9.0, 7, 4.0, 5.0)
    assert (loaded[0]["lr"], loaded[0]["weight_decay"], loaded[0]["betas"]) == (0.1, 0.0, (0.9, 0.99))
    assert (
        restored.changes
        == ["Task.optimizer param group 0 weight_decay: the state had 0.3, the task says 0.0; the task wins"]
        and restored.kept == []
    )
    assert fresh.running_record(loaded) == running  # the record carries on to the next save
    # the initial value of a running key changed: the state's value is kept, one info line says so
    moved = GroupSettings.snapshot([_group(p, d=2.0)], (), "Opt")
    again = [_group(p, d=9.0, k=7)]
    assert len(moved.restore(again, lambda key: True, running).kept) == 1 and again[0]["d"] == 9.0
    # a state without the record: every snapshot key comes from the live run
    old = [_group(p, d=9.0, k=7)]
    assert GroupSettings.snapshot([_group(p)], (), "Opt").restore(old, lambda key: True, None).kept == []
    assert (old[0]["d"], old[0]["k"]) == (1.0, 0)


# ------------------------------------------------------------------ DeepSpeed's counters


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_engine_counters_a_loss_reads_resume_exactly(tmp_path, zero):
    extra = (
        "task.path=tests.tasks:linear_counters",
        "task.config.num_samples=20",
        "train.grad_accum=3",
        "train.epochs=2",
    )  # 20 micro-batches per epoch, accumulation 3: a short cycle at each epoch end
    ref = _spec(tmp_path / "ref", zero, *extra)
    ref_final = run(ref).final_state
    spec = _spec(tmp_path / "run", zero, *extra, "faults=[{at_micro_step: 27, mode: raise}]")
    assert run_until_crash(spec)
    result = run(spec)
    assert result.resumed_from is not None and int(result.resumed_from) > 20
    assert_same_run(ref, ref_final, spec, result.final_state)


@pytest.mark.slow
def test_running_state_survives_a_resize(tmp_path):
    """Elastic ZeRO 2: two workers lose one and finish on one. The resize loads the optimizer from
    the gathered full state, not DeepSpeed's files: the groups' running values travel with it
    (``k`` counts every step of the run, not those since the resize)."""
    from syncpoint.workers.supervision.launch import run_spawned

    spec = linear_spec(
        tmp_path,
        RUNNING,
        "scaling.num_workers={min: 1, max: 2}",
        "task.config.num_samples=32",
        "train.grad_accum=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "deepspeed.zero_stage=2",
        "faults=[{rank: 1, at_micro_step: 7}]",
        workers=2,
    )
    assert run_spawned(spec)[1] == 17
    assert run_spawned(spec, world_size=1) == [0]
    name = state_names(spec)[-1]
    final = trainer_json(spec, name)  # 8 optimizer steps: 3 on two workers, 5 on one
    assert (final["world_size"], final["optimizer_step"]) == (1, 8)
    groups = _values(_groups(spec, name, 2))
    assert groups[0]["k"] == 8 and groups[0]["d"] == pytest.approx(1.05**8, rel=1e-12)


@pytest.mark.slow
def test_init_from_starts_the_counters_at_zero(tmp_path):
    """init_from with the optimizer loads the other run's DeepSpeed files, counters included; the
    position is fresh, so the counters a loss reads are too."""
    source = _spec(tmp_path / "source", 0, "task.path=tests.tasks:linear_counters", "train.max_steps=3")
    final = run(source).final_state
    spec = _spec(
        tmp_path / "run",
        0,
        "task.path=tests.tasks:linear_counters",
        "task.config.starts_at_zero=true",
        f"resume.init_from={source.run_url}/states/{final}",
        "resume.init_optimizer=true",
        "train.max_steps=2",
    )
    assert run(spec).optimizer_step == 2
