"""Resume equivalence: interrupted-and-resumed runs equal the uninterrupted run, tensor for tensor.

Single-rank grid (fast, in-process) over epoch lengths, accumulation, save intervals, ZeRO stages
and interruption points (at a boundary, just after one, mid-cycle, at the epoch end, inside the
short last cycle); plus a 2-rank grid over ZeRO 0/1/2 with hard crashes in spawned processes.
"""

from __future__ import annotations

import pytest
import torch

from syncpoint.workers.integrity.digest import load_deepspeed_file
from syncpoint.workers.state.export import zero3_state_from_storage
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import digest, lm_spec, run, run_until_crash, state_names, step_history, trainer_json

# (micro-batches per epoch, accumulation, save_every) -> interruption points (crash after micro-step k)
GRID = {
    (10, 4, "{value: 3, unit: micro_steps}"): [7, 8, 9, 10, 13, 19],
    (7, 3, "{value: 2, unit: optimizer_steps}"): [3, 5, 7, 11],
    (8, 2, "{value: 5, unit: micro_steps}"): [4, 6, 8, 15],
}
REFERENCES: dict = {}


def _spec(tmp, mbpe, accum, save_every, zero, *extra, workers=1):
    return lm_spec(
        tmp,
        f"task.config.num_samples={mbpe * 2 * workers}",
        f"train.grad_accum={accum}",
        "train.epochs=2",
        f"checkpoint.save_every={save_every}",
        f"deepspeed.zero_stage={zero}",
        *extra,
        workers=workers,
    )


def module_params(spec, name):
    """The whole model of a state: DeepSpeed's module file, or at ZeRO-3 (no rank holds the module
    whole) the parameters gathered from every rank's partition, as the final export does."""
    files = RunStorage(spec.run_url)
    if not files.exists("states", name, "engine/mp_rank_00_model_states.pt"):
        return zero3_state_from_storage(files, name)
    data = files.read_bytes("states", name, "engine/mp_rank_00_model_states.pt", limit=1 << 30)
    return load_deepspeed_file(data)["module"]


def _reference(tmp_path_factory, mbpe, accum, save_every, zero):
    key = (mbpe, accum, save_every, zero)
    if key not in REFERENCES:
        spec = _spec(tmp_path_factory.mktemp("ref"), mbpe, accum, save_every, zero)
        result = run(spec)
        REFERENCES[key] = (spec, result.final_state)
    return REFERENCES[key]


def assert_same_run(ref_spec, ref_final, spec, final):
    assert final == ref_final
    ref_hist, hist = step_history(ref_spec), step_history(spec)
    assert sorted(hist) == sorted(ref_hist)
    for step, rec in ref_hist.items():
        assert hist[step].loss == rec.loss, f"loss differs at optimizer step {step}"
        assert hist[step].lr == rec.lr, f"lr differs at optimizer step {step}"
    a, b = module_params(ref_spec, ref_final), module_params(spec, final)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"
    assert digest(spec, final) == digest(ref_spec, ref_final)


CASES = [(mbpe, acc, se, k, zero) for (mbpe, acc, se), ks in GRID.items() for k in ks for zero in (0, 2)]
CASES += [(10, 4, "{value: 3, unit: micro_steps}", 9, 1), (7, 3, "{value: 2, unit: optimizer_steps}", 5, 1)]
# ZeRO-3 (about a minute per case here: slow)
CASES += [
    pytest.param(10, 4, "{value: 3, unit: micro_steps}", 13, 3, marks=pytest.mark.slow),
    pytest.param(7, 3, "{value: 2, unit: optimizer_steps}", 11, 3, marks=pytest.mark.slow),
]
ASYNC_CASES = [(10, 4, "{value: 1, unit: optimizer_steps}", k, z) for k, z in ((7, 2), (9, 0), (13, 1), (19, 2))]
ASYNC_CASES += [pytest.param(10, 4, "{value: 1, unit: optimizer_steps}", 9, 3, marks=pytest.mark.slow)]


@pytest.mark.parametrize("mbpe,accum,save_every,crash_at,zero", CASES)
def test_single_rank_resume_equals_uninterrupted(tmp_path, tmp_path_factory, mbpe, accum, save_every, crash_at, zero):
    ref_spec, ref_final = _reference(tmp_path_factory, mbpe, accum, save_every, zero)
    spec = _spec(tmp_path, mbpe, accum, save_every, zero, f"faults=[{{at_micro_step: {crash_at}, mode: raise}}]")
    assert run_until_crash(spec)
    for name in state_names(spec):  # only boundaries were ever written
        t = trainer_json(spec, name)
        pos, mb = t["position_in_epoch"], t["micro_batches_per_epoch"]
        assert pos % accum == 0 or pos == mb
    result = run(spec)
    assert_same_run(ref_spec, ref_final, spec, result.final_state)


@pytest.mark.parametrize("mbpe,accum,save_every,crash_at,zero", ASYNC_CASES)
def test_async_saves_resume_equals_uninterrupted(tmp_path, tmp_path_factory, mbpe, accum, save_every, crash_at, zero):
    """checkpoint.async: the same states, committed later; resume stays exact (the reference is sync)."""
    ref_spec, ref_final = _reference(tmp_path_factory, mbpe, accum, save_every, zero)
    spec = _spec(
        tmp_path,
        mbpe,
        accum,
        save_every,
        zero,
        "checkpoint.async=true",
        f"faults=[{{at_micro_step: {crash_at}, mode: raise}}]",
    )
    assert run_until_crash(spec)
    result = run(spec)
    assert_same_run(ref_spec, ref_final, spec, result.final_state)


def test_resume_after_crash_twice_with_dataloader_workers(tmp_path, tmp_path_factory):
    """Two interruptions, and DataLoader worker processes: still the same run. The runs are spawned
    ranks: forking loader workers from a test process grown over hundreds of in-process runs failed
    with ENOMEM here (the kernel's overcommit heuristics), as
    tests/integration/workers/training/test_loop_resume_holes.py's collate test did."""
    extra = ("train.dataloader_workers=2",)
    ref = _spec(tmp_path_factory.mktemp("refw"), 10, 4, "{value: 3, unit: micro_steps}", 2, *extra)
    assert run_spawned(ref, world_size=1) == [0]
    spec = _spec(
        tmp_path,
        10,
        4,
        "{value: 3, unit: micro_steps}",
        2,
        *extra,
        "faults=[{at_micro_step: 6, mode: exit}, {at_micro_step: 15, mode: exit}]",
    )
    assert run_spawned(spec, world_size=1) == [17]  # a hard crash at 6
    assert run_spawned(spec, world_size=1) == [17]  # and at 15
    assert run_spawned(spec, world_size=1) == [0]
    assert_same_run(ref, state_names(ref)[-1], spec, state_names(spec)[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero",
    [
        pytest.param(0, marks=pytest.mark.long),
        pytest.param(1, marks=pytest.mark.long),
        2,
        pytest.param(3, marks=pytest.mark.long),
    ],
)  # ZeRO-3 two-rank: tests/integration/workers/training/test_engine_zero3.py
def test_two_ranks_hard_crash_resume_equals_uninterrupted(tmp_path, zero):
    ref = _spec(tmp_path / "ref", 10, 4, "{value: 3, unit: micro_steps}", zero, workers=2)
    assert run_spawned(ref) == [0, 0]
    ref_final = max(state_names(ref))
    # rank 1 dies hard (os._exit) mid-cycle at micro-step 13
    spec = _spec(
        tmp_path / "run",
        10,
        4,
        "{value: 3, unit: micro_steps}",
        zero,
        "faults=[{rank: 1, at_micro_step: 13}]",
        workers=2,
    )
    codes = run_spawned(spec)
    assert codes[1] == 17
    assert max(state_names(spec)) < ref_final
    assert run_spawned(spec) == [0, 0]
    assert_same_run(ref, ref_final, spec, max(state_names(spec)))


@pytest.mark.parametrize("zero,crash_at", [(0, 9), (2, 9), (2, 13), (3, 13)])
def test_bf16_resume_equals_uninterrupted(tmp_path, tmp_path_factory, zero, crash_at):
    """bf16 on CPU (the CUDA run is tests/integration/workers/training/test_device_gpu.py): bf16 weights, fp32 master
    weights and
    moments (ZeRO-2 keeps them in bf16_zero_pp_rank_* files, which the digest must cover) all resume exactly."""
    save = "{value: 3, unit: micro_steps}"
    ref = _spec(tmp_path_factory.mktemp("bf16"), 10, 4, save, zero, "deepspeed.precision=bf16")
    ref_final = run(ref).final_state
    spec = _spec(
        tmp_path, 10, 4, save, zero, "deepspeed.precision=bf16", f"faults=[{{at_micro_step: {crash_at}, mode: raise}}]"
    )
    assert run_until_crash(spec)
    result = run(spec)
    assert all(t.dtype == torch.bfloat16 for t in module_params(spec, result.final_state).values())
    assert_same_run(ref, ref_final, spec, result.final_state)
