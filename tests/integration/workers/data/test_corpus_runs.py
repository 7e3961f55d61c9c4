"""Training on a sharded corpus on moto's S3 server (the ``s3`` fixture of tests/conftest.py):

* a crash and resume is bitwise the uninterrupted run (per-step losses, final digest), and the
  resumed attempt, on a node with an empty cache, fetches only the shards from its position on
  (and reads none to index the corpus: the run directory holds the index);
* a corpus changed between attempts is refused at selection, naming the shard;
* an elastic resize (2 workers, then 1) consumes the same samples per optimizer step;
* ``syncpoint drill`` through Ray on the corpus (crash and preemption notice, bitwise) is
  tests/drills/ray/test_corpus_runs.py.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from examples.sharded_lm import write_corpus
from syncpoint.policies.contracts.errors import ResumeRefused
from syncpoint.policies.contracts.state_format import SHARD_WINDOW_SAMPLER
from syncpoint.workers.data import corpus as corpus_mod
from syncpoint.workers.data import corpus_index as index_mod
from syncpoint.workers.data.corpus import ShardedCorpus
from syncpoint.workers.data.sampler import ShardWindowOrder
from syncpoint.workers.data.shard_cache import fetched_names
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import (
    digest,
    lm_spec,
    run,
    run_until_crash,
    state_names,
    step_history,
    trainer_json,
    with_overrides,
)
from tests.s3_server import BUCKET

pytestmark = pytest.mark.slow
WINDOW = 2


def _spec(storage, shards: str, cache, *extra, workers: int = 1):
    return lm_spec(
        storage,
        "task.path=examples.sharded_lm:build",
        f"task.config.shards={shards}",
        "train.eval_every=0",
        "train.grad_accum=2",
        "train.epochs=2",
        "train.record_samples=true",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        f"corpus.window_shards={WINDOW}",
        f"corpus.cache_dir={cache}",
        *extra,
        workers=workers,
    )


def _same_run(ref, ref_final: str, spec, final: str) -> None:
    a, b = step_history(ref), step_history(spec)
    assert sorted(a) == sorted(b) and a
    for step in a:
        assert b[step].loss == a[step].loss, f"loss differs at optimizer step {step}"
        assert b[step].samples == a[step].samples, f"samples differ at optimizer step {step}"
    assert final == ref_final and digest(spec, final) == digest(ref, ref_final)


def test_a_corpus_on_s3_resumes_bitwise_and_fetches_only_the_shards_from_its_position(s3, tmp_path, monkeypatch):
    shards = f"s3://{BUCKET}/corpus-resume/*.npy"
    write_corpus(f"s3://{BUCKET}/corpus-resume", 8, 6, 8)
    ref = _spec(tmp_path / "ref", shards, tmp_path / "cache-ref")
    ref_final = run(ref).final_state
    t = trainer_json(ref, ref_final)
    assert t["data"]["sampler"] == SHARD_WINDOW_SAMPLER and t["data"]["window_shards"] == WINDOW
    assert t["data"]["corpus"]["shards"] == 8

    spec = _spec(
        f"s3://{BUCKET}/runs-resume", shards, tmp_path / "cache-1", "faults=[{at_micro_step: 47, mode: raise}]"
    )
    assert run_until_crash(spec)
    reads: list[str] = []
    original = index_mod._read_shard
    monkeypatch.setattr(index_mod, "_read_shard", lambda *a: reads.append(a[3]) or original(*a))
    resumed = with_overrides(spec, "faults=[]", f"corpus.cache_dir={tmp_path / 'cache-2'}")  # another node
    result = run(resumed)
    assert result.resumed_from == f"{46:012d}"
    _same_run(ref, ref_final, spec, result.final_state)

    assert reads == []  # the index came from the run directory
    state = trainer_json(spec, result.resumed_from)
    corpus = ShardedCorpus(shards, seq_len=9, cache=corpus_mod.CacheSettings(str(tmp_path / "cache-2"), 1 << 30))
    order = ShardWindowOrder(corpus.shard_rows, WINDOW, ref.train.seed, state["epoch"])
    first = order.window_of(state["data"]["samples_in_epoch"])
    fetched = fetched_names(str(tmp_path / "cache-2" / "shards-cache"))
    from_here = [corpus.shards[s].name for s in order.shards[first * WINDOW :]]
    assert len(fetched) == len(set(fetched)) and set(fetched) == set(from_here)
    assert first > 0 and len(fetched) < 8  # the shards before the position were never fetched


def test_a_corpus_changed_between_attempts_is_refused_at_selection_naming_the_shard(s3, tmp_path):
    import fsspec

    url = f"s3://{BUCKET}/corpus-changed"
    paths = write_corpus(url, 6, 6, 8)
    spec = _spec(
        f"s3://{BUCKET}/runs-changed", f"{url}/*.npy", tmp_path / "cache", "faults=[{at_micro_step: 9, mode: raise}]"
    )
    assert run_until_crash(spec)
    fs, _ = fsspec.core.url_to_fs(url)
    tokens = np.load(io.BytesIO(fs.cat_file(paths[3])))
    buf = io.BytesIO()
    np.save(buf, np.concatenate([tokens, tokens[:9]]))  # one row more in shard 3
    fs.pipe_file(paths[3], buf.getvalue())
    with pytest.raises(ResumeRefused) as refused:
        run(with_overrides(spec, "faults=[]"))
    msg = str(refused.value)
    assert "the sharded corpus differs from the state's" in msg
    assert "shard shard-00003.npy changed: 9 rows in the state's corpus, 10 now" in msg  # 6 + 3 % 5 rows before
    assert state_names(spec) == [f"{s:012d}" for s in (2, 4, 6, 8)]  # nothing was trained on the new corpus


def test_an_elastic_resize_on_the_corpus_keeps_the_samples_of_every_step(s3, tmp_path):
    from tests.integration.policies.decisions.test_elastic import _assert_same_samples_and_close

    url = f"s3://{BUCKET}/corpus-elastic"
    write_corpus(url, 8, 6, 8, vary=False)  # 48 rows: 6 optimizer steps of 8 samples per epoch
    extra = ("scaling.num_workers={min: 1, max: 2}", "task.config.dropout=0")
    ref = _spec(tmp_path / "ref", f"{url}/*.npy", tmp_path / "cache", *extra, workers=2)
    assert run_spawned(ref) == [0, 0]
    spec = _spec(
        tmp_path / "run", f"{url}/*.npy", tmp_path / "cache", *extra, "faults=[{rank: 1, at_micro_step: 17}]", workers=2
    )
    assert run_spawned(spec)[1] == 17  # a node is gone and no replacement comes
    assert run_spawned(spec, world_size=1) == [0]  # continue on the one worker left
    last = trainer_json(spec, state_names(spec)[-1])
    assert (last["world_size"], last["grad_accum"], last["data"]["sampler"]) == (1, 4, SHARD_WINDOW_SAMPLER)
    _assert_same_samples_and_close(ref, spec)
