"""Every rank's module buffers resume exactly: BatchNorm running statistics and a buffer the forward reads.

DeepSpeed never syncs buffers after the engine is built, so each rank's follow its own samples,
and its ZeRO 0-2 module file holds rank 0's alone. The task here (``tests.tasks:buffer_net``) has a
BatchNorm (persistent buffers, read by evaluation) and a running mean the training forward
subtracts (non-persistent): a rank resumed with another rank's buffers computes other losses.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from syncpoint.policies.contracts.errors import StateMismatch, StateRefused
from syncpoint.policies.contracts.state_format import TrainState, buffers_file, json_bytes, required_files
from syncpoint.policies.decisions.candidates import Verdict, classify
from syncpoint.workers.integrity.digest import state_digest
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from syncpoint.workers.training import buffers
from tests.helpers import linear_spec, rewrite_state_file, run, run_until_crash, state_names, trainer_json
from tests.integration.workers.training.test_loop_exact_resume import module_params
from tests.meta import candidate_for, live
from tests.tasks import BufferNet

EXP = live("j", 2, 4, 4, 10, 2, "f", 1, precision="fp32", optimizer_type="adamw")


def _spec(tmp, zero, *extra, workers=2):
    return linear_spec(
        tmp,
        "task.path=tests.tasks:buffer_net",
        "task.config={num_samples: 32}",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.epochs=2",
        "checkpoint.save_every={value: 3, unit: micro_steps}",
        f"deepspeed.zero_stage={zero}",
        *extra,
        workers=workers,
    )


def rank_buffers(spec, name: str, rank: int) -> dict[str, torch.Tensor]:
    return st_load(RunStorage(spec.run_url).read_bytes("states", name, buffers_file(rank), limit=1 << 30))


def test_a_state_with_per_rank_buffers_needs_every_ranks_file():
    assert required_files(
        world_size=2, zero_stage=0, precision=None, full_optimizer_state=False, per_rank_buffers=True
    )[-2:] == ["buffers/rank_00000.safetensors", "buffers/rank_00001.safetensors"]
    older = candidate_for(8, EXP)  # written before the field: no buffers files, resumes as it did
    assert not TrainState.model_validate(older.trainer).per_rank_buffers
    assert classify(older, EXP).verdict is Verdict.RESUMABLE, older.reason
    c = candidate_for(8, EXP, per_rank_buffers=True)
    assert classify(c, EXP).verdict is Verdict.RESUMABLE, c.reason
    c = candidate_for(8, EXP, per_rank_buffers=True)  # its records are parsed once: edit a new one
    del c.manifest["files"][buffers_file(EXP.identity.world_size - 1)]
    c = classify(c, EXP)
    assert c.verdict is Verdict.CORRUPT and buffers_file(EXP.identity.world_size - 1) in c.reason


def test_a_buffers_file_is_read_only_if_it_holds_exactly_the_models_buffers():
    model = BufferNet(4, None)
    saved = buffers.read(buffers.capture(model), "buffers/rank_00000.safetensors", model)
    assert set(saved) == {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked", "body.2.center"}
    with pytest.raises(StateRefused, match="not a safetensors file.*corrupt"):
        buffers.read(b"\xff" * 16, "buffers/rank_00000.safetensors", model)
    wrong_shape = dict(saved, **{"body.2.center": torch.zeros(3)})
    with pytest.raises(StateMismatch, match=r"buffer body.2.center is torch.float32 \(3,\).*other buffers"):
        buffers.read(st_save(wrong_shape), "buffers/rank_00000.safetensors", model)
    without = {k: v for k, v in saved.items() if k != "body.2.center"}
    with pytest.raises(StateMismatch, match=r"missing \['body.2.center'\]"):
        buffers.read(st_save(without), "buffers/rank_00000.safetensors", model)
    assert [buffers.source_rank(r, 2) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [buffers.source_rank(r, 4) for r in range(2)] == [0, 1]


@pytest.mark.slow
def test_a_buffers_file_that_does_not_fit_is_refused_and_the_resume_falls_back(tmp_path):
    spec = _spec(tmp_path, 0, "faults=[{at_micro_step: 9, mode: raise}]", workers=1)
    assert run_until_crash(spec)
    older, newest = state_names(spec)[-2:]
    store = RunStorage(spec.run_url)
    bad = dict(rank_buffers(spec, newest, 0), **{"body.2.center": torch.zeros(3)})
    rewrite_state_file(store, newest, buffers_file(0), st_save(bad))
    assert run(spec).resumed_from == older
    decision = [e for e in EventLog(store).read_all() if e["kind"] == "resume_decision"][-1]
    reasons = {c["state"]: c["reason"] for c in decision["candidates"]}
    assert "buffer body.2.center is torch.float32 (3,)" in reasons[newest], reasons
    verdicts = {c["state"]: c["verdict"] for c in decision["candidates"]}
    assert verdicts[newest] == "incompatible" and "does not fit this model" in reasons[newest]  # intact, not corrupt


@pytest.mark.slow
def test_a_state_written_before_per_rank_buffers_still_resumes(tmp_path):
    """No ``per_rank_buffers`` in trainer.json, no buffers/ files: resumed as such states always were."""
    spec = _spec(tmp_path, 0, "faults=[{at_micro_step: 9, mode: raise}]", workers=1)
    assert run_until_crash(spec)
    newest = state_names(spec)[-1]
    store = RunStorage(spec.run_url)
    manifest = json.loads(store.read_bytes("states", newest, "manifest.json", limit=1 << 30))
    del manifest["files"][buffers_file(0)]
    store.remove("states", newest, buffers_file(0))
    store.commit_bytes(json_bytes(manifest), "states", newest, "manifest.json")
    older = trainer_json(spec, newest)
    del older["per_rank_buffers"]
    rewrite_state_file(store, newest, "trainer.json", json_bytes(older))
    assert run(spec).resumed_from == newest


def _edited_digest(spec, name: str, tmp) -> dict[str, str]:
    """The digest of a copy of the state in which only rank 1's buffers differ."""
    copy = RunStorage(str(tmp))
    shutil.copytree(RunStorage(spec.run_url).local_path("states", name), copy.local_path("states", name))
    edited = rank_buffers(spec, name, 1)
    edited["body.1.running_mean"] = edited["body.1.running_mean"] + 1
    rewrite_state_file(copy, name, buffers_file(1), st_save(edited))
    return state_digest(f"{copy.url}/states/{name}")


@pytest.mark.slow
@pytest.mark.parametrize("zero,saving", [(0, "sync"), (1, "sync"), (2, "sync"), (2, "async"), (3, "sync")])
def test_every_ranks_buffers_resume_exactly(tmp_path, zero, saving):
    """Crashed mid-run and resumed: every rank's buffers, and so the parameters, are the uninterrupted
    run's, bit for bit (``async``: the resumed state's snapshot was uploaded in the background)."""
    ref = _spec(tmp_path / "ref", zero)
    assert run_spawned(ref) == [0, 0]
    final = state_names(ref)[-1]
    mine = [rank_buffers(ref, final, r) for r in (0, 1)]
    assert not torch.equal(mine[0]["body.2.center"], mine[1]["body.2.center"])  # the premise: per-rank buffers
    assert not torch.equal(mine[0]["body.1.running_mean"], mine[1]["body.1.running_mean"])
    spec = _spec(
        tmp_path / "run",
        zero,
        f"checkpoint.async={saving == 'async'}".lower(),
        "faults=[{at_micro_step: 9, mode: exit}]",
    )
    assert run_spawned(spec)[0] == 17
    assert max(state_names(spec)) < final
    assert run_spawned(spec) == [0, 0]
    assert state_names(spec)[-1] == final and trainer_json(spec, final)["per_rank_buffers"] is True
    a, b = module_params(ref, final), module_params(spec, final)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
    for r in (0, 1):
        resumed = rank_buffers(spec, final, r)
        assert resumed.keys() == mine[r].keys()
        for k in resumed:
            assert torch.equal(resumed[k], mine[r][k]), f"rank {r}'s buffer {k} differs"
    digest = state_digest(f"{spec.run_url}/states/{final}")
    assert digest == state_digest(f"{ref.run_url}/states/{final}")
    edited = _edited_digest(spec, final, tmp_path / "edited")
    assert edited["digest"] != digest["digest"] and edited["buffers"] != digest["buffers"]
    assert {k: v for k, v in edited.items() if k not in ("digest", "buffers")} == {
        k: v for k, v in digest.items() if k not in ("digest", "buffers")
    }


@pytest.mark.slow
def test_a_rank_added_by_an_elastic_resume_takes_the_buffers_of_saved_rank_0(tmp_path):
    """1 -> 2 workers: rank r applies saved rank r mod 1's buffers (syncpoint.workers.training.buffers.source_rank)."""
    dump = tmp_path / "dump"
    dump.mkdir()
    spec = _spec(
        tmp_path / "run",
        0,
        "scaling.num_workers={min: 1, max: 2}",
        "faults=[{at_micro_step: 11}]",
        f"task.config={{num_samples: 32, dump: {dump}}}",
    )
    assert run_spawned(spec, world_size=1) == [17]
    saved = rank_buffers(spec, state_names(spec)[-1], 0)
    assert saved["body.2.center"].abs().sum() > 0  # trained: not what a fresh model starts from
    assert run_spawned(spec) == [0, 0]
    assert trainer_json(spec, state_names(spec)[-1])["world_size"] == 2
    for r in (0, 1):
        started = st_load((dump / f"rank_{r}.safetensors").read_bytes())
        assert started.keys() == saved.keys()
        for k in saved:
            assert torch.equal(started[k], saved[k]), f"rank {r} started from another {k}"
