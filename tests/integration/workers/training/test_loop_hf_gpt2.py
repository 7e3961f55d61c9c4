"""The Hugging Face GPT-2 example (issue 17.4): a transformers model with dropout and activation
checkpointing, trained at ZeRO-3, resumes bitwise.

* the example is what it says: HF's GPT2LMHeadModel, tied embeddings, dropout live in training,
  checkpointing on in every block, an evaluation split disjoint from every training crop;
* activation checkpointing does not change the run: with and without it, the same losses, bit for
  bit (non-reentrant checkpointing recomputes under the forward's saved RNG state);
* single rank, ZeRO-3: a crash mid-cycle and a resume equal the uninterrupted run (per-step
  losses and learning rates, every gathered parameter, the digest); two ranks with a hard crash
  (slow), and the drill on Ray with a crash and a preemption notice (slow).
"""

from __future__ import annotations

import torch

from tests.helpers import gpt2_spec, run, run_until_crash, state_names, step_history
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run

SAVE = "checkpoint.save_every={value: 2, unit: optimizer_steps}"


def test_the_example_is_hf_gpt2_with_dropout_and_checkpointing():
    from transformers import GPT2LMHeadModel

    from examples.hf_gpt2 import build

    torch.manual_seed(0)
    task = build({"num_samples": 16, "eval_samples": 4, "seq_len": 16, "n_embd": 32, "n_head": 2})
    model = task.model
    assert isinstance(model, GPT2LMHeadModel)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one parameter under ZeRO-3
    assert all(block.gradient_checkpointing for block in model.transformer.h)
    assert model.config.resid_pdrop == model.config.embd_pdrop == model.config.attn_pdrop == 0.1
    batch = torch.stack([task.dataset[i] for i in range(2)])
    model.train()
    assert task.loss(model, batch).item() != task.loss(model, batch).item()  # dropout draws
    model.eval()
    assert task.loss(model, batch).item() == task.loss(model, batch).item()
    assert task.eval_dataset is not None and len(task.eval_dataset) == 4


def test_the_default_no_decay_groups_are_the_usual_practice():
    """train.optimizer.no_decay's default on GPT-2: every bias (HF's Conv1D ones too) and every
    LayerNorm parameter (ln_1, ln_2, ln_f) decay-free; the matrices and embeddings decay, as HF Trainer does."""
    from examples.hf_gpt2 import build
    from syncpoint.workers.training.param_groups import decay_split

    torch.manual_seed(0)
    decay, no_decay = decay_split(build({"n_layer": 1, "n_embd": 32, "n_head": 2}).model, None)
    assert all(n.endswith(".weight") and ".ln_" not in n for n, _ in decay)
    assert {n.rsplit(".", 2)[-2] for n, _ in no_decay} == {"ln_1", "ln_2", "ln_f", "c_attn", "c_proj", "c_fc"}
    assert all(n.endswith(".bias") or ".ln_" in n for n, _ in no_decay)
    assert "transformer.wte.weight" in dict(decay) and "lm_head.weight" not in dict(decay)  # tied, listed once


def test_the_evaluation_split_is_disjoint_and_fixed():
    from examples.hf_gpt2 import splits  # transformers: imported by the tests that run, not at collection

    train, evaluation = splits(num_samples=10, eval_samples=3, seq_len=8, noise=0.5)
    assert len(train) == 10 and len(evaluation) == 3
    reach = (len(train) - 1) * 8 + 7 + 8  # the last window, cropped at its largest offset
    assert evaluation.first * 8 >= reach
    assert all(torch.equal(evaluation[i], evaluation[i]) for i in range(3))  # no augmentation
    torch.manual_seed(1)
    a = train[0]
    torch.manual_seed(2)
    assert not torch.equal(a, train[0])  # training samples are augmented (seeded per sample by syncpoint)


def test_activation_checkpointing_does_not_change_the_run(tmp_path):
    """The recompute replays the forward's dropout masks and leaves the RNG stream as it found it."""
    on = gpt2_spec(tmp_path / "on", "train.epochs=1", "task.config.num_samples=16")
    off = gpt2_spec(tmp_path / "off", "train.epochs=1", "task.config.num_samples=16", "task.config.checkpointing=false")
    run(on)
    run(off)
    a, b = step_history(on), step_history(off)
    assert sorted(a) == sorted(b) and len(a) == 4
    assert all(a[k].loss == b[k].loss for k in a)


def test_single_rank_zero3_crash_and_resume_equals_uninterrupted(tmp_path):
    ref = gpt2_spec(tmp_path / "ref", SAVE, "task.config.num_samples=24")
    ref_final = run(ref).final_state
    # 24 samples, micro-batch 2: 12 micro-batches per epoch; accumulation 2; states every 4 micro-steps.
    spec = gpt2_spec(tmp_path / "run", SAVE, "task.config.num_samples=24", "faults=[{at_micro_step: 19, mode: raise}]")
    assert run_until_crash(spec)
    assert max(state_names(spec)) == f"{16:012d}"  # mid-cycle: the last boundary state, in epoch 2
    result = run(spec)
    assert_same_run(ref, ref_final, spec, result.final_state)
