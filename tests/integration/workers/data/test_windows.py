"""Token windows (``syncpoint.TokenWindows``): one token array cut into inputs and shifted targets.

Fast part (no training): the windows are the file's tokens and their next tokens; random starts are
a pure function of (seed, epoch, index) through syncpoint's per-sample seeding, the same read one
at a time, a batch at once, or in DataLoader workers; a file on storage (memory://) is read through
the node's cache; hostile files (truncated, too short, a link, a FIFO) are refused with a reason; the
identity names the windows. Runs (spawned ranks with DataLoader workers, crashed hard and resumed at
1 and 2 ranks): the uninterrupted run, tensor for tensor and sample for sample.
"""

from __future__ import annotations

import io
import os
import pickle

import fsspec
import numpy as np
import pytest
import torch

from syncpoint import TokenWindows
from syncpoint.policies.contracts.corpus_identity import first_difference
from syncpoint.policies.contracts.errors import CorpusError, JobConfigError
from syncpoint.policies.contracts.state_format import SAMPLER_VERSION
from syncpoint.workers.data.corpus import CacheSettings
from syncpoint.workers.data.data_plan import plan_for
from syncpoint.workers.data.sampler import SeededSamples, epoch_loader
from syncpoint.workers.data.shard_cache import fetched_names
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import lm_spec, state_names, step_history, trainer_json
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run
from tests.window_tasks import write_tokens

SEQ = 8


def _settings(tmp_path, bound: int = 1 << 30) -> CacheSettings:
    return CacheSettings(str(tmp_path / "cache"), bound)


def _bin(tmp_path, tokens: np.ndarray, name: str = "train.bin") -> str:
    path = str(tmp_path / name)
    tokens.tofile(path)
    return path


def _npy_bytes(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, values)
    return buf.getvalue()


def _start_of(window: tuple[torch.Tensor, torch.Tensor], tokens: np.ndarray) -> int:
    """The window's start in ``tokens`` (an arange: the first input token is its own offset), checked:
    the input is ``seq_len`` tokens from there, the target the same shifted by one."""
    x, y = window
    s = int(x[0])
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (SEQ,)
    assert x.tolist() == tokens[s : s + SEQ].tolist() and y.tolist() == tokens[s + 1 : s + 1 + SEQ].tolist()
    return s


@pytest.mark.parametrize("fmt", ["bin", "npy"])
def test_windows_are_the_tokens_and_their_targets_shifted_by_one(tmp_path, fmt):
    tokens = np.arange(203, dtype=np.uint16)
    if fmt == "bin":
        path = _bin(tmp_path, tokens)
    else:
        path = str(tmp_path / "train.npy")
        np.save(path, tokens.astype(np.int32))
    seq = TokenWindows(path, SEQ, windows="sequential", cache=_settings(tmp_path))
    assert len(seq) == (203 - 1) // SEQ == seq.tiles and seq.num_tokens == 203
    assert [_start_of(seq[i], tokens) for i in range(len(seq))] == [i * SEQ for i in range(len(seq))]
    rnd = TokenWindows(path, SEQ, samples_per_epoch=500, cache=_settings(tmp_path))
    assert len(rnd) == 500
    starts = [_start_of(rnd[i], tokens) for i in range(500)]
    assert min(starts) >= 0 and max(starts) <= 203 - SEQ - 1  # nanoGPT's randint(len(data) - block_size)
    assert len(set(starts)) > 150  # uniform over 195 starts, not a few
    with pytest.raises(IndexError):
        rnd[500]


def test_random_windows_are_a_function_of_seed_epoch_and_index_however_they_are_read(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16)
    path = _bin(tmp_path, tokens)
    data = TokenWindows(path, SEQ, samples_per_epoch=64, cache=_settings(tmp_path))
    idx = [5, 0, 63, 17, 17, 40]

    def starts(seed: int, epoch: int, batch: bool) -> list[int]:
        seeded = SeededSamples(data, seed, epoch)
        got = seeded.__getitems__(idx) if batch else [seeded[i] for i in idx]
        return [_start_of(w, tokens) for w in got]

    torch.manual_seed(0)
    first = starts(3, 1, batch=True)
    torch.rand(7)  # whatever the global streams hold
    assert starts(3, 1, batch=False) == first  # one at a time: the same windows
    assert first[3] == first[4]  # an index is its own window
    assert starts(3, 2, batch=True) != first and starts(4, 1, batch=True) != first

    # a whole epoch through DataLoader workers (forked, with the parent's mapping) is the epoch in-process
    def epoch(workers: int) -> list[list[int]]:
        loader = epoch_loader(
            data, micro_batch_size=4, world_size=2, rank=1, seed=3, epoch=1, start=2, collate=None, num_workers=workers
        )
        return [x[:, 0].tolist() for x, _ in loader]

    assert epoch(2) == epoch(0) and len(epoch(0)) == 64 // 8 - 2
    assert len(pickle.dumps(data)) < 4096  # the memory map never travels: each process maps its own


def test_a_token_file_on_storage_is_read_through_the_nodes_cache(tmp_path):
    fs = fsspec.filesystem("memory")
    tokens = np.arange(900, dtype=np.uint16)
    fs.pipe_file("/token-windows/train.bin", tokens.tobytes())
    try:
        remote = TokenWindows("memory:///token-windows/train.bin", SEQ, windows="sequential", cache=_settings(tmp_path))
        local = TokenWindows(_bin(tmp_path, tokens), SEQ, windows="sequential", cache=_settings(tmp_path))
        assert [remote[i][1].tolist() for i in range(len(remote))] == [local[i][1].tolist() for i in range(len(local))]
        assert fetched_names(str(tmp_path / "cache" / "shards-cache")) == ["train.bin"]
        assert remote.identity() == local.identity()  # the content, not the place
        plan = plan_for(lm_spec(tmp_path), remote)
        assert plan.identity == remote.identity() and plan.sampler == SAMPLER_VERSION and plan.window_shards is None
        small = TokenWindows("memory:///token-windows/train.bin", SEQ, cache=_settings(tmp_path, bound=1000))
        with pytest.raises(JobConfigError, match=r"corpus.cache_bytes \(1000 bytes\) cannot hold the token file"):
            plan_for(lm_spec(tmp_path), small)
        with pytest.raises(JobConfigError, match="corpus.shuffle shard-window needs"):
            plan_for(lm_spec(tmp_path, "corpus.shuffle=shard-window"), remote)
    finally:
        fs.rm("/token-windows", recursive=True)


def test_the_identity_names_the_windows_so_a_resume_on_others_is_refused(tmp_path):
    path = _bin(tmp_path, np.arange(300, dtype=np.uint16))
    random = TokenWindows(path, SEQ, cache=_settings(tmp_path)).identity()
    sequential = TokenWindows(path, SEQ, windows="sequential", cache=_settings(tmp_path)).identity()
    longer = TokenWindows(path, SEQ + 1, cache=_settings(tmp_path)).identity()
    assert (
        first_difference(random, sequential) == "windows is 'random' in the state's corpus, 'sequential' in this run's"
    )
    assert first_difference(random, longer) == "seq_len is 8 in the state's corpus, 9 in this run's"
    assert random.shards[0].rows == 300 and random.shards[0].name == "train.bin"


def test_hostile_or_wrong_token_files_are_refused_naming_the_file_and_the_fix(tmp_path):
    def refused(path: str, match: str, **kw) -> None:
        with pytest.raises(CorpusError, match=match):
            len(TokenWindows(path, SEQ, cache=_settings(tmp_path), **kw))

    good = _bin(tmp_path, np.arange(100, dtype=np.uint16))
    with open(tmp_path / "odd.bin", "wb") as f:
        f.write(np.arange(100, dtype=np.uint16).tobytes()[:-1])  # a truncated copy
    refused(str(tmp_path / "odd.bin"), r"odd.bin holds 199 bytes, not a whole number of uint16 tokens .* truncated")
    with open(tmp_path / "cut.npy", "wb") as f:
        f.write(_npy_bytes(np.arange(100, dtype=np.int32))[:-40])  # its header says more than it holds
    refused(str(tmp_path / "cut.npy"), r"cut.npy is not a .npy array \(it holds .* bytes, its header's shape")
    refused(_bin(tmp_path, np.arange(SEQ, dtype=np.uint16), "short.bin"), r"short.bin holds 8 tokens, fewer than one")
    refused(_bin(tmp_path, np.zeros(0, np.uint16), "empty.bin"), r"empty.bin holds 0 tokens, fewer than one window")
    os.symlink(good, tmp_path / "link.bin")
    refused(str(tmp_path / "link.bin"), r"link.bin is a symbolic link, not a regular file: never read")
    os.mkfifo(tmp_path / "fifo.bin")
    refused(str(tmp_path / "fifo.bin"), r"fifo.bin is a FIFO, not a regular file")
    refused(str(tmp_path / "missing.bin"), r"missing.bin' does not exist")
    np.save(tmp_path / "rows.npy", np.zeros((10, 3), np.int32))
    refused(str(tmp_path / "rows.npy"), r"TokenWindows reads a 1-D token array: .* Save it flattened")
    refused(
        good, r"samples_per_epoch 13 is more than the 12 sequential windows", windows="sequential", samples_per_epoch=13
    )
    for bad, match in (
        ({"windows": "strided"}, "neither 'random' nor 'sequential'"),
        ({"samples_per_epoch": 0}, "samples_per_epoch must be an integer >= 1"),
        ({"dtype": "float32"}, "no integer type"),
    ):
        with pytest.raises(CorpusError, match=match):
            TokenWindows(good, SEQ, **bad)
    with pytest.raises(CorpusError, match="no globs"):
        TokenWindows(str(tmp_path / "*.bin"), SEQ)


def test_a_link_swapped_in_after_the_index_is_never_read(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    path = _bin(tmp_path, tokens)
    data = TokenWindows(path, SEQ, windows="sequential", cache=_settings(tmp_path))
    assert len(data) == 12  # indexed
    os.replace(path, tmp_path / "moved.bin")
    os.symlink(tmp_path / "moved.bin", path)
    with pytest.raises(CorpusError, match="is a symbolic link, not a regular file: never read"):
        data[0]


# ------------------------------------------------------------------ runs: exact resume


def _spec(storage, tokens: str, *extra: str, workers: int):
    return lm_spec(
        storage,
        "task.path=tests.window_tasks:build",
        f"task.config.tokens={tokens}",
        "task.config.samples_per_epoch=24",
        "train.eval_every=0",
        "train.grad_accum=2",
        "train.epochs=2",
        "train.record_samples=true",
        "train.dataloader_workers=2",
        "checkpoint.save_every={value: 2, unit: micro_steps}",
        *extra,
        workers=workers,
    )


@pytest.mark.slow
@pytest.mark.parametrize("workers,crash", [(1, "{at_micro_step: 15, mode: exit}"), (2, "{rank: 1, at_micro_step: 9}")])
def test_random_windows_resume_exactly_with_dataloader_workers(tmp_path, workers, crash):
    tokens = write_tokens(str(tmp_path / "train.bin"), 4000)
    ref = _spec(tmp_path / "ref", tokens, workers=workers)
    assert run_spawned(ref) == [0] * workers
    ref_final = max(state_names(ref))
    spec = _spec(tmp_path / "run", tokens, f"faults=[{crash}]", workers=workers)
    assert run_spawned(spec)[-1] == 17  # a hard crash in the second epoch
    assert max(state_names(spec)) < ref_final
    assert run_spawned(spec) == [0] * workers
    final = max(state_names(spec))
    assert_same_run(ref, ref_final, spec, final)
    a, b = step_history(ref), step_history(spec)
    assert all(b[step].samples == a[step].samples for step in a)
    data = trainer_json(spec, final)["data"]
    assert data["num_samples"] == 24 and data["corpus"]["shards"] == 1 and data["corpus"]["rows"] == 4000
