"""The data-side RNG wrappers (``syncpoint.workers.data.sampler``): a batch's samples and its collate draw
from seeds of their own and leave the caller's streams as they were, whether or not anything drew,
and the cheap paths (no transform, torch's own collate) give the same values as the seeded ones."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import default_collate

from syncpoint.workers.data.sampler import SeededBatch, SeededCollate, SeededSamples


def _next_draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _streams_after(fn) -> tuple[float, float, float]:
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    fn()
    return _next_draws()


class _Noisy(torch.utils.data.Dataset):
    """Each sample draws from all three global streams."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i + random.random() + np.random.rand()]) + torch.rand(1)


class _Batched(_Noisy):
    """Reads a batch at once (as a sharded corpus does); ``draw`` says whether its samples draw."""

    def __init__(self, draw: bool) -> None:
        self.draw = draw

    def seeded_items(self, indices, seeding):
        out = []
        for i in indices:
            if self.draw:
                with seeding(i):
                    out.append(self[i])
            else:
                out.append(torch.tensor([float(i)]))
        return out


def test_a_batch_leaves_the_callers_streams_as_they_were_whether_its_samples_draw_or_not():
    untouched = _streams_after(lambda: None)
    for dataset in (_Noisy(), _Batched(draw=True), _Batched(draw=False)):
        seeded = SeededSamples(dataset, seed=3, epoch=1)
        assert _streams_after(lambda s=seeded: s.__getitems__([4, 9, 4])) == untouched


def test_a_sample_has_the_same_values_in_any_batch_and_alone():
    for dataset in (_Noisy(), _Batched(draw=True)):
        seeded = SeededSamples(dataset, seed=3, epoch=1)
        batch = seeded.__getitems__([4, 9, 4])
        assert [float(t) for t in batch] == [float(seeded[i]) for i in (4, 9, 4)]
        assert float(batch[0]) == float(batch[2])


def test_torchs_collate_is_run_plainly_and_a_drawing_collate_under_the_batchs_seed():
    samples = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    batch = SeededBatch(samples)
    batch.seed = 1234
    untouched = _streams_after(lambda: None)
    plain = SeededCollate(None)
    assert torch.equal(plain(batch), default_collate(samples))
    assert _streams_after(lambda: plain(batch)) == untouched

    def masking(items):
        stacked = torch.stack(items)
        return stacked * (torch.rand(stacked.shape) > 0.5)

    drawing = SeededCollate(masking)
    first = drawing(batch)
    assert _streams_after(lambda: drawing(batch)) == untouched
    torch.manual_seed(99)  # the caller's stream does not matter: the batch's seed does
    assert torch.equal(drawing(batch), first)
