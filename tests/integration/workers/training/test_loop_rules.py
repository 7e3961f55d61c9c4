"""Loop rules asserted on the states actually written: boundaries, never-dropped save requests,
short-cycle loss averaging, index-arithmetic skipping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncpoint.policies.decisions.boundaries import boundary_micro_steps
from syncpoint.workers.data.sampler import RankMicroBatches, SeededSamples, epoch_loader
from syncpoint.workers.integrity.digest import load_deepspeed_file
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, linear_spec, run, trainer_json
from tests.tasks import Vectors, mse


def test_save_every_3_micro_steps_first_state_at_4(tmp_path):
    spec = linear_spec(tmp_path, "task.config.num_samples=100", "checkpoint.save_every={value: 3, unit: micro_steps}")
    run(spec)
    steps = committed_steps(spec)
    assert steps[0] == 4
    assert set(steps) <= set(boundary_micro_steps(4, 100, 1))
    # every request is serviced: 3->4, 6->8, 9->12, 12, 15->16, ... up to 99->100 (the final state)
    assert steps == sorted({-(-k // 4) * 4 for k in range(3, 101, 3)} | {100})


# 13 micro-batches an epoch in make test; 1001 (a reviewer's case) in make test-all: the same shape
@pytest.mark.parametrize("n", [13, pytest.param(1001, marks=pytest.mark.long)])
def test_a_save_every_2n_minus_2_on_n_per_epoch_lands_on_2n_minus_1_and_4n_minus_1(tmp_path, n):
    """An epoch of N = 1 (mod 4) micro-batches, a request every 2N - 2 micro-steps (2000 on 1001): each
    lands mid-cycle (position N - 2 of its epoch) and is carried to the next boundary, the quota's at
    position N - 1, so at 2N - 1 and 4N - 1; the final state at the run's last micro-step, 5N."""
    spec = linear_spec(
        tmp_path,
        f"task.config.num_samples={n}",
        "train.epochs=5",
        f"checkpoint.save_every={{value: {2 * n - 2}, unit: micro_steps}}",
    )
    run(spec)
    assert committed_steps(spec) == [2 * n - 1, 4 * n - 1, 5 * n]
    t = trainer_json(spec, f"{2 * n - 1:012d}")
    assert (t["epoch"], t["position_in_epoch"], t["micro_batches_per_epoch"]) == (1, n - 1, n)


def test_optimizer_step_interval_and_epoch_end_flush(tmp_path):
    spec = linear_spec(
        tmp_path,
        "task.config.num_samples=10",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    )
    run(spec)
    assert committed_steps(spec) == [4, 8, 10, 14, 18, 20]


def test_short_cycle_averages_over_the_micro_batches_it_accumulated(tmp_path):
    """SGD, no dropout: the update at the short cycle (positions 9-10 of 10) must be
    lr * grad of the mean loss over exactly those 2 micro-batches."""
    spec = linear_spec(
        tmp_path,
        "task.config.num_samples=10",
        "task.config.dropout=0",
        "train.optimizer=sgd",
        "train.lr=0.5",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    )
    run(spec)
    store = RunStorage(spec.run_url)

    def params(step):
        data = store.read_bytes("states", f"{step:012d}", "engine/mp_rank_00_model_states.pt", limit=1 << 30)
        return load_deepspeed_file(data)["module"]

    before, after = params(8), params(10)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.0), torch.nn.Linear(8, 1))
    model.load_state_dict(before)
    data = SeededSamples(Vectors(10), seed=3, epoch=0)
    sampler = RankMicroBatches(10, 1, 1, 0, seed=3, epoch=0, start=0)
    losses = []
    for mb in (8, 9):  # 0-indexed micro-batches 9 and 10
        x, y = data[sampler.indices(mb)[0]]
        losses.append(mse(model, (x.unsqueeze(0), y.unsqueeze(0))))
    (sum(losses) / 2).backward()
    for name, p in model.named_parameters():
        expected = before[name] - 0.5 * p.grad
        assert torch.allclose(after[name], expected, atol=1e-6), name


def test_skip_is_index_arithmetic_and_loads_no_sample():
    class Exploding(torch.utils.data.Dataset):
        def __len__(self):
            return 10**7

        def __getitem__(self, i):
            raise AssertionError("a sample was loaded while skipping")

    loader = epoch_loader(
        Exploding(),
        micro_batch_size=4,
        world_size=2,
        rank=1,
        seed=0,
        epoch=3,
        start=10**6 - 1,
        collate=None,
        num_workers=0,
    )
    iter(loader)  # creating the resumed iterator touches no sample
    sampler = RankMicroBatches(10**7, 4, 2, 1, seed=0, epoch=3, start=10**6 - 1)
    first = next(iter(sampler))
    assert len(first) == 4 and len(sampler) == 1_250_000 - 10**6 + 1
    assert sampler.indices(10**6 - 1) == first
    # the ranks' slices of one global micro-batch are disjoint and cover it
    r0 = RankMicroBatches(64, 4, 2, 0, seed=1, epoch=0, start=0)
    r1 = RankMicroBatches(64, 4, 2, 1, seed=1, epoch=0, start=0)
    assert set(r0.indices(3)).isdisjoint(r1.indices(3))
    assert sorted(r0.indices(3) + r1.indices(3)) == sorted(r0.order(np.arange(24, 32)).tolist())


def test_every_attempt_records_where_its_start_up_went(tmp_path):
    """``attempt_started.setup``: rank 0's phases from its launch to the attempt's start, in order, each
    a duration (bench P12 prints them; a restart's cost is mostly start-up)."""
    from syncpoint.workers.observation.events import EventLog

    spec = linear_spec(tmp_path, "task.config.num_samples=8")
    run(spec)
    (started,) = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "attempt_started"]
    setup = dict(started["setup"])  # (phase, seconds) pairs, in order
    assert [p for p, _ in started["setup"]][:2] == ["process: threads, device, seeds", "task built (model, dataset)"]
    assert "DeepSpeed engine (ops loaded)" in setup and "selection and state load" in setup
    assert all(v >= 0 for v in setup.values())
    assert started["launched_at"] + sum(setup.values()) <= started["time"] + 1e-3
