"""RNGs outside the global streams (issue #27 items 3, 4, 12): generators the task owns, the job's
string-hash seed, and an RNG file that cannot be restored.

* The dataset's own ``np.random.default_rng`` is reseeded per sample from (seed, epoch, index) in
  whichever process fetches; the loss's own ``torch.Generator`` and NumPy generator are saved with
  the rank's RNG: a resumed run is the uninterrupted one, with or without DataLoader workers.
* Every rank runs with ``PYTHONHASHSEED`` derived from ``train.seed``, so code iterating a set of
  strings sees the same order in every attempt, whichever process launched it.
* An RNG file is parsed and tried at fetch: a bad one makes its state a refused candidate, and the
  run falls back to the previous state instead of failing after choosing it.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from syncpoint.policies.contracts.errors import StateRefused
from syncpoint.policies.decisions.candidates import Verdict, classify
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from syncpoint.workers.training import rng, task_rngs
from tests.helpers import (
    ROOT,
    committed_steps,
    digest,
    linear_spec,
    run,
    run_until_crash,
    state_names,
    step_history,
    with_overrides,
)
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run
from tests.meta import candidate_for, live

# ------------------------------------------------------------------ finding the task's generators

MODULE_RNG = np.random.default_rng(3)


class _Augment:
    __slots__ = ("gen",)

    def __init__(self) -> None:
        self.gen = random.Random(4)


class _Data:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.steps = [_Augment()]
        self.big = [np.random.default_rng(9)] * (task_rngs.MAX_CONTAINER + 1)  # data, not searched
        self.lookup = {"legacy": np.random.RandomState(5)}

    def __getitem__(self, i):
        return MODULE_RNG.random() + self.rng.random()


def test_the_walk_finds_generators_where_tasks_keep_them():
    g, n = torch.Generator().manual_seed(1), np.random.default_rng(2)

    def loss(model, batch):
        return torch.randn(1, generator=g) + n.random() + random.random()  # random.random: the global stream

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0]._noise = torch.Generator().manual_seed(9)  # a module's private attribute
    data = _Data()
    found = task_rngs.find(
        {"model": model, "loss": functools.partial(loss, 1), "dataset": data, "collate": data.__getitem__}
    )
    assert {p: task_rngs.kind(x) for p, x in found.generators.items()} == {
        "model.0._noise": "torch.Generator(cpu)",
        "loss.func.<locals>.g": "torch.Generator(cpu)",
        "loss.func.<locals>.n": "numpy.random.Generator(PCG64)",
        "dataset.rng": "numpy.random.Generator(PCG64)",
        "dataset.steps[0].gen": "random.Random",
        "dataset.lookup['legacy']": "numpy.random.RandomState(MT19937)",
        "dataset.<class _Data>.__getitem__.<globals>.MODULE_RNG": "numpy.random.Generator(PCG64)",
    }
    assert found.entropy == [] and found.stopped_at is None


def test_what_cannot_be_reproduced_is_named():
    import secrets

    data = _Data()
    data.os_entropy = random.SystemRandom()
    found = task_rngs.find({"dataset": data, "collate": secrets.token_bytes})
    assert found.entropy == ["collate", "dataset.os_entropy"]
    assert "dataset.os_entropy draws OS entropy" in found.warnings()[1]
    deep = task_rngs.find({"dataset": [[[[]]]] * 3}, max_objects=2)
    assert deep.stopped_at is not None and "stopped after" in deep.warnings()[0]


# ------------------------------------------------------------------ the RNG file


@pytest.fixture
def owned():
    gens = {
        "loss.<locals>.g": torch.Generator().manual_seed(1),
        "loss.<locals>.n": np.random.default_rng(2),
        "model.r": random.Random(3),
        "model.rs": np.random.RandomState(4),
    }
    rng.use_task_generators(gens)
    yield gens
    rng.use_task_generators({})


def _draws(gens) -> list[float]:
    out = [random.random(), float(np.random.random()), float(torch.rand(1))]
    for g in gens.values():
        out.append(float(torch.rand(1, generator=g)) if isinstance(g, torch.Generator) else float(g.random()))
    return out


def test_the_rng_file_holds_the_task_generators(owned):
    data = rng.capture()
    first = _draws(owned)
    rng.restore(rng.verify(data, "rng/rank_00000.safetensors"))
    assert _draws(owned) == first
    meta = json.loads(rng.safetensors_metadata(data)["rng"])[rng.TASK_META]
    assert [e["path"] for e in meta] == sorted(owned)
    assert any("$int" in json.dumps(e.get("state")) for e in meta)  # PCG64's 128-bit state: integers as strings


def _old_format_capture() -> bytes:
    """An RNG file as syncpoint wrote it before task generators were saved (its exact code)."""
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    tensors = {
        "python": torch.tensor(py_state, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "torch_cpu": torch.get_rng_state(),
    }
    meta = {
        "python_version": version,
        "python_gauss": gauss,
        "numpy_name": np_name,
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_cached_gaussian": float(np_cached),
        "cuda_devices": 0,
    }
    return st_save(tensors, metadata={"rng": json.dumps(meta)})


def test_an_old_rng_file_still_restores(owned):
    old = _old_format_capture()
    first = _draws({})
    task_state = [float(torch.rand(1, generator=owned["loss.<locals>.g"]))]
    saved = rng.verify(old, "rng/rank_00000.safetensors")
    assert saved.task is None
    rng.restore(saved)
    assert _draws({}) == first  # the global streams are back; the task's generators keep their state
    assert float(torch.rand(1, generator=owned["loss.<locals>.g"])) != task_state[0]


def _with_meta(data: bytes, edit) -> bytes:
    from safetensors.torch import load

    meta = json.loads(rng.safetensors_metadata(data)["rng"])
    return st_save(load(data), metadata={"rng": json.dumps(edit(meta))})


def _torch_state_torch_refuses(data: bytes) -> bytes:
    from safetensors.torch import load

    tensors = load(data)
    tensors["torch_cpu"] = torch.full_like(tensors["torch_cpu"], 255)
    return st_save(tensors, metadata=rng.safetensors_metadata(data))


BAD_FILES = {
    "not safetensors": (lambda d: b"\x10" + d[1:40], "header of"),
    "a torch state torch refuses": (_torch_state_torch_refuses, "cannot be restored"),
    "metadata without numpy_pos": (
        lambda d: _with_meta(d, lambda m: {k: v for k, v in m.items() if k != "numpy_pos"}),
        "numpy_pos",
    ),
    "a task generator missing": (
        lambda d: _with_meta(d, lambda m: {**m, rng.TASK_META: m[rng.TASK_META][1:]}),
        "holds no state for",
    ),
    "a task generator without its tensor": (
        lambda d: _with_meta(
            d,
            lambda m: {
                **m,
                rng.TASK_META: [
                    {**e, "kind": "random.Random"} if e["path"] == "model.rs" else e for e in m[rng.TASK_META]
                ],
            },
        ),
        "the task's generator model.rs: no tensor",
    ),
    "a task generator of another kind": (
        lambda d: _with_meta(
            d,
            lambda m: {
                **m,
                rng.TASK_META: [
                    {**e, "kind": "numpy.random.Generator(MT19937)"} if e["path"] == "model.rs" else e
                    for e in m[rng.TASK_META]
                ],
            },
        ),
        r"model.rs is a numpy.random.RandomState\(MT19937\), the file holds a numpy",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_rng_file_is_refused_at_verification_and_changes_nothing(owned, case):
    bad, reason = BAD_FILES[case]
    data = bad(rng.capture())
    before = rng.capture()
    with pytest.raises(StateRefused, match=reason):
        rng.verify(data, "rng/rank_00000.safetensors")
    assert rng.capture() == before  # the trial restore was put back


# ------------------------------------------------------------------ the job's string-hash seed


def test_the_hash_seed_is_stable_and_in_range():
    assert [rng.hash_seed(s) for s in (0, 3)] == [269508246, 1680402201]  # part of the resume contract
    assert all(0 <= rng.hash_seed(s) <= 2**32 - 1 for s in range(-50, 2000))
    assert len({rng.hash_seed(s) for s in range(2000)}) == 2000


def test_the_hash_seed_check_tells_a_pinned_interpreter_from_another():
    code = (
        "from syncpoint.workers.training.rng import hash_seed_problem; "
        "print(hash_seed_problem(7) is None, 'PYTHONHASHSEED=8' in (hash_seed_problem(8) or ''))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "7", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_ray_train_workers_start_with_the_jobs_hash_seed(tmp_path):
    from syncpoint.orchestrator.ray_runner import worker_runtime_env

    spec = linear_spec(tmp_path, "train.seed=3")
    assert worker_runtime_env(spec) == {"env_vars": {"PYTHONHASHSEED": "1680402201"}}


# ------------------------------------------------------------------ selection compares the generators


def test_a_state_whose_task_generators_differ_is_incompatible():

    exp = live("j", 1, 1, 4, 10, 0, "f", 3, task_generators=(("loss.<locals>.g", "torch.Generator(cpu)"),))
    assert classify(candidate_for(8, exp), exp).verdict == Verdict.RESUMABLE
    other = live("j", 1, 1, 4, 10, 0, "f", 3, task_generators=(("loss.<locals>.noise", "torch.Generator(cpu)"),))
    c = classify(candidate_for(8, exp), other)
    assert c.verdict == Verdict.INCOMPATIBLE and "loss.<locals>.g" in c.reason and "generators differ" in c.reason
    older = live("j", 1, 1, 4, 10, 0, "f", 3)  # a state written before the generators were recorded
    assert classify(candidate_for(8, older), other).verdict == Verdict.RESUMABLE


# ------------------------------------------------------------------ whole runs (DeepSpeed)


def _own(tmp, *extra):
    # 12 micro-batches per epoch, accumulation 2, 2 epochs; a state every optimizer step
    return linear_spec(
        tmp,
        "task.path=tests.rng_tasks:own_generators",
        "task.config.num_samples=12",
        "train.grad_accum=2",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *extra,
    )


@pytest.mark.slow
def test_task_owned_generators_resume_exactly(tmp_path):
    ref = _own(tmp_path / "ref")
    ref_final = run(ref).final_state
    spec = _own(tmp_path / "run", "faults=[{at_micro_step: 15, mode: raise}]")  # mid-cycle in the second epoch
    assert run_until_crash(spec)
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == f"{14:012d}"
    assert_same_run(ref, ref_final, spec, result.final_state)
    assert set(
        json.loads(RunStorage(spec.run_url).read_bytes("states", ref_final, "trainer.json", limit=1 << 30))[
            "task_generators"
        ]
    ) == {"loss.<locals>.noise", "loss.<locals>.scale"}


@pytest.mark.slow
def test_the_datasets_own_generator_is_the_same_with_and_without_loader_workers(tmp_path):
    zero = _own(tmp_path / "zero")
    two = _own(tmp_path / "two", "train.dataloader_workers=2")
    assert run_spawned(zero, world_size=1) == [0] and run_spawned(two, world_size=1) == [0]
    a, b = step_history(zero), step_history(two)
    assert [a[s].loss for s in sorted(a)] == [b[s].loss for s in sorted(b)]
    assert digest(zero, state_names(zero)[-1]) == digest(two, state_names(two)[-1])


@pytest.mark.slow
def test_an_evaluation_leaves_the_tasks_generators_to_training(tmp_path):
    """The eval set is scored with the task's loss, which draws from the task's generators: the
    evaluation saves them, seeds them from train.seed and puts them back, so training with
    evaluations is training without."""
    plain = _own(tmp_path / "plain")
    evaluated = _own(
        tmp_path / "eval", "task.config.eval_samples=5", "train.eval_every={value: 2, unit: optimizer_steps}"
    )
    run(plain), run(evaluated)
    a, b = step_history(plain), step_history(evaluated)
    assert [a[s].loss for s in sorted(a)] == [b[s].loss for s in sorted(b)]
    assert digest(plain, state_names(plain)[-1]) == digest(evaluated, state_names(evaluated)[-1])
    assert len(_eval_losses(evaluated)) == 6


def _eval_losses(spec) -> list[float]:
    return [e["metrics"]["loss"] for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "evaluated"]


HASH_ORDERED = [
    "task.path=tests.rng_tasks:hash_ordered",
    "task.config.num_samples=12",
    "train.grad_accum=2",
    "train.epochs=2",
    "checkpoint.save_every={value: 1, unit: optimizer_steps}",
]


def _in_own_process(storage, hash_seed: str, *overrides: str) -> int:
    """``run_spawned`` from a fresh interpreter started with ``hash_seed``: another launch, another
    machine. Returns the rank's exit code."""
    code = (
        "import sys; from tests.helpers import linear_spec; "
        "from syncpoint.workers.supervision.launch import run_spawned; "
        "spec = linear_spec(sys.argv[1], *sys.argv[2:]); sys.exit(run_spawned(spec, world_size=1)[0])"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    args = [str(storage), *HASH_ORDERED, *overrides]
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT, timeout=600).returncode


@pytest.mark.slow
def test_a_set_of_strings_keeps_its_order_across_launches(tmp_path):
    """The crashed attempt starts from an interpreter with another hash seed than this one, which runs
    the reference and the resume; every rank runs with the job's, so the set's order, and so the data,
    is the same."""
    other = "2" if os.environ.get("PYTHONHASHSEED") != "2" else "3"
    ref, spec = linear_spec(tmp_path / "ref", *HASH_ORDERED), linear_spec(tmp_path / "run", *HASH_ORDERED)
    assert run_spawned(ref, world_size=1) == [0]
    assert _in_own_process(tmp_path / "run", other, "faults=[{at_micro_step: 15, mode: exit}]") == 17
    assert run_spawned(spec, world_size=1) == [0]
    assert_same_run(ref, state_names(ref)[-1], spec, state_names(spec)[-1])


# ------------------------------------------------------------------ a bad RNG file falls back


def _recommit_file(store: RunStorage, name: str, rel: str, data: bytes) -> None:
    """Replace one file of a committed state and re-commit the manifest to match (a buggy writer,
    or anyone with storage access): only a check of the file's content can tell."""
    from syncpoint.workers.integrity.checksum import checksum_bytes

    store.write_bytes(data, "states", name, rel)
    manifest = json.loads(store.read_bytes("states", name, "manifest.json", limit=1 << 30))
    manifest["files"][rel] = {"size": len(data), "xxh3_128": checksum_bytes(data, "xxh3_128")}
    store.commit_bytes(json.dumps(manifest).encode(), "states", name, "manifest.json")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["not safetensors", "a torch state torch refuses", "metadata without numpy_pos"])
def test_a_bad_rng_file_in_the_newest_state_falls_back_to_the_previous(tmp_path, case):
    spec = _own(tmp_path / "run", "faults=[{at_micro_step: 15, mode: raise}]")
    assert run_until_crash(spec) and committed_steps(spec)[-2:] == [12, 14]
    store, newest, rel = RunStorage(spec.run_url), f"{14:012d}", "rng/rank_00000.safetensors"
    _recommit_file(store, newest, rel, BAD_FILES[case][0](store.read_bytes("states", newest, rel, limit=1 << 30)))
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == f"{12:012d}"
    decision = [e for e in EventLog(store).read_all() if e["kind"] == "resume_decision"][-1]
    reasons = {c["state"]: c["reason"] for c in decision["candidates"]}
    assert reasons[newest].startswith("verification failed: ") and rel in reasons[newest], reasons
    assert BAD_FILES[case][1] in reasons[newest], reasons
    ref = _own(tmp_path / "ref")
    assert digest(spec, result.final_state) == digest(ref, run(ref).final_state)


@pytest.mark.slow
def test_a_schedule_record_without_a_position_resumes_with_the_schedule_restarted(tmp_path, capsys):
    """``scheduler.position: null`` is "not recorded" to selection (the state format's model), so the
    resume after choosing it must read it so too, not fail on it."""
    spec = _own(tmp_path, "faults=[{at_micro_step: 15, mode: raise}]")
    assert run_until_crash(spec)
    store, newest = RunStorage(spec.run_url), f"{14:012d}"
    trainer = json.loads(store.read_bytes("states", newest, "trainer.json", limit=1 << 30))
    trainer["scheduler"]["position"] = None
    _recommit_file(store, newest, "trainer.json", json.dumps(trainer).encode())
    capsys.readouterr()
    assert run(with_overrides(spec, "faults=[]")).resumed_from == newest
    assert "records no LR-schedule position" in capsys.readouterr().err
