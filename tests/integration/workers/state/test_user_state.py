"""``Task.stateful``: objects the engine does not own, saved per rank with every state, resumed exactly.

The task (``tests.tasks:linear_user_state``) scales its loss by user state that the loss itself
updates every micro-step, differently on each rank, and keeps an EMA of the weights
(``torch.optim.swa_utils.AveragedModel``): a resume that lost either computes other losses from
the first micro-step after it, and a resumed EMA differs from the uninterrupted one. Compared: every
optimizer step's loss and the final state's digest (which covers every rank's user file).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from syncpoint.policies.contracts.errors import ResumeRefused, TaskError
from syncpoint.policies.contracts.state_format import TrainState, required_files, user_file
from syncpoint.policies.decisions.candidates import Verdict, classify
from syncpoint.workers.data.stream_state import parse_tree
from syncpoint.workers.integrity.digest import state_digest
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state import user_state
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from syncpoint.workers.task import load_task
from tests.helpers import (
    digest,
    linear_spec,
    rewrite_state_file,
    run,
    run_until_crash,
    state_names,
    step_history,
    with_overrides,
)
from tests.meta import candidate_for, changed, live

EXP = live("j", 2, 4, 4, 10, 2, "f", 1, precision="fp32", optimizer_type="adamw", user_state=("ema", "scale"))


def _spec(tmp, zero=0, *extra, workers=1):
    return linear_spec(
        tmp,
        "task.path=tests.tasks:linear_user_state",
        "task.config={num_samples: 32}",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.epochs=2",
        "checkpoint.save_every={value: 3, unit: micro_steps}",
        f"deepspeed.zero_stage={zero}",
        *extra,
        workers=workers,
    )


def _losses(spec) -> list[float]:
    return [s.loss for _, s in sorted(step_history(spec).items())]


def _user_objects(spec, name: str, rank: int) -> dict:
    data = RunStorage(spec.run_url).read_bytes("states", name, user_file(rank), limit=1 << 30)
    return parse_tree(data, user_file(rank), user_state.META_KEY, ("objects",), "user state")["objects"]


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers,zero,saving", [(1, 0, "sync"), pytest.param(2, 0, "sync", marks=pytest.mark.long), (2, 2, "async")]
)
def test_user_state_resumes_exactly_on_every_rank(tmp_path, workers, zero, saving):
    """Crashed at micro-step 9 (mid-cycle, after the state at 6), resumed: the same losses and the same
    final state, every rank's user state included; each rank's state is its own."""
    extra = ["checkpoint.async=true"] if saving == "async" else []
    ref = _spec(tmp_path / "ref", zero, *extra, workers=workers)
    resumed = _spec(tmp_path / "resumed", zero, *extra, workers=workers)
    crashing = with_overrides(resumed, f"faults=[{{at_micro_step: 9, mode: {'raise' if workers == 1 else 'exit'}}}]")
    if workers == 1:
        run(ref)
        assert run_until_crash(crashing)
        assert run(resumed).resumed_from is not None
    else:
        assert run_spawned(ref) == [0, 0]
        assert run_spawned(crashing)[0] == 17
        assert run_spawned(resumed) == [0, 0]
    final = state_names(ref)[-1]
    assert state_names(resumed)[-1] == final
    assert _losses(ref) == _losses(resumed)
    assert digest(ref, final) == digest(resumed, final)
    objects = [_user_objects(resumed, final, r) for r in range(workers)]
    assert all(sorted(o) == ["ema", "scale"] for o in objects)
    if workers == 2:  # per rank: the ranks' own states differ (rank-dependent updates)
        assert not torch.equal(objects[0]["scale"]["scale"], objects[1]["scale"]["scale"])


@pytest.mark.slow
def test_without_restoring_user_state_the_resume_would_differ(tmp_path, monkeypatch):
    """The exactness above is the user file's doing: restored as a no-op, the resumed losses differ."""
    ref, resumed = _spec(tmp_path / "ref"), _spec(tmp_path / "resumed")
    run(ref)
    assert run_until_crash(with_overrides(resumed, "faults=[{at_micro_step: 9, mode: raise}]"))
    monkeypatch.setattr(user_state, "restore", lambda stateful, saved: ([], []))
    run(resumed)
    assert _losses(ref) != _losses(resumed)


def _rng_spec(tmp, *extra):
    return linear_spec(
        tmp,
        "task.path=tests.tasks:linear_numpy_rng",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.epochs=1",
        "checkpoint.save_every={value: 3, unit: micro_steps}",
        *extra,
    )


@pytest.mark.slow
def test_a_numpy_generators_state_resumes_exactly(tmp_path):
    """``Task.stateful`` returning ``np.random.default_rng(1).bit_generator.state`` as is (PCG64: 128-bit
    integers): saved, read back at the resume, and the loss it scales continues as uninterrupted."""
    ref, resumed = _rng_spec(tmp_path / "ref"), _rng_spec(tmp_path / "resumed")
    run(ref)
    assert run_until_crash(with_overrides(resumed, "faults=[{at_micro_step: 9, mode: raise}]"))
    newest = state_names(resumed)[-1]
    saved = _user_objects(resumed, newest, 0)["rng"]
    assert saved["bit_generator"] == "PCG64" and saved["state"]["inc"] >= 2**64  # wider than any counter
    assert run(resumed).resumed_from == newest
    final = state_names(ref)[-1]
    assert _losses(ref) == _losses(resumed)
    assert digest(ref, final) == digest(resumed, final)


@pytest.mark.slow
def test_an_integer_too_long_to_read_back_is_refused_at_the_first_save_naming_its_path(tmp_path):
    spec = _rng_spec(tmp_path, "task.config={num_samples: 32, huge_int: true}")
    with pytest.raises(user_state.UserStateError) as e:
        run(spec)
    assert re.search(
        r"Task\.stateful's state holds an integer of 1000 bits at state\['rng'\]\['huge'\]: syncpoint saves "
        r"integers of at most 300 digits",
        str(e.value),
    ), str(e.value)
    assert state_names(spec) == []


def test_the_state_codec_writes_and_reads_integers_up_to_one_shared_bound():
    """The writer refuses exactly what the reader would call corrupt: one bound for both."""
    from syncpoint.policies.contracts.errors import StateRefused
    from syncpoint.workers.data.stream_state import MAX_INT_DIGITS, encode_tree

    widest = -(10**MAX_INT_DIGITS - 1)
    data = encode_tree({"objects": {"n": {"v": widest}}}, user_state.META_KEY, user_state.LABEL)
    assert user_state.parse(data, user_file(0), ("n",)) == {"n": {"v": widest}}
    with pytest.raises(user_state.UserStateError, match=r"at state\['n'\]\['v'\]\[1\]"):
        encode_tree({"objects": {"n": {"v": [0, 10**MAX_INT_DIGITS]}}}, user_state.META_KEY, user_state.LABEL)
    from safetensors.torch import save as st_save

    one_more = {"version": 1, "objects": {"n": {"v": widest * 10}}}  # as another writer could have written it
    forged = st_save({}, metadata={user_state.META_KEY: json.dumps(one_more)})
    with pytest.raises(StateRefused, match=f"at most {MAX_INT_DIGITS} digits"):
        user_state.parse(forged, user_file(0), ("n",))


# ----------------------------------------------------------------------------- refused, with reasons


@pytest.mark.slow
def test_a_changed_set_of_names_is_refused_at_selection_and_the_opt_out_resumes(tmp_path, capfd):
    spec = _spec(tmp_path, 0, "train.epochs=1")
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 9, mode: raise}]"))
    newest = state_names(spec)[-1]
    fewer = with_overrides(spec, "task.config={num_samples: 32, names: [scale]}")
    with pytest.raises(ResumeRefused) as e:
        run(fewer)
    assert re.search(
        r"incompatible\s+user state differs \(Task\.stateful\): the state saved \['ema'\] that this run's task "
        r"lacks.*set resume\.allow_user_state_change: true",
        str(e.value),
    ), str(e.value)
    allowed = with_overrides(fewer, "resume.allow_user_state_change=true")
    assert run(allowed).resumed_from == newest
    assert "saved ['ema'] that this task lacks (dropped)" in capfd.readouterr().err


def test_selection_refuses_other_names_and_another_world_size_with_user_state():
    c = candidate_for(8, EXP)
    assert TrainState.model_validate(c.trainer).user_state == ["ema", "scale"]
    assert classify(c, EXP).verdict is Verdict.RESUMABLE, c.reason

    other = classify(candidate_for(8, EXP), changed(EXP, user_state=("ema", "mixture", "scale")))
    assert other.verdict is Verdict.INCOMPATIBLE
    assert "this run's task has ['mixture'] that the state did not save" in other.reason
    assert classify(candidate_for(8, EXP), changed(EXP, user_state=None)).verdict is Verdict.INCOMPATIBLE
    older = candidate_for(8, changed(EXP, user_state=None))  # a state without user state, a task with it
    assert "the state: none" in classify(older, EXP).reason
    assert classify(candidate_for(8, EXP), changed(EXP, allow_user_state_change=True, user_state=None)).verdict is (
        Verdict.RESUMABLE
    )
    elastic = changed(EXP, elastic=True, zero_stage=0)  # a state that could load on another world size
    resized = classify(candidate_for(8, elastic), changed(elastic, world_size=4))
    assert resized.verdict is Verdict.INCOMPATIBLE and "each rank's objects are its own" in resized.reason
    c = candidate_for(8, EXP)
    del c.manifest["files"][user_file(1)]
    assert classify(c, EXP).verdict is Verdict.CORRUPT


def test_a_state_with_user_state_needs_every_ranks_user_file():
    files = required_files(world_size=2, zero_stage=0, precision=None, full_optimizer_state=False, user_state=True)
    assert files[-2:] == [user_file(0), user_file(1)]
    with pytest.raises(ValueError, match="unique names in sorted order"):
        TrainState.model_validate({**candidate_for(8, EXP).trainer, "user_state": ["scale", "ema"]})


@pytest.mark.parametrize(
    "stateful,match",
    [
        ({"bad name": torch.nn.Linear(1, 1)}, r"Task\.stateful name 'bad name' is not a plain name"),
        ({"plain": object()}, r"Task\.stateful\['plain'\] is a object, which has no state_dict\(\)/load_state_dict"),
        ([torch.nn.Linear(1, 1)], r"Task\.stateful of type list: it must be a dict"),
    ],
)
def test_a_task_whose_stateful_cannot_be_saved_is_refused_at_start(stateful, match):
    with pytest.raises(TaskError, match=match):
        user_state.check("tests.tasks:x", stateful)


def test_a_user_state_that_is_not_json_or_tensors_is_refused_naming_its_path():
    class Holder:
        def state_dict(self):
            return {"ok": torch.zeros(2), "bad": {"inner": object()}}

        def load_state_dict(self, state):
            pass

    with pytest.raises(
        user_state.UserStateError, match=r"holds a builtins\.object at state\['holder'\]\['bad'\]\['inner'\]"
    ):
        user_state.capture({"holder": Holder()})
    data = user_state.capture({"n": torch.nn.Linear(2, 1)})
    assert data is not None and sorted(user_state.parse(data, user_file(0), ("n",))) == ["n"]
    from syncpoint.policies.contracts.errors import StateRefused

    with pytest.raises(StateRefused, match=r"holds \['n'\], the state records \['m'\]: refused \(corrupt\)"):
        user_state.parse(data, user_file(0), ("m",))


@pytest.mark.slow
def test_a_user_file_that_does_not_load_falls_back_to_the_previous_state(tmp_path):
    """A user file whose object refuses its content (here: a tensor of another shape for the EMA) is a
    refusal of that state, like a file that does not load: the resume falls back."""
    spec = _spec(tmp_path, 0, "train.epochs=1")
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 9, mode: raise}]"))
    older, newest = state_names(spec)[-2:]
    objects = _user_objects(spec, newest, 0)
    first = next(k for k in objects["ema"] if k.startswith("module."))
    objects["ema"][first] = torch.zeros(7, 7)
    from syncpoint.workers.data.stream_state import encode_tree

    rewrite_state_file(
        RunStorage(spec.run_url),
        newest,
        user_file(0),
        encode_tree({"objects": objects}, "user_state", user_state.LABEL),
    )
    assert run(spec).resumed_from == older
    decision = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "resume_decision"][-1]
    reasons = {c["state"]: c["reason"] for c in decision["candidates"]}
    assert "Task.stateful['ema'].load_state_dict() raised" in reasons[newest], reasons


@pytest.mark.slow
def test_the_digest_covers_every_ranks_user_state(tmp_path):
    spec = _spec(tmp_path / "run", 0, "train.epochs=1")
    run(spec)
    name = state_names(spec)[-1]
    copy = RunStorage(str(tmp_path / "copy"))
    shutil.copytree(RunStorage(spec.run_url).local_path("states", name), copy.local_path("states", name))
    objects = _user_objects(spec, name, 0)
    objects["scale"]["seen"]["micro_steps"] += 1
    from syncpoint.workers.data.stream_state import encode_tree

    rewrite_state_file(copy, name, user_file(0), encode_tree({"objects": objects}, "user_state", user_state.LABEL))
    assert state_digest(f"{copy.url}/states/{name}")["digest"] != digest(spec, name)


def test_load_task_checks_stateful():
    task = load_task("tests.tasks:linear_user_state", {"num_samples": 8})
    assert sorted(task.stateful) == ["ema", "scale"] and user_state.names(task.stateful) == ("ema", "scale")
