"""The stream part of a digest: where ``datasets`` left its inner iterator in a pass the stream has
exhausted is no part of what comes next (the stream never reads it again in that pass, and starts
the next afresh), so it does not change the digest; anywhere else it does."""

from __future__ import annotations

from syncpoint.workers.integrity.digest import settled_stream


def _loader(exhausted: bool, shard_idx: int, shard_example_idx: int, workers: bool = False) -> dict:
    inner = {"examples_iterable": {"shard_idx": shard_idx, "shard_example_idx": shard_example_idx}, "epoch": 4}
    dataset_state = {
        "pass": 4,
        "inner": inner,
        "examples": 24,
        "taken": 24,
        "batches": 12,
        "exhausted": exhausted,
        "buffer": [],
    }
    if workers:  # a DataLoader worker's state holds its own dataset_state
        return {"_num_yielded": 12, "_snapshot": {"_worker_snapshots": {"worker_0": {"dataset_state": dataset_state}}}}
    return {"_num_yielded": 12, "dataset_state": dataset_state}


def test_an_exhausted_pass_hashes_the_same_wherever_datasets_left_its_shard_index():
    # the uninterrupted run past the last shard, the resumed one at the end of the shard before it
    for workers in (False, True):
        assert settled_stream(_loader(True, 2, 0, workers)) == settled_stream(_loader(True, 1, 12, workers))


def test_a_pass_still_running_keeps_its_inner_position():
    assert settled_stream(_loader(False, 2, 0)) != settled_stream(_loader(False, 1, 12))
    assert settled_stream(_loader(False, 1, 12)) == _loader(False, 1, 12)  # nothing else is touched
