"""A Hugging Face ``transformers`` GPT-2 on synthetic text: a model people know, trained by syncpoint.

No downloads: the model is ``GPT2LMHeadModel`` built from a small ``GPT2Config`` (weights
initialised by HF's own ``_init_weights``, under the seed syncpoint set from ``train.seed``), and
the text is ``examples.tiny_lm``'s deterministic pseudo-English corpus. What it exercises, beyond
the tiny example:

* **HF's randomness**: dropout on embeddings, residuals and attention probabilities
  (``embd_pdrop``/``resid_pdrop``/``attn_pdrop``), plus the per-sample augmentation of the tiny
  example (random crop offset and token noise in ``__getitem__``);
* **activation checkpointing** (``activation_checkpointing_enable``, HF's new name for
  ``gradient_checkpointing_enable``): every block's forward is recomputed in backward. We pass
  ``use_reentrant=False`` explicitly (torch's recommended mode, and HF's default since 4.35, but not
  torch's own default before 2.9): it recomputes inside ``torch.random.fork_rng`` with the CPU (and
  CUDA) RNG state saved at forward time (``preserve_rng_state=True``), so the recomputed dropout
  masks are the forward's and the global RNG stream after backward is what it would be without
  checkpointing. Nothing in syncpoint's RNG capture needs to know about it: states are only taken
  at sync boundaries, after backward. Non-reentrant mode also works with ZeRO-3's parameter hooks
  (the recompute calls each module again, so DeepSpeed gathers its partitions again) and with inputs
  that do not require grad, which the reentrant mode silently gets wrong;
* **ZeRO-3** with GPT-2's tied input/output embedding (``lm_head.weight`` is ``wte.weight``).

``task.config``: ``num_samples``, ``eval_samples``, ``seq_len``, ``noise``, and the model's ``n_layer``,
``n_embd``, ``n_head``, ``n_positions``, ``vocab``, ``dropout`` (one value for the three pdrops) and
``checkpointing`` (true/false).

The evaluation split (``eval_dataset``) is a disjoint slice of the same corpus, without augmentation,
the task's ``eval_dataset`` (``train.eval_every`` in the yaml evaluates it).
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from examples.tiny_lm import VOCAB, synthetic_corpus
from syncpoint.workers.task import Task


class CorpusWindows(torch.utils.data.Dataset):
    """Windows of ``seq_len`` tokens over one corpus, from window ``first`` on.

    With ``augment`` (training) each fetch crops at a random offset within its window's stride and
    flips a few tokens (data-side randomness, seeded per sample by syncpoint); without it
    (evaluation) window ``i`` is always the same tokens.
    """

    def __init__(
        self, corpus: torch.Tensor, first: int, num_samples: int, seq_len: int, augment: bool, noise: float
    ) -> None:
        self.corpus, self.first, self.num_samples, self.seq_len = corpus, first, num_samples, seq_len
        self.augment, self.noise = augment, noise

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        offset = int(torch.randint(0, self.seq_len, ()).item()) if self.augment else 0
        start = (self.first + i) * self.seq_len + offset
        x = self.corpus[start : start + self.seq_len].clone()
        if self.augment and self.noise > 0:
            flip = torch.rand(x.shape) < self.noise
            x[flip] = torch.randint(1, VOCAB, (int(flip.sum()),))
        return x


def splits(num_samples: int, eval_samples: int, seq_len: int, noise: float) -> tuple[CorpusWindows, CorpusWindows]:
    """Training windows ``[0, num_samples)`` and evaluation windows after a gap of two strides, so no
    training crop (which reaches at most ``seq_len - 1`` tokens past its own window) overlaps them."""
    gap = 2
    corpus = synthetic_corpus((num_samples + gap + eval_samples + 1) * seq_len)
    train = CorpusWindows(corpus, 0, num_samples, seq_len, augment=True, noise=noise)
    evaluation = CorpusWindows(corpus, num_samples + gap, eval_samples, seq_len, augment=False, noise=0.0)
    return train, evaluation


def gpt2(config: dict) -> GPT2LMHeadModel:
    """GPT-2 from a config only (no pretrained weights). ``attn_implementation="eager"``: GPT-2's own
    attention code, the same kernels on every torch build (SDPA picks a backend per device and
    shape); its attention-probability dropout draws from the global RNG like every other dropout."""
    vocab = int(config.get("vocab", VOCAB))
    if vocab < VOCAB:
        raise ValueError(f"task.config.vocab: {vocab} is smaller than the corpus's {VOCAB} token ids; use >= {VOCAB}")
    seq_len = int(config.get("seq_len", 32))
    n_positions = int(config.get("n_positions", seq_len))
    if n_positions < seq_len:
        raise ValueError(f"task.config.n_positions: {n_positions} < seq_len {seq_len}; use n_positions >= seq_len")
    dropout = float(config.get("dropout", 0.1))
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=n_positions,
        n_embd=int(config.get("n_embd", 64)),
        n_layer=int(config.get("n_layer", 2)),
        n_head=int(config.get("n_head", 4)),
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # what HF falls back to for this class name, without its warning
    if bool(config.get("checkpointing", True)):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: ``labels`` are the inputs, shifted inside the model."""
    return model(input_ids=batch, labels=batch).loss


def build(config: dict) -> Task:
    seq_len = int(config.get("seq_len", 32))
    train, evaluation = splits(
        int(config.get("num_samples", 512)),
        int(config.get("eval_samples", 64)),
        seq_len,
        float(config.get("noise", 0.05)),
    )
    return Task(model=gpt2(config), dataset=train, loss=lm_loss, eval_dataset=evaluation)
