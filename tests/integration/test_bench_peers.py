"""The peer benchmarks' harnesses (issue 20.3): P1's accelerate baselines and P9's HF Trainer /
syncpoint chains. The benches report timings; these tests check only that what they compare is
what they say (the same batches, the same bookkeeping), never a time."""

from __future__ import annotations

import signal

import pytest
import torch

from bench import p1_resume_skip as p1
from bench import p9_hf_trainer as p9


def test_p1_accelerate_baselines_reach_the_batch_ours_starts_at():
    """accelerate.skip_first_batches on the stream (fetch-and-discard) and on the map-style loader
    (index skip) land on the micro-batch ``epoch_loader(start=position)`` returns first."""
    ds = p1.DecodeLike(200, side=8)
    for position in (0, 3, 11):
        _, ours = p1.ours(ds, position)
        _, fetched = p1.fetch_and_discard(ds, position)
        _, indexed = p1.index_skip(ds, position)
        assert p1.same_batch(ours, fetched) and p1.same_batch(ours, indexed)
    _, a = p1.ours(ds, 3)
    _, b = p1.ours(ds, 4)
    assert not p1.same_batch(a, b)  # the check can fail


def _records(attempt, ids, losses, steps=None):
    return [{"a": attempt, "step": None, "idx": list(i), "loss": x} for i, x in zip(ids, losses, strict=True)]


def test_p9_kept_and_compare_find_redone_skipped_and_repeated_work():
    layout = p9.Layout(per_epoch=6, accum=2)
    ids = [(2 * g, 2 * g + 1) for g in range(12)]
    losses = [float(g) for g in range(12)]
    params = {"w": torch.ones(3)}
    ref = {"records": _records(1, ids, losses), "starts": [0], "codes": [0], "params": params}
    # killed before mb 5 (resumed at 4), then finished: mb 4 was computed twice, kept once
    exact = {
        "records": _records(1, ids[:5], losses[:5]) + _records(2, ids[4:], losses[4:]),
        "starts": [0, 4],
        "codes": [-signal.SIGKILL, 0],
        "params": {"w": torch.ones(3)},
    }
    c = p9.compare(ref, exact, layout)
    assert c["losses_identical"] and c["bitwise"] and c["kills"] == 1 and c["first_resume"] == 4
    assert (c["skipped"], c["repeated"], c["ids_differ"], c["micro_batches"]) == (0, 0, 0, 12)
    # a resume that trains mb 3's samples again at mb 4 and never sees mb 4's, with other losses after it
    bad_ids = ids[:4] + [ids[3]] + ids[5:]
    bad = {
        "records": _records(1, ids[:5], losses[:5]) + _records(2, bad_ids[4:], [x + 1 for x in losses[4:]]),
        "starts": [0, 4],
        "codes": [-signal.SIGKILL, 0],
        "params": {"w": torch.ones(3) * 1.5},
    }
    c = p9.compare(ref, bad, layout)
    assert not c["losses_identical"] and c["first_loss_diff"] == 4 and not c["bitwise"]
    assert c["max_param_diff"] == 0.5
    assert (c["skipped"], c["repeated"], c["ids_differ"]) == (2, 2, 1)


def test_p9_hf_micro_index_follows_the_short_epoch_end_cycle():
    layout = p9.Layout()  # 22 micro-batches an epoch, accumulation 4: steps of 4,4,4,4,4,2
    assert layout.steps_per_epoch == 6
    assert [layout.micro_index(s, 0) for s in (0, 2, 5, 6, 8)] == [0, 8, 20, 22, 30]
    assert layout.micro_index(5, 1) == 21 and layout.epoch_of(21) == 0 and layout.epoch_of(22) == 1


def test_p9_attempts_do_not_inherit_a_distributed_launch(monkeypatch):
    """An in-process syncpoint run earlier in the same process leaves ``LOCAL_RANK`` set; an HF attempt that
    inherits it is taken by accelerate for one rank of a multi-process job and fails waiting for
    ``MASTER_ADDR`` (seen in CI). The attempt's environment drops every such variable and keeps the rest."""
    for name, value in (("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1234"), ("P9_KEEP", "x")):
        monkeypatch.setenv(name, value)
    env = p9._attempt_env(P9_ATTEMPT="1")
    assert not {"LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} & set(env)
    assert env["P9_KEEP"] == "x" and env["P9_ATTEMPT"] == "1"


@pytest.mark.slow
@pytest.mark.long  # 3 minutes of make test for the bench's own harness: every bench run checks the same equalities
def test_p11_resume_each_system_resumes_to_its_uninterrupted_batch_and_filled_states_are_the_written_ones(tmp_path):
    """P11 (c) on a small corpus (8 shards of 3,000 records, Parquet row groups of 1,000): every
    system's resumed first batch is its uninterrupted run's batch there, the states the bench fills
    in beyond its uninterrupted runs equal the ones each system wrote (positions in several shards
    and row groups, one the first of a row group), and syncpoint's sampler reference is the batch its
    uninterrupted loader yields."""
    from bench import p11_resume as p11

    corpus = p11.write_corpus(3_000, str(tmp_path / "corpus"), row_group_rows=1_000)
    positions = [16 * 20, 16 * 125, 16 * 1_000, 16 * 1_310]  # shards 0, 0 (a row group's first), 5, 6
    records = {p: corpus.records(p) for p in positions}
    assert records[16 * 20] == list(range(320, 336))
    for order in ("shard-window", "global"):
        run = p11.syncpoint_uninterrupted(corpus, order, positions[2])
        assert run.batch == p11.syncpoint_expected(corpus, order, positions[2]) != records[positions[2]]
        resumed = p11.syncpoint_resume(corpus, order, positions)
        assert [r.batch for r in resumed] == [p11.syncpoint_expected(corpus, order, p) for p in positions]

    reached = p11.hf_uninterrupted(corpus, positions)
    assert [r.batch for r in reached] == [records[p] for p in positions]
    template = reached[0].state
    assert all(p11.hf_state_at(corpus, template, r.position) == r.state for r in reached)
    assert p11.hf_state_at(corpus, template, positions[1]) != reached[2].state  # the check can fail
    jobs = [(p, p11.hf_state_at(corpus, template, p)) for p in positions]
    assert [r.batch for r in p11.hf_resume(corpus, jobs)] == [records[p] for p in positions]
    assert [r.batch for r in p11.hf_skip(corpus, positions)] == [records[p] for p in positions]
    assert [r.batch for r in p11.hf_trainer(corpus, positions[:2])] == [records[p] for p in positions[:2]]

    for over in ("stream", "map"):
        reached = p11.sdl_uninterrupted(corpus, over, positions)
        assert [r.batch for r in reached] == [records[p] for p in positions]
        assert all(p11.sdl_state_at(corpus, over, reached[0].state, r.position) == r.state for r in reached)
        jobs = [(p, p11.sdl_state_at(corpus, over, reached[0].state, p)) for p in positions]
        assert [r.batch for r in p11.sdl_resume(corpus, over, jobs)] == [records[p] for p in positions]

    reached = p11.stream_uninterrupted(corpus, positions)
    assert [r.batch for r in reached] == [records[p] for p in positions]
    assert all(p11.stream_state_at(corpus, reached[0].state, r.position) == r.state for r in reached)
    jobs = [(p, p11.stream_state_at(corpus, reached[0].state, p)) for p in positions]
    assert [r.batch for r in p11.stream_resume(corpus, jobs)] == [records[p] for p in positions]

    states, run = p11.mosaic_states(corpus, positions, positions[1])
    assert run.batch == records[positions[1]]
    assert [r.batch for r in p11.mosaic_resume(corpus, [(s.position, s.state) for s in states])] == [
        records[p] for p in positions
    ]
