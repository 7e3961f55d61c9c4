"""A 10^9-sample epoch resumed 10^8 samples in (``tests.virtual_tasks``: sample i computed from i).

What "deep inside an epoch" means here: the run trains through the first 10^8 samples of a 10^9-sample
epoch (micro-batches of 2^20 samples, the largest ``train.micro_batch_size``; 96 of the epoch's 953),
writes its state there, crashes, and resumes from that state. So the resumed attempt's position is
a real one the loop wrote (``samples_in_epoch`` just over 10^8 of ``samples_per_epoch`` 953 x 2^20),
its loader starts 96 micro-batches into a per-position permutation of 10^9 samples, and the run
must still be the uninterrupted one, step for step. Depth beyond that costs this machine only
training time (each micro-batch costs the same to resume at, bench P11 (a) and (c)); half-way into
the epoch would be 4 minutes of training per run here. This test runs the path 2.1 x 10^6 samples
in (2 micro-batches: the same loader, permutation and position arithmetic, a fiftieth of the
training); ``make test-all`` walks it 10^8 samples in, on Ray, three times in one run (a crash, a
notice and a lost node: tests/drills/ray/test_virtual_corpus.py).
"""

from __future__ import annotations

import pytest

from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
from syncpoint.policies.contracts.state_format import SAMPLER_VERSION
from tests.helpers import digest, run, run_until_crash, step_history, trainer_json, with_overrides
from tests.integration.workers.training.test_loop_exact_resume import module_params
from tests.virtual_tasks import SAMPLES

pytestmark = pytest.mark.slow
MICRO_BATCH = 1 << 20
SPEC = """
name: virtual
task: {path: tests.virtual_tasks:build, config: {dropout: 0.1}}
train: {micro_batch_size: 1048576, grad_accum: 2, seed: 5, lr: 0.01, log_every: 1000,
        optimizer: {type: adamw, weight_decay: 0.01}}
deepspeed: {zero_stage: 0}
checkpoint: {keep_last: 0, export_final: false}
"""
# (optimizer steps in all, a save every this many, the micro-step that crashes): the crash falls one
# micro-step after the last save, mid-cycle, so the resume starts at that save's micro-step
DEPTHS = [pytest.param((2, 1, 3), id="2.1e6-samples-in")]


def _spec(storage, *overrides):
    return resolve_storage(parse_spec(SPEC, "virtual", [f"storage={storage}", "scaling.num_workers=1", *overrides]))


@pytest.mark.parametrize("depth", DEPTHS)
def test_a_1e9_sample_epoch_resumed_deep_inside_is_the_uninterrupted_run(tmp_path, depth):
    steps, every, crash_at = depth
    saved_at = crash_at - 1
    plan = (f"train.max_steps={steps}", f"checkpoint.save_every={{value: {every}, unit: optimizer_steps}}")
    ref = _spec(tmp_path / "ref", *plan)
    ref_final = run(ref).final_state
    assert ref_final == f"{2 * steps:012d}"

    spec = _spec(tmp_path / "run", *plan, f"faults=[{{at_micro_step: {crash_at}, mode: raise}}]")
    assert run_until_crash(spec)
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == f"{saved_at:012d}"
    deep = trainer_json(spec, result.resumed_from)
    assert (deep["epoch"], deep["position_in_epoch"]) == (0, saved_at)
    data = deep["data"]
    assert data["samples_in_epoch"] == saved_at * MICRO_BATCH > 10**6 and data["num_samples"] == SAMPLES
    assert data["samples_per_epoch"] == (SAMPLES // MICRO_BATCH) * MICRO_BATCH and data["sampler"] == SAMPLER_VERSION

    assert result.final_state == ref_final
    a, b = step_history(ref), step_history(spec)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert b[step].loss == a[step].loss, f"loss differs at optimizer step {step}"
    assert digest(spec, ref_final) == digest(ref, ref_final)
    ref_params, params = module_params(ref, ref_final), module_params(spec, ref_final)
    assert all((ref_params[k] == params[k]).all() for k in ref_params)
