"""A state fits only the model that wrote it, buffers and dtypes included (issue 27.7).

* a buffer whose shape changed between attempts (``task.config``) is refused at selection, from
  the metadata, naming the buffer, before any tensor is read;
* a state that does not fit the live model although its metadata said nothing (written before
  buffers were recorded) fails its load and is called incompatible ("does not fit this model"),
  never corrupt, and the final refusal does not tell the user to fix or remove intact states;
  with the same model such a state still resumes;
* buffer names, shapes and dtypes and parameter dtypes, compared only where both sides record them.
"""

from __future__ import annotations

import json

import pytest
import torch

from syncpoint.policies.contracts.errors import NoResumableState, ResumeRefused
from syncpoint.policies.contracts.state_format import TrainState
from syncpoint.policies.decisions.candidates import LiveJob, Verdict, classify
from syncpoint.policies.decisions.compatibility import init_from_problem
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state import resume_negotiation
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.training.engine import model_buffers, parameter_dtypes
from tests.helpers import linear_spec, run, run_until_crash, trainer_json, with_overrides
from tests.meta import candidate_for, changed, live
from tests.tasks import RunningMean

STATS = "task.path=tests.tasks:linear_stats"


def _crashed(tmp_path):
    """10 micro-batches per epoch, accumulation 4: states at micro-steps 4, 8, 10; crash at 12."""
    spec = linear_spec(
        tmp_path,
        STATS,
        "task.config.num_samples=10",
        "train.grad_accum=4",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 12, mode: raise}]",
    )
    assert run_until_crash(spec)
    return spec


def _decision(spec) -> dict:
    return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "resume_decision"][-1]


def _fetches(monkeypatch) -> list[str]:
    """The states whose tensors this process fetched (the real fetch runs; its calls are counted)."""
    seen: list[str] = []
    real = resume_negotiation.fetch_state

    def counted(storage, candidate, *args, **kwargs):
        seen.append(candidate.name)
        return real(storage, candidate, *args, **kwargs)

    monkeypatch.setattr(resume_negotiation, "fetch_state", counted)
    return seen


def _as_written_before_buffers(spec, name: str) -> None:
    """Rewrite a state's trainer.json as syncpoint wrote it before buffers and dtypes were recorded,
    and re-commit the manifest with its checksum."""
    store = RunStorage(spec.run_url)
    t = trainer_json(spec, name)
    del t["model_buffers"], t["parameter_dtypes"]
    data = store.write_json(t, "states", name, "trainer.json")
    manifest = json.loads(store.read_bytes("states", name, "manifest.json", limit=1 << 30))
    manifest["files"]["trainer.json"] = {"size": len(data), "xxh3_128": checksum_bytes(data, "xxh3_128")}
    store.commit_bytes(json.dumps(manifest).encode(), "states", name, "manifest.json")


@pytest.mark.slow
def test_a_changed_buffer_shape_is_refused_at_selection_naming_it(tmp_path, monkeypatch):
    spec = _crashed(tmp_path)
    assert trainer_json(spec, "000000000010")["model_buffers"] == [
        {"name": "3.running_mean", "shape": [16], "dtype": "float32"}
    ]  # the non-persistent scratch buffer: not saved
    fetched = _fetches(monkeypatch)
    with pytest.raises(ResumeRefused) as refused:
        run(with_overrides(spec, "task.config.stats=32", "faults=[]"))
    decision = _decision(spec)
    assert decision["chosen"] is None and fetched == []  # decided from metadata: no tensor was read
    for c in decision["candidates"]:
        assert c["verdict"] == "incompatible"
        assert "buffer 3.running_mean: shape (16,) in the state, (32,) in this run" in c["reason"]
        assert "task.config" in c["reason"]
    assert "intact but do not fit this run" in str(refused.value) and "Fix or remove" not in str(refused.value)


@pytest.mark.slow
def test_a_load_that_does_not_fit_is_incompatible_not_corrupt(tmp_path, monkeypatch):
    spec = _crashed(tmp_path)
    _as_written_before_buffers(spec, "000000000010")  # selection cannot tell: its load must
    fetched = _fetches(monkeypatch)
    with pytest.raises(ResumeRefused) as refused:
        run(with_overrides(spec, "task.config.stats=32", "faults=[]"))
    assert fetched == ["000000000010"]  # the older states are refused from their metadata
    verdicts = {c["state"]: c for c in _decision(spec)["candidates"]}
    newest = verdicts["000000000010"]
    assert newest["verdict"] == "incompatible", newest
    assert newest["reason"].startswith("does not fit this model: ") and "3.running_mean" in newest["reason"]
    assert "restore the previous model" in newest["reason"] and "\n" not in newest["reason"]
    assert all(c["verdict"] == "incompatible" for c in verdicts.values())
    message = str(refused.value)
    assert "Fix or remove" not in message and "corrupt" not in message.split("\n", 1)[0]
    # the same model resumes the state written before the fields (the fingerprint alone is compared)
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == "000000000010"


def test_model_buffers_are_the_state_dicts_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), RunningMean(4)).double()
    assert [(b.name, tuple(b.shape), b.dtype) for b in model_buffers(model)] == [
        ("1.running_mean", (3,), "float64"),
        ("1.running_var", (3,), "float64"),
        ("1.num_batches_tracked", (), "int64"),
        ("2.running_mean", (4,), "float64"),
    ]
    model[0].bias.data = model[0].bias.data.float()
    dtypes = parameter_dtypes(model)
    assert (dtypes.common, dtypes.others) == ("float64", {"0.bias": "float32"})


_BUFFERS = (("bn.running_mean", (16,), "float32"), ("bn.num_batches_tracked", (), "int64"))
EXP = live(
    "j",
    1,
    1,
    4,
    10,
    0,
    "f",
    3,
    model_buffers=_BUFFERS,
    parameter_dtypes=("float32", ()),
)


@pytest.mark.parametrize(
    "job,reason",
    [
        (
            changed(EXP, model_buffers=(("bn.running_mean", (32,), "float32"), _BUFFERS[1])),
            "buffer bn.running_mean: shape (16,) in the state, (32,) in this run",
        ),
        (
            changed(EXP, model_buffers=(("bn.running_mean", (16,), "float64"), _BUFFERS[1])),
            "buffer bn.running_mean: dtype float32 in the state, float64 in this run",
        ),
        (
            changed(EXP, model_buffers=_BUFFERS[:1]),
            "buffer bn.num_batches_tracked: shape () int64 in the state, not in this run",
        ),
        (
            changed(EXP, model_buffers=(*_BUFFERS, ("pos", (8, 2), "float32"))),
            "buffer pos: not in the state, shape (8, 2) float32 in this run",
        ),
        (
            changed(EXP, parameter_dtypes=("float32", (("head.weight", "float64"),))),
            "parameter head.weight: dtype float32 in the state, float64 in this run",
        ),
        (changed(EXP, parameter_dtypes=("float64", ())), "parameters: dtype float32 in the state, float64"),
    ],
)
def test_buffers_and_dtypes_are_identity_named_at_selection(job, reason):
    c = classify(candidate_for(8, EXP), job)
    assert c.verdict is Verdict.INCOMPATIBLE and reason in c.reason, c.reason
    assert "differ (task)" in c.reason
    assert classify(candidate_for(8, EXP), EXP).verdict is Verdict.RESUMABLE
    # a state written before the fields, or a live run that does not know them: not compared
    legacy = candidate_for(8, changed(EXP, model_buffers=None, parameter_dtypes=None))
    assert classify(legacy, job).verdict is Verdict.RESUMABLE
    assert (
        classify(candidate_for(8, EXP), changed(job, model_buffers=None, parameter_dtypes=None)).verdict
        is Verdict.RESUMABLE
    )


def test_init_from_refuses_another_buffer_shape_not_another_dtype():
    c = candidate_for(8, EXP)
    other_shape = changed(EXP, model_buffers=(("bn.running_mean", (32,), "float32"), _BUFFERS[1]))
    assert "buffer bn.running_mean: shape (16,)" in (init_from_problem(c, other_shape, False) or "")
    other_dtype = changed(
        EXP,
        model_buffers=(("bn.running_mean", (16,), "bfloat16"), _BUFFERS[1]),
        parameter_dtypes=("bfloat16", ()),
    )
    assert init_from_problem(c, other_dtype, False) is None  # weights are taken cast
    back = LiveJob(TrainState.model_validate(c.trainer).identity())
    assert (back.identity.model_buffers, back.identity.parameter_dtypes) == (
        EXP.identity.model_buffers,
        EXP.identity.parameter_dtypes,
    )


def test_the_final_refusal_tells_intact_states_from_damaged_ones():
    incompatible = classify(candidate_for(8, changed(EXP, seed=4)), EXP)
    corrupt = classify(candidate_for(4, EXP, global_micro_step=5), EXP)
    assert (incompatible.verdict, corrupt.verdict) == (Verdict.INCOMPATIBLE, Verdict.CORRUPT)
    only_intact = str(NoResumableState([incompatible])).split("\n", 1)[0]
    assert "intact but do not fit this run" in only_intact and "Fix or remove" not in only_intact
    mixed = str(NoResumableState([incompatible, corrupt])).split("\n", 1)[0]
    assert "Fix or remove the damaged" in mixed
