"""Exact resume on CUDA: bf16, ZeRO-2, NCCL: the configuration real users run.

Skipped without a CUDA device. Run on a GPU machine with ``make test-gpu`` (DeepSpeed's accelerator
is chosen at import, so the run sets ``DS_ACCELERATOR=cuda`` for the whole process). One GPU means
world size 1: NCCL, ZeRO-2's partitioned optimizer and bf16 master weights are all exercised; the
multi-rank partitioning is covered on CPU (gloo) by the two-rank tests.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load as st_load

from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import gpt2_spec, lm_spec, run, run_until_crash, state_names, trainer_json
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("DS_ACCELERATOR") != "cuda",
        reason="DeepSpeed's accelerator is chosen at import: run with DS_ACCELERATOR=cuda (make test-gpu)",
    ),
]

SAVE = "{value: 3, unit: micro_steps}"
# A model big enough that cuBLAS picks real GPU kernels (not the tiny-shape paths).
WIDE = ("task.config.d_model=256", "task.config.n_layers=2", "task.config.seq_len=64")
REFERENCES: dict = {}


def _spec(tmp, zero: int, precision: str, *extra: str, mbpe: int = 10, accum: int = 4):
    return lm_spec(
        tmp,
        "scaling.use_gpu=true",
        f"task.config.num_samples={mbpe * 2}",
        f"train.grad_accum={accum}",
        "train.epochs=2",
        f"checkpoint.save_every={SAVE}",
        f"deepspeed.zero_stage={zero}",
        f"deepspeed.precision={precision}",
        *extra,
    )


def _reference(factory, zero: int, precision: str, *extra: str):
    key = (zero, precision, extra)
    if key not in REFERENCES:
        spec = _spec(factory.mktemp("ref"), zero, precision, *extra)
        REFERENCES[key] = (spec, run(spec).final_state)
    return REFERENCES[key]


CASES = [(2, "bf16", k, ()) for k in (7, 8, 9, 13, 19)]
CASES += [
    (2, "bf16", 9, WIDE),
    (2, "bf16", 13, ("checkpoint.async=true",)),
    (0, "bf16", 9, ()),
    (2, "fp16", 9, ()),
    (2, "fp32", 9, ()),
]


@pytest.mark.parametrize("zero,precision,crash_at,extra", CASES)
def test_gpu_resume_equals_uninterrupted(tmp_path, tmp_path_factory, zero, precision, crash_at, extra):
    ref_spec, ref_final = _reference(tmp_path_factory, zero, precision, *extra)
    spec = _spec(tmp_path, zero, precision, *extra, f"faults=[{{at_micro_step: {crash_at}, mode: raise}}]")
    assert run_until_crash(spec)
    result = run(spec)
    assert result.resumed_from is not None
    assert_same_run(ref_spec, ref_final, spec, result.final_state)


def test_gpu_state_holds_cuda_rng_and_precision(tmp_path):
    spec = _spec(tmp_path, 2, "bf16", "train.max_steps=2")
    final = run(spec).final_state
    assert trainer_json(spec, final)["precision"] == "bf16"
    rng = st_load(RunStorage(spec.run_url).read_bytes("states", final, "rng", "rank_00000.safetensors", limit=1 << 30))
    assert "cuda_0" in rng and rng["cuda_0"].numel() > 0
    files = json.loads(RunStorage(spec.run_url).read_bytes("states", final, "manifest.json", limit=MANIFEST_MAX_BYTES))[
        "files"
    ]
    assert any("zero_pp_rank_0" in f for f in files), "ZeRO-2 bf16 optimizer shard missing from the manifest"


def test_gpu_spawned_hard_crash_resume(tmp_path):
    """The spawned launcher (NCCL group in a child process), a hard exit mid-cycle, then resume."""
    ref = _spec(tmp_path / "ref", 2, "bf16")
    assert run_spawned(ref, 1) == [0]
    ref_final = max(state_names(ref))
    spec = _spec(tmp_path / "run", 2, "bf16", "faults=[{at_micro_step: 13}]")
    assert run_spawned(spec, 1) == [17]
    assert run_spawned(spec, 1) == [0]
    assert_same_run(ref, ref_final, spec, max(state_names(spec)))


@pytest.mark.parametrize("zero", [2, 3])
def test_gpu_hf_gpt2_bf16_resume_equals_uninterrupted(tmp_path, zero):
    """The Hugging Face GPT-2 example (dropout, activation checkpointing: the recompute restores the
    CUDA RNG state too) in bf16 on the GPU, a crash mid-cycle in the second epoch, then resume."""
    pytest.importorskip("transformers")
    extra = (
        "scaling.use_gpu=true",
        "deepspeed.precision=bf16",
        f"deepspeed.zero_stage={zero}",
        "task.config.num_samples=24",
        "checkpoint.save_every={value: 2, unit: optimizer_steps}",
    )
    ref = gpt2_spec(tmp_path / "ref", *extra)
    ref_final = run(ref).final_state
    spec = gpt2_spec(tmp_path / "run", *extra, "faults=[{at_micro_step: 19, mode: raise}]")
    assert run_until_crash(spec)
    result = run(spec)
    assert result.resumed_from == f"{16:012d}"
    assert_same_run(ref, ref_final, spec, result.final_state)
