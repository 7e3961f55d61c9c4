"""``syncpoint.load_model``: a finished run's model back as the task's own module, with the weights
the run ended with, in a process that imports neither Ray nor DeepSpeed; a ``final/`` that is
missing, older, edited, hostile or no longer fits the task's model is refused naming why. The
Hugging Face example's ``final/`` is tests/integration/workers/state/test_pretrained.py's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import syncpoint
from examples.tiny_lm import VOCAB, TinyLM
from syncpoint.policies.contracts.errors import ModelLoadError
from tests.helpers import ROOT, lm_spec, run
from tests.integration.workers.training.test_loop_exact_resume import module_params

RUNS: dict = {}


def _finished(tmp_path_factory):
    """One finished run of the tiny example with its final/ (shared: the checks only read it or a copy)."""
    if "tiny" not in RUNS:
        storage = tmp_path_factory.mktemp("load-model")
        spec = lm_spec(
            storage,
            "checkpoint.export_final=true",
            "task.config.num_samples=16",
            "task.config.d_model=24",
            "train.epochs=1",
            "train.eval_every=0",
        )
        RUNS["tiny"] = (spec, run(spec).final_state, str(storage / spec.name))
    return RUNS["tiny"]


def test_a_plain_torch_tasks_model_loads_back_with_its_trained_weights(tmp_path_factory):
    spec, final, run_dir = _finished(tmp_path_factory)
    before = torch.get_rng_state()
    model = syncpoint.load_model(spec.run_url)
    assert torch.equal(torch.get_rng_state(), before)  # the task's initialisation drew from a forked stream
    assert type(model) is TinyLM and not model.training and model.embed.embedding_dim == 24
    trained = module_params(spec, final)
    state = model.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in state)
    again = syncpoint.load_model(os.path.join(run_dir, "final"))  # final/ itself, by its local path
    assert all(torch.equal(again.state_dict()[k], state[k]) for k in state)
    assert model(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, VOCAB)
    with open(os.path.join(run_dir, "final", "info.json")) as f:
        info = json.load(f)
    assert info["task"] == "examples.tiny_lm:build" and info["task_config"]["d_model"] == 24


def test_load_model_needs_neither_ray_nor_deepspeed(tmp_path_factory):
    _, _, run_dir = _finished(tmp_path_factory)
    probe = (
        "import sys, syncpoint; m = syncpoint.load_model(sys.argv[1]); "
        "print(type(m).__name__, [k for k in ('ray', 'deepspeed') if k in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe, run_dir], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["TinyLM", "[]"]


def _copy(run_dir: str, tmp_path) -> str:
    final = str(tmp_path / "final")
    shutil.copytree(os.path.join(run_dir, "final"), final)
    return final


def _edit(path: str, change) -> None:
    with open(path) as f:
        value = json.load(f)
    change(value)
    with open(path, "w") as f:
        json.dump(value, f)


def _refused(path: str, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        syncpoint.load_model(path)


def test_a_final_dir_that_is_missing_older_edited_or_hostile_is_refused_naming_why(tmp_path_factory, tmp_path):
    _, _, run_dir = _finished(tmp_path_factory)
    _refused(str(tmp_path), r"neither a run directory with a final/ nor a final/ directory .* checkpoint.export_final")

    older = _copy(run_dir, tmp_path / "older")
    os.remove(os.path.join(older, "spec.json"))
    _refused(older, r"has no final/spec.json: its final/ was written by a syncpoint before final/ carried the task")

    edited = _copy(run_dir, tmp_path / "edited")
    _edit(os.path.join(edited, "info.json"), lambda v: v.update(task="tests.tasks:linear"))
    _refused(edited, r"names the task 'tests.tasks:linear', its spec.json 'examples.tiny_lm:build' .* edited")

    builtin = _copy(run_dir, tmp_path / "builtin")
    _edit(os.path.join(builtin, "info.json"), lambda v: v.update(task="os:system"))
    _edit(os.path.join(builtin, "spec.json"), lambda v: v["task"].update(path="os:system"))
    _refused(builtin, r"cannot be rebuilt here: .*'os:system' is a builtin function, not a function written in Python")

    other = _copy(run_dir, tmp_path / "other")  # the task builds another model now
    for name in ("info.json", "spec.json"):
        _edit(os.path.join(other, name), lambda v: (v.get("task_config") or v["task"]["config"]).update(d_model=32))
    _refused(
        other,
        r"load_model: .* does not fit the task's model: shapes that differ: pos: .* restore the task.s code as it ran",
    )

    linked = _copy(run_dir, tmp_path / "linked")
    os.replace(os.path.join(linked, "model.safetensors"), tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", os.path.join(linked, "model.safetensors"))
    _refused(linked, r"model.safetensors is a symbolic link, not a regular file")

    torn = _copy(run_dir, tmp_path / "torn")
    with open(os.path.join(torn, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(torn, "model.safetensors")) - 8)
    _refused(torn, r"load_model: .*model.safetensors (holds|declares)")
