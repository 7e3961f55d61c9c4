"""Hugging Face in and out (``syncpoint.workers.state.pretrained``): a transformers model's ``final/``
is a ``save_pretrained`` directory that ``from_pretrained`` loads with nothing at random
initialisation (tied weights, ZeRO-3 gathered, bf16); ``resume.init_from`` takes such a directory
and refuses, naming it, one that does not fit the model or is not safe to read."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import syncpoint
from syncpoint.policies.contracts.errors import ResumeRefused
from syncpoint.workers.state.pretrained import check_and_load, read_pretrained
from syncpoint.workers.storage import RunStorage
from tests.helpers import gpt2_spec, needs, run, run_until_crash, step_history, with_overrides

pytestmark = needs("transformers")

EXPORT = "checkpoint.export_final=true"


def _gpt2(**config):
    from examples.hf_gpt2 import build

    torch.manual_seed(0)
    return build({"num_samples": 8, "seq_len": 16, "n_layer": 2, "n_embd": 32, "n_head": 2, **config}).model


def _final(spec, storage):
    return str(storage / spec.name / "final")


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(3, "fp32"), (2, "bf16")])
def test_the_final_model_of_a_transformers_task_is_a_save_pretrained_directory(tmp_path, stage, precision):
    """from_pretrained(<run>/final) loads every weight the run ended with: no key missing or left at
    random initialisation, the tied head still tied, the generation config beside it."""
    from transformers import AutoModelForCausalLM

    spec = gpt2_spec(
        tmp_path, EXPORT, "train.epochs=1", f"deepspeed.zero_stage={stage}", f"deepspeed.precision={precision}"
    )
    run(spec)
    final = _final(spec, tmp_path)
    names = sorted(os.listdir(final))
    assert {"config.json", "model.safetensors", "generation_config.json", "info.json", "spec.json"} <= set(names), names
    loaded, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied, as it was trained
    # the weights are the run's: the same model, resumed from its final state, gives the same loss
    fresh = _gpt2()
    assert not torch.equal(fresh.transformer.wte.weight, loaded.transformer.wte.weight.to(fresh.dtype))
    found = read_pretrained(RunStorage(final))
    check_and_load(fresh, found, final)  # syncpoint's own reader takes it whole
    for (name, a), (_, b) in zip(fresh.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b.to(a.dtype)), name
    # syncpoint.load_model rebuilds it through the task function (the spec's in final/) with the same weights
    model = syncpoint.load_model(str(tmp_path / spec.name))
    assert type(model) is type(loaded) and not model.training
    assert model.lm_head.weight is model.transformer.wte.weight
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b.to(a.dtype)), name
    state = json.loads(open(os.path.join(final, "info.json")).read())["state"]
    if stage == 3:  # the run's last state, gathered: what the export must hold, bit for bit
        from syncpoint.workers.state.export import zero3_state_from_storage

        gathered = zero3_state_from_storage(RunStorage(spec.run_url), state)
        for name, t in loaded.state_dict().items():
            assert torch.equal(t, gathered[name].to(t.dtype)), name


@pytest.mark.slow
def test_init_from_a_save_pretrained_directory_fine_tunes_from_its_weights(tmp_path):
    """A model saved with save_pretrained (a local copy of a hub model) is where a new run starts: its
    first loss is the pretrained model's, not a fresh one's. An attempt that crashed before the run's
    first state took the directory; the next refuses it if it changed in between; once the run has
    states of its own, init_from is ignored (the directory is not read, and may even be gone), and a
    custom policy that starts fresh on top of them is refused."""
    import shutil

    def save(scale: float) -> None:
        model = _gpt2()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
        model.save_pretrained(source)

    source = tmp_path / "hub-copy"
    save(0.5)
    tuned = gpt2_spec(tmp_path / "tuned", "train.max_steps=2", f"resume.init_from={source}")
    assert run_until_crash(with_overrides(tuned, "faults=[{at_micro_step: 1, mode: raise}]"))
    save(0.25)
    with pytest.raises(ResumeRefused, match=r"the pretrained model this run took at attempt 1, changed since"):
        run(tuned)
    save(0.5)
    run(tuned)
    scratch = gpt2_spec(tmp_path / "scratch", "train.max_steps=2")
    run(scratch)
    assert step_history(tuned)[1].loss != step_history(scratch)[1].loss
    # with states of its own the directory is not read at all; a policy that starts fresh on top of them is refused
    fresh_on_top = ("resume.policy=tests.tasks:LastStateOnly", "resume.policy_args={name: null}")
    with pytest.raises(ResumeRefused, match=r"loaded only when the run starts fresh.*resume\.policy: fresh"):
        run(with_overrides(tuned, "train.max_steps=3", *fresh_on_top))
    shutil.rmtree(source)
    assert run(with_overrides(tuned, "train.max_steps=3")).resumed_from is not None


def test_a_directory_that_does_not_fit_the_model_is_refused_naming_what(tmp_path):
    model = _gpt2()
    other = _gpt2(n_embd=64)
    other.save_pretrained(tmp_path / "wider")
    with pytest.raises(ResumeRefused, match=r"does not fit the task's model: shapes that differ: .*wte\.weight"):
        check_and_load(model, read_pretrained(RunStorage(str(tmp_path / "wider"))), "wider")
    from syncpoint.workers.state.pretrained import model_bytes_bound

    with pytest.raises(ResumeRefused, match=r"more than the task's model can hold"):  # from the listing, unread
        read_pretrained(RunStorage(str(tmp_path / "wider")), model_bytes_bound(model) // 4)
    assert read_pretrained(RunStorage(str(tmp_path / "wider")), model_bytes_bound(other)).tensors
    deeper = _gpt2(n_layer=3)
    deeper.save_pretrained(tmp_path / "deeper")
    with pytest.raises(ResumeRefused, match=r"names the model does not have .*transformer\.h\.2\."):
        check_and_load(model, read_pretrained(RunStorage(str(tmp_path / "deeper"))), "deeper")
    # a base-model checkpoint (GPT2Model, no head) fills GPT2LMHeadModel: its prefix is added, the head is tied
    model.transformer.save_pretrained(tmp_path / "base")
    target = _gpt2()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    check_and_load(target, read_pretrained(RunStorage(str(tmp_path / "base"))), "base")
    for (name, a), (_, b) in zip(target.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert target.lm_head.weight is target.transformer.wte.weight


def test_pickled_torn_and_linked_weights_are_refused_before_any_tensor_is_read(tmp_path):
    model = _gpt2()
    model.save_pretrained(tmp_path / "ok")
    weights = (tmp_path / "ok" / "model.safetensors").read_bytes()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ResumeRefused, match=r"no model\.safetensors \(pytorch_model\.bin is pickled"):
        read_pretrained(RunStorage(str(pickled)))
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "config.json").write_text("{}")
    (torn / "model.safetensors").write_bytes(weights[:-10])
    with pytest.raises(ResumeRefused, match=r"its header declares \d+: torn or padded"):
        read_pretrained(RunStorage(str(torn)))
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").write_text("{}")
    os.symlink(tmp_path / "ok" / "model.safetensors", linked / "model.safetensors")
    with pytest.raises(ResumeRefused, match=r"model\.safetensors is .*link.*not a regular file"):
        read_pretrained(RunStorage(str(linked)))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")  # a read would block: never opened
    (fifo / "model.safetensors").write_bytes(weights)
    with pytest.raises(ResumeRefused, match=r"config\.json is .*not a regular file"):
        read_pretrained(RunStorage(str(fifo)))
    hostile = tmp_path / "hostile-index"
    hostile.mkdir()
    (hostile / "config.json").write_text("{}")
    (hostile / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(ResumeRefused, match=re.escape("names '../../etc/passwd', not a shard beside it")):
        read_pretrained(RunStorage(str(hostile)))
