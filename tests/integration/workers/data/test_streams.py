"""Stream datasets (``syncpoint.workers.data.stream``): a Hugging Face streaming corpus, a map-style
``datasets.Dataset`` and a stateful custom stream resume bitwise; what cannot resume exactly is refused at start or at
selection, naming why; a bad stream file is a refusal that falls back.

The resume tests compare a crashed-and-resumed run with an uninterrupted one: every optimizer step's
loss and the final state's digest (parameters, optimizer, position, RNG, every rank's stream state).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
from syncpoint.policies.contracts.errors import JobConfigError, ResumeRefused, StateRefused, TaskError
from syncpoint.policies.contracts.state_format import (
    MANIFEST_FILE,
    SAMPLER_VERSION,
    STREAM_SAMPLER,
    TrainState,
    json_bytes,
    stream_file,
)
from syncpoint.policies.decisions.candidates import Candidate, LiveJob, Verdict, classify
from syncpoint.workers.data.stream import RankStream, StreamSource, check_spec, prepare
from syncpoint.workers.data.stream_state import SavedStream, StreamStateError, encode, parse
from syncpoint.workers.integrity.checksum import checksum_bytes, entry
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import (
    committed_steps,
    digest,
    linear_spec,
    needs,
    run,
    run_until_crash,
    state_names,
    step_history,
    stream_spec,
    trainer_json,
    with_overrides,
)
from tests.meta import changed

pytestmark = needs("datasets", "torchdata")


def _losses(spec) -> dict[int, float]:
    return {k: s.loss for k, s in step_history(spec).items()}


def _crash_and_resume(spec, crash_at: int, world: int) -> None:
    """Crash at a micro-step (every rank's process ends there), then resume to the end."""
    mode = "raise" if world == 1 else "exit"
    crashing = with_overrides(spec, f"faults=[{{at_micro_step: {crash_at}, mode: {mode}}}]")
    if world == 1:
        assert run_until_crash(crashing)
        run(spec)
    else:
        assert run_spawned(crashing)[0] == 17
        assert run_spawned(spec) == [0] * world


def _uninterrupted(spec, world: int) -> None:
    if world == 1:
        run(spec)
    else:
        assert run_spawned(spec) == [0] * world


def _assert_same_run(ref, resumed) -> None:
    final = state_names(ref)[-1]
    assert state_names(resumed)[-1] == final
    a, b = _losses(ref), _losses(resumed)
    assert a.keys() == b.keys() and len(a) == ref.train.max_steps
    assert [a[k] for k in sorted(a)] == [b[k] for k in sorted(b)]
    assert digest(ref, final) == digest(resumed, final)


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.slow
@pytest.mark.parametrize("world,loader_workers", [(1, 0), (1, 2), (2, 0), pytest.param(2, 2, marks=pytest.mark.long)])
def test_hf_streaming_corpus_resumes_bitwise(tmp_path, world, loader_workers):
    """A local JSONL corpus loaded with streaming=True, split per rank, shuffled through syncpoint's
    buffer, crossing a pass boundary (each rank's stream repeats): crashed after one state and
    resumed, it is the uninterrupted run, loss by loss and bit for bit, with its stream state."""
    corpus = tmp_path / "corpus"
    ref = stream_spec(tmp_path / "ref", corpus, f"train.dataloader_workers={loader_workers}", workers=world)
    _uninterrupted(ref, world)
    spec = stream_spec(tmp_path / "run", corpus, f"train.dataloader_workers={loader_workers}", workers=world)
    _crash_and_resume(spec, 15, world)  # the newest state is at micro-step 12; one pass is 24 // world
    assert committed_steps(spec)[0] == 6
    _assert_same_run(ref, spec)
    record = trainer_json(spec, state_names(spec)[-1])
    assert record["data"]["sampler"] == STREAM_SAMPLER
    assert record["data"]["stream"]["dataloader_workers"] == loader_workers
    assert [f["name"] for f in record["data"]["stream"]["identity"]["files"]] == [
        f"shard_{i:03d}.jsonl" for i in range(4)
    ]


@pytest.mark.slow
def test_hf_stream_with_asynchronous_saves_resumes_bitwise(tmp_path):
    """checkpoint.async: the stream position is captured at the boundary, uploaded in the background."""
    corpus = tmp_path / "corpus"
    ref = stream_spec(tmp_path / "ref", corpus, "checkpoint.async=true")
    run(ref)
    spec = stream_spec(tmp_path / "run", corpus, "checkpoint.async=true")
    _crash_and_resume(spec, 21, 1)
    _assert_same_run(ref, spec)


@pytest.mark.slow
def test_hf_stream_resume_is_exact_only_because_the_stream_state_is_restored(tmp_path, monkeypatch):
    """The premise of the test above: a resume that starts the stream over (its saved state dropped)
    trains on other examples, so the comparison can fail."""
    corpus = tmp_path / "corpus"
    ref = stream_spec(tmp_path / "ref", corpus)
    run(ref)
    import syncpoint.workers.data.source

    real = syncpoint.workers.data.source.StreamBatches.__init__

    def forgetful(self, attempt, prepared, saved):
        real(self, attempt, prepared, None)

    spec = stream_spec(tmp_path / "run", corpus)
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 15, mode: raise}]"))
    monkeypatch.setattr(syncpoint.workers.data.source.StreamBatches, "__init__", forgetful)
    run(spec)
    a, b = _losses(ref), _losses(spec)
    assert [a[k] for k in sorted(a)][:6] == [b[k] for k in sorted(b)][:6]
    assert [a[k] for k in sorted(a)][6:] != [b[k] for k in sorted(b)][6:]


@pytest.mark.slow
def test_hf_map_style_dataset_resumes_exactly(tmp_path):
    """The same corpus loaded without streaming is a map-style datasets.Dataset: syncpoint orders and
    skips it by index, like any map-style dataset, and it resumes bit for bit."""
    corpus = tmp_path / "corpus"
    overrides = (
        "task.config.streaming=false",
        "train.stream_shuffle_buffer=0",
        "train.max_steps=null",
        "train.epochs=2",
    )
    ref = stream_spec(tmp_path / "ref", corpus, *overrides)
    run(ref)
    spec = stream_spec(tmp_path / "run", corpus, *overrides)
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 29, mode: raise}]"))
    run(spec)
    final = state_names(ref)[-1]
    assert int(final) == 48 and state_names(spec)[-1] == final  # 2 epochs of 24 micro-batches
    a, b = _losses(ref), _losses(spec)
    assert [a[k] for k in sorted(a)] == [b[k] for k in sorted(b)] and len(a) == 24
    assert digest(ref, final) == digest(spec, final)
    assert "stream" not in trainer_json(spec, final)["data"]


@pytest.mark.slow
@pytest.mark.parametrize("loader_workers", [0, 2])
def test_stateful_custom_stream_resumes_exactly(tmp_path, loader_workers):
    """A custom IterableDataset with state_dict/load_state_dict and split(rank, world_size), its
    examples augmented from the global RNG and its own NumPy generator, counted in declared epochs
    (train.stream_epoch_steps): crashed and resumed, it is the uninterrupted run."""

    def spec_at(path):
        return linear_spec(
            path,
            "task.path=tests.stream_tasks:counting_stream",
            "task.config.num_samples=14",
            "train.micro_batch_size=2",
            "train.grad_accum=2",
            "train.epochs=3",
            "train.stream_epoch_steps=4",
            "train.scheduler={type: linear, unit: epochs}",
            f"train.dataloader_workers={loader_workers}",
            "checkpoint.save_every={value: 3, unit: optimizer_steps}",
        )

    ref = spec_at(tmp_path / "ref")
    run(ref)
    spec = spec_at(tmp_path / "run")
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 15, mode: raise}]"))
    run(spec)
    final = state_names(ref)[-1]
    assert int(final) == 24  # 3 epochs of 4 steps of 2 micro-batches; a pass is 7 // workers' share
    a, b = _losses(ref), _losses(spec)
    assert [a[k] for k in sorted(a)] == [b[k] for k in sorted(b)] and len(a) == 12
    assert digest(ref, final) == digest(spec, final)
    assert trainer_json(spec, final)["data"]["stream"]["identity"] == {"class": "tests.stream_tasks.CountingStream"}


def _reference_and_resumed(tmp_path, *overrides: str, crash_at: int = 15, world: int = 1):
    """The stream example uninterrupted (``ref``) and crashed at micro-step ``crash_at`` then resumed,
    on one corpus under ``tmp_path``: the two runs are the same, loss for loss and digest for digest."""
    corpus = tmp_path / "corpus"
    ref = stream_spec(tmp_path / "ref", corpus, *overrides, workers=world)
    _uninterrupted(ref, world)
    spec = stream_spec(tmp_path / "run", corpus, *overrides, workers=world)
    _crash_and_resume(spec, crash_at, world)
    _assert_same_run(ref, spec)
    return ref, spec


@pytest.mark.slow
def test_a_batched_random_map_resumed_mid_batch_is_the_uninterrupted_run(tmp_path):
    """``.map(crop, batched=True, batch_size=8)`` with a random crop: datasets computes the whole batch
    in the draw of its first example and, resumed mid-batch (state 12 holds 24 examples taken and 5 in
    the buffer: 29 drawn), recomputes it in the first draw after the resume. Each call is seeded by
    its own position (the index of the batch's first input), so the recomputed batch is the one the
    uninterrupted run trained on."""
    _reference_and_resumed(
        tmp_path, "task.path=tests.stream_tasks:composed", "task.config.map=random", "task.config.map_batch=8"
    )


@pytest.mark.slow
def test_a_state_saved_as_a_pass_begins_resumes_every_loader_workers_pass(tmp_path):
    """A pass is 24 micro-batches, 12 from each of 2 DataLoader workers; the state at micro-step 25
    is saved after worker 0's first micro-batch of pass 1 and before worker 1's. torchdata records a
    worker's state at a pass's start as the worker reports it then, before its stream began the pass:
    the stream says it is at the pass's start (its state names its pass), not where pass 0 ended
    (exhausted, which left worker 1 empty for the resumed pass 1)."""
    _reference_and_resumed(
        tmp_path,
        "train.dataloader_workers=2",
        "train.grad_accum=1",
        "train.max_steps=30",
        "checkpoint.save_every={value: 25, unit: optimizer_steps}",
        crash_at=27,
    )


@pytest.mark.slow
def test_an_interleave_with_probabilities_resumes_exactly(tmp_path):
    """``interleave_datasets(..., probabilities, seed)`` then ``.shuffle(seed, buffer_size=1)``, resumed
    from its first state (one micro-step in). The interleave's generator is datasets' own: datasets
    copies it as a pass begins, and early in a pass parts of its saved state are still the fresh
    copy's. syncpoint reseeded every generator it reached from the stream in each draw, that one
    included, so the copy made in the first draw after the resume differed from the one the
    uninterrupted run made in its first draw, and the resumed run read other examples."""
    _reference_and_resumed(
        tmp_path,
        "task.path=tests.stream_tasks:composed",
        "task.config.interleave=true",
        "task.config.probabilities=true",
        "task.config.shuffle=shards",
        "train.stream_shuffle_buffer=0",
        "train.grad_accum=1",
        "train.max_steps=40",  # into the second pass: datasets' own bookkeeping then matches too (digest)
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        crash_at=1,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,loader_workers,shards",
    [(1, 2, 4), (2, 3, 3)],  # 3 shards on 2 ranks: split by example
)
def test_the_datasets_shuffle_recipe_resumes_exactly_with_loader_workers(tmp_path, world, loader_workers, shards):
    """``load_dataset(..., streaming=True).shuffle(seed, buffer_size)``, the recipe of datasets' docs,
    read by DataLoader workers (refused before: datasets loads a worker's saved state into the whole
    pipeline first, where its shard interleave, one entry per shard the worker reads, does not fit)
    trains and resumes bit for bit."""
    ref, _ = _reference_and_resumed(
        tmp_path,
        "task.path=tests.stream_tasks:hf_buffer_shuffled",
        "train.stream_shuffle_buffer=0",
        f"train.dataloader_workers={loader_workers}",
        f"task.config.shards={shards}",
        world=world,
    )
    assert trainer_json(ref, state_names(ref)[-1])["data"]["stream"]["shuffle_buffer"] == 8


@pytest.mark.slow
def test_hf_shard_order_shuffle_resumes_exactly(tmp_path):
    """datasets' .shuffle(seed, buffer_size=1) only reorders shards (per pass, through set_epoch): its
    state_dict carries that exactly, so it stays allowed (without DataLoader workers)."""
    corpus = tmp_path / "corpus"
    ref, _ = _reference_and_resumed(tmp_path, "task.config.shard_shuffle=true", "task.config.shard_shuffle_seed=5")
    unshuffled = stream_spec(tmp_path / "unshuffled", corpus)
    run(unshuffled)
    assert _losses(unshuffled) != _losses(ref)  # the premise: the shards were read in another order


@pytest.mark.slow
def test_an_interleaved_stream_with_probabilities_resumes_exactly(tmp_path):
    """interleave_datasets(probabilities=..., seed=...) keeps a NumPy PCG64 state in its own state: 128-bit
    integers, which the stream file holds and reads back. Crashed and resumed from its newest state, it is
    the uninterrupted run."""
    corpus = tmp_path / "corpus"
    task = "task.path=tests.stream_tasks:hf_interleaved"
    ref = stream_spec(tmp_path / "ref", corpus, task)
    run(ref)
    spec = stream_spec(tmp_path / "run", corpus, task)
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 15, mode: raise}]"))
    newest = state_names(spec)[-1]
    saved = parse(RunStorage(spec.run_url).read_bytes("states", newest, stream_file(0), limit=1 << 30), "stream")
    assert _largest_int(saved.loader) >= 2**64  # the premise: wider than any counter
    assert run(spec).resumed_from == newest
    _assert_same_run(ref, spec)


def _largest_int(tree: object) -> int:
    if isinstance(tree, dict):
        return max([_largest_int(v) for v in tree.values()], default=0)
    if isinstance(tree, (list, tuple)):
        return max([_largest_int(v) for v in tree], default=0)
    return abs(tree) if isinstance(tree, int) and not isinstance(tree, bool) else 0


# ----------------------------------------------------------------------------- refused at start


def _task(path: str, corpus, *overrides: str):
    from syncpoint.workers.task import load_task

    spec = stream_spec("/nonexistent", corpus, f"task.path={path}", *overrides)
    return spec, load_task(spec.task.path, spec.task.config)


def test_datasets_own_buffer_shuffle_does_not_resume_exactly(tmp_path):
    """Why it is refused (datasets 5.2, huggingface/datasets#7444): its state_dict holds no buffer
    content, so a resumed iteration refills the buffer and yields other examples than the
    uninterrupted one. Should a datasets release fix this, this test fails: the refusal can go."""
    from datasets import load_dataset

    from examples.stream_lm import corpus_files

    files = corpus_files(str(tmp_path / "corpus"), "jsonl", 4, 12, 24)
    ds = load_dataset("json", data_files=files, split="train", streaming=True).shuffle(seed=3, buffer_size=8)
    it = iter(ds)
    [next(it) for _ in range(7)]
    state = ds.state_dict()
    rest = [next(it)["id"] for _ in range(10)]
    again = load_dataset("json", data_files=files, split="train", streaming=True).shuffle(seed=3, buffer_size=8)
    again.load_state_dict(state)
    assert [x["id"] for _, x in zip(range(10), again, strict=False)] != rest


def test_datasets_buffer_shuffle_is_taken_over_by_syncpoints_buffer(tmp_path):
    """A .shuffle(seed, buffer_size) keeps its shard-order part in datasets (buffer_size 1) and its buffer
    moves to syncpoint's saved one, drawn from the shuffle's generator; preparing the same object again
    (a restart in the same process) lifts the same buffer."""
    from syncpoint.workers.data.stream_identity import HF_BUFFER_SHUFFLE, hf_pipeline, step_name

    spec, task = _task("tests.stream_tasks:hf_buffer_shuffled", tmp_path / "corpus", "train.stream_shuffle_buffer=0")
    first = prepare(spec, task.dataset, task.collate, 0, 1)
    again = prepare(spec, task.dataset, task.collate, 0, 1)
    (step,) = [s for s in hf_pipeline(task.dataset) if step_name(s) == HF_BUFFER_SHUFFLE]
    assert step.buffer_size == 1
    for prepared in (first, again):
        assert prepared.record["shuffle_buffer"] == 8 and prepared.stream.shuffle_buffer == 8
    assert first.stream.shuffle_salt == again.stream.shuffle_salt and len(first.stream.shuffle_salt) == 2
    assert first.record["identity"] == again.record["identity"] and len(first.record["identity"]["shuffle"]) == 1
    other_seed = load_task_with(spec, lambda ds: ds.shuffle(seed=4, buffer_size=8))
    assert (
        prepare(spec, other_seed, task.collate, 0, 1).record["identity"]["shuffle"]
        != first.record["identity"]["shuffle"]
    )


def load_task_with(spec, shuffled):
    """The example's unshuffled stream, shuffled by ``shuffled``."""
    from syncpoint.workers.task import load_task

    return shuffled(load_task("examples.stream_lm:build", spec.task.config).dataset)


def test_two_shuffle_buffers_are_refused_naming_both(tmp_path):
    spec, task = _task("tests.stream_tasks:hf_buffer_shuffled", tmp_path / "corpus")
    with pytest.raises(TaskError, match=r"train\.stream_shuffle_buffer: 5, and .*\.shuffle\(buffer_size=8\)"):
        prepare(spec, task.dataset, task.collate, 0, 1)
    twice = load_task_with(spec, lambda ds: ds.shuffle(seed=1, buffer_size=4).shuffle(seed=2, buffer_size=6))
    spec = with_overrides(spec, "train.stream_shuffle_buffer=0")
    with pytest.raises(TaskError, match=r"shuffled with 2 buffers \(buffer_size 6, 4\).*keep one"):
        prepare(spec, twice, task.collate, 0, 1)


@pytest.mark.slow
def test_datasets_buffer_shuffle_resumes_exactly_and_refuses_another_seed_or_size(tmp_path, caplog):
    """The same .shuffle(seed, buffer_size) crashed and resumed is the uninterrupted run; it reads in
    another order than the unshuffled stream; another seed or buffer size is refused at selection."""
    corpus = tmp_path / "corpus"
    ref, spec = _reference_and_resumed(
        tmp_path, "task.path=tests.stream_tasks:hf_buffer_shuffled", "train.stream_shuffle_buffer=0"
    )
    assert trainer_json(spec, state_names(spec)[-1])["data"]["stream"]["shuffle_buffer"] == 8
    assert "without the buffer content" not in caplog.text  # datasets' note: syncpoint's buffer is saved
    unshuffled = stream_spec(tmp_path / "unshuffled", corpus, "train.stream_shuffle_buffer=0")
    run(unshuffled)
    assert _losses(unshuffled) != _losses(ref)
    with pytest.raises(ResumeRefused, match=r"its \.shuffle\(seed=\.\.\.\) differs"):
        run(with_overrides(spec, "train.max_steps=20", "task.config.hf_shuffle_seed=4"))
    with pytest.raises(ResumeRefused, match=r"shuffle buffer differs .*Restore a buffer of 8"):
        run(with_overrides(spec, "train.max_steps=20", "task.config.hf_buffer=16"))


@pytest.mark.slow
def test_a_datasets_streams_epoch_is_set_in_the_loop_process_never_in_a_loader_worker(tmp_path, monkeypatch):
    """datasets keeps a stream's epoch in one shared-memory tensor and sets it with a read-modify-write:
    two DataLoader workers setting it at once left a pass at the wrong epoch (5 passes of 30 in one
    probe), whose shard order (reshuffled every epoch) then differed between runs. RankStream sets it
    in the loop's process only, before each pass's workers start, so every worker reads the pass."""
    import os

    from datasets import IterableDataset

    calls = tmp_path / "set_epoch_calls"
    original = IterableDataset.set_epoch

    def recording(self, epoch):
        with open(calls, "a") as f:  # forked workers inherit this patch: each call says where it ran
            f.write(f"{os.getpid()} {epoch}\n")
        return original(self, epoch)

    monkeypatch.setattr(IterableDataset, "set_epoch", recording)
    spec, task = _task("examples.stream_lm:build", tmp_path / "corpus", "train.dataloader_workers=2")
    prepared = prepare(spec, task.dataset, task.collate, 0, 1)
    source = StreamSource(prepared, seed=spec.train.seed, rank=0, num_workers=2, saved=None)
    try:
        for _ in range(3 * 24 + 1):  # three passes of 24 micro-batches, into the fourth
            source.next_batch()
    finally:
        source.close()
    assert source.pass_number == 3
    seen = [line.split() for line in calls.read_text().splitlines()]
    assert {pid for pid, _ in seen} == {str(os.getpid())}, seen  # never in a worker
    assert [int(e) for _, e in seen] == [0, 1, 2, 3]  # once per pass, before it
    assert int(prepared.stream.inner.epoch) == 3


def test_a_stream_already_split_by_the_task_is_refused(tmp_path):
    spec, task = _task("tests.stream_tasks:hf_already_split", tmp_path / "corpus")
    with pytest.raises(TaskError, match="already split with split_dataset_by_node: return the whole stream"):
        prepare(spec, task.dataset, task.collate, 0, 1)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (("train.max_steps=null", "train.epochs=2"), r"train\.epochs: .*Set train\.max_steps"),
        (("train.epochs=2",), r"train\.epochs: .*which has no length"),
        (("train.scheduler={type: linear, unit: epochs, total: 2}",), r"train\.scheduler\.unit: .*which has no epochs"),
        (("train.eval_every=1 epochs",), r"train\.eval_every: .*which has no epochs"),
        (("scaling.num_workers={min: 1, max: 2}",), r"scaling\.num_workers: .*set a fixed scaling\.num_workers"),
        (("train.record_samples=true",), r"train\.record_samples: .*no index"),
    ],
)
def test_a_stream_job_that_cannot_resume_exactly_is_refused_naming_the_field(tmp_path, overrides, field):
    spec = stream_spec(tmp_path / "run", tmp_path / "corpus", *overrides)
    with pytest.raises(JobConfigError, match=field):
        check_spec(spec)


def test_stream_fields_on_a_map_style_dataset_are_refused(tmp_path):
    from syncpoint.workers.task import load_task
    from syncpoint.workers.training.loop import _prepare_stream

    spec = linear_spec(tmp_path, "train.stream_shuffle_buffer=4")
    with pytest.raises(JobConfigError, match=r"train\.stream_shuffle_buffer: applies to stream datasets"):
        _prepare_stream(spec, load_task(spec.task.path, spec.task.config), 0, 1)


def test_a_custom_stream_without_split_is_refused_on_two_ranks(tmp_path):
    from tests.stream_tasks import CountingStream

    class Whole(CountingStream):
        split = None

    spec = linear_spec(tmp_path, "train.max_steps=2", "train.epochs=null")
    with pytest.raises(TaskError, match=r"without split\(rank, world_size\): on 2 workers each rank needs"):
        prepare(spec, Whole(8), None, 0, 2)


@pytest.mark.slow
def test_a_stream_state_that_is_not_json_or_tensors_is_refused_at_the_first_save(tmp_path):
    spec = linear_spec(
        tmp_path,
        "task.path=tests.stream_tasks:counting_stream",
        "task.config.bad_state=true",
        "train.max_steps=4",
        "train.epochs=null",
        "checkpoint.save_every={value: 2, unit: optimizer_steps}",
    )
    with pytest.raises(StreamStateError) as e:
        run(spec)
    assert re.search(
        r"rank 0: the stream's state holds a builtins\.set at state\[.*\]\['seen'\].*never pickled", str(e.value)
    ), str(e.value)
    assert committed_steps(spec) == []


# ----------------------------------------------------------------------------- selection


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    """One committed streaming run on one rank (states at micro-steps 6, 12, ..., 28)."""
    tmp = tmp_path_factory.mktemp("stream_run")
    spec = stream_spec(tmp / "run", tmp / "corpus")
    run(spec)
    return spec


def _candidate(spec, name: str) -> Candidate:
    storage = RunStorage(spec.run_url)
    manifest = json.loads(storage.read_bytes("states", name, MANIFEST_FILE, limit=1 << 20))
    listing = {rel: e["size"] for rel, e in manifest["files"].items()}
    return Candidate(name=name, trainer=trainer_json(spec, name), manifest=manifest, listing=listing)


@pytest.mark.slow
def test_a_world_size_change_of_a_stream_is_incompatible_at_selection(stream_run):
    name = state_names(stream_run)[-1]
    c = _candidate(stream_run, name)
    exp = LiveJob(TrainState.model_validate(c.trainer).identity())
    assert classify(c, exp).verdict is Verdict.RESUMABLE

    c = classify(c, changed(exp, world_size=2, grad_accum=1))
    assert c.verdict is Verdict.INCOMPATIBLE
    assert re.search(
        r"world size differs \(scaling\.num_workers\): the state has world_size=1, this run has 2\. A "
        r"stream's position is each rank's own.*no stream re-splits exactly.*Resume on 1 worker",
        c.reason,
    ), c.reason


@pytest.mark.slow
def test_a_stream_state_is_incompatible_with_a_map_style_run_and_with_other_loader_workers(stream_run):

    c = _candidate(stream_run, state_names(stream_run)[-1])
    exp = LiveJob(TrainState.model_validate(c.trainer).identity())
    map_style = classify(c, changed(exp, stream=None, sampler=SAMPLER_VERSION))
    assert map_style.verdict is Verdict.INCOMPATIBLE and "data kind differs" in map_style.reason
    workers = classify(c, changed(exp, stream={**exp.identity.data.stream.model_dump(), "dataloader_workers": 2}))
    assert workers.verdict is Verdict.INCOMPATIBLE
    assert "Restore train.dataloader_workers: 0" in workers.reason


@pytest.mark.slow
def test_a_stream_state_without_its_stream_files_is_incomplete(stream_run):
    c = _candidate(stream_run, state_names(stream_run)[-1])
    del c.manifest["files"][stream_file(0)]
    c = classify(c, None)
    assert c.verdict is Verdict.CORRUPT and f"incomplete: the manifest lacks {stream_file(0)}" in c.reason


@pytest.mark.slow
def test_a_changed_corpus_is_refused_at_selection_naming_the_file(tmp_path):
    """A moved corpus (the same files elsewhere) resumes; a rewritten one is another stream."""
    corpus, moved = tmp_path / "corpus", tmp_path / "moved"
    spec = stream_spec(tmp_path / "run", corpus, "train.max_steps=3")
    run(spec)
    shutil.move(corpus, moved)
    assert run(stream_spec(tmp_path / "run", moved, "train.max_steps=6")).resumed_from == "000000000006"
    with pytest.raises(ResumeRefused) as e:
        run(stream_spec(tmp_path / "run", corpus, "train.max_steps=9", "task.config.docs_per_shard=13"))
    assert re.search(
        r"incompatible\s+the stream differs \(the task's dataset\): data file 0: 'shard_000\.jsonl' "
        r"\(\d+ bytes\) in the state, 'shard_000\.jsonl' \(\d+ bytes\) in this run",
        str(e.value),
    ), str(e.value)


@pytest.mark.slow
def test_a_changed_map_function_is_refused_at_selection_naming_its_step(tmp_path, monkeypatch):
    """A ``.map`` whose result changed (here: a module-level value it reads) makes other examples at the
    same position: the state is another stream's. Unchanged, the same task resumes."""
    from tests import stream_tasks

    spec = stream_spec(tmp_path / "run", tmp_path / "corpus", "task.path=tests.stream_tasks:hf_offset_mapped")
    run(with_overrides(spec, "train.max_steps=3"))
    assert run(with_overrides(spec, "train.max_steps=6")).resumed_from == "000000000006"
    monkeypatch.setattr(stream_tasks, "OFFSET", 1)
    with pytest.raises(ResumeRefused) as e:
        run(with_overrides(spec, "train.max_steps=9"))
    assert re.search(
        r"incompatible\s+the stream differs \(the task's dataset\): its \.map/\.filter function 0 \(pipeline "
        r"step MappedExamplesIterable\) computes something else: .*digest [0-9a-f]{16} in the state, [0-9a-f]{16} "
        r"in this run\); to keep the weights with the new function, start a new run with resume\.init_from",
        str(e.value),
    ), str(e.value)


def test_a_state_written_before_functions_were_recorded_is_compared_on_the_rest():
    """Stream identities of earlier states have no ``functions``: they resume (compared on files and
    pipeline); a state that has them is compared on them too."""
    from syncpoint.policies.decisions.detail_compatibility import identity_difference as _identity_difference

    base = {"files": [{"name": "a.jsonl", "size": 3}], "pipeline": ["MappedExamplesIterable"]}
    now = {**base, "functions": [{"step": 0, "kind": "MappedExamplesIterable", "digest": "0" * 16}]}
    assert _identity_difference(base, now) is None
    assert _identity_difference(now, now) is None
    other = {**base, "functions": [{"step": 0, "kind": "MappedExamplesIterable", "digest": "1" * 16}]}
    assert "function 0 (pipeline step MappedExamplesIterable) computes something else" in str(
        _identity_difference(now, other)
    )


# ----------------------------------------------------------------------------- a bad stream file


def _rewrite(spec, name: str, rel: str, data: bytes) -> None:
    """Replace a state file and its manifest entry consistently: only its content is wrong."""
    storage = RunStorage(spec.run_url)
    storage.write_bytes(data, "states", name, rel)
    manifest = json.loads(storage.read_bytes("states", name, MANIFEST_FILE, limit=1 << 20))
    algo = manifest["checksum"]
    manifest["files"][rel] = entry(len(data), algo, checksum_bytes(data, algo)).record()
    storage.write_bytes(json_bytes(manifest), "states", name, MANIFEST_FILE)


@pytest.mark.slow
def test_a_corrupt_stream_state_falls_back_to_the_previous_state(tmp_path):
    corpus = tmp_path / "corpus"
    ref = stream_spec(tmp_path / "ref", corpus)
    run(ref)
    spec = stream_spec(tmp_path / "run", corpus)
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 15, mode: raise}]"))
    assert committed_steps(spec) == [6, 12]
    _rewrite(spec, "000000000012", stream_file(0), b"not a stream state")
    result = run(spec)
    assert result.resumed_from == "000000000006"
    _assert_same_run(ref, spec)


# ----------------------------------------------------------------------------- the codec


def test_the_stream_codec_round_trips_what_json_lacks():
    state = {
        "a": (1, 2.5, "x"),
        "b": {3: [True, None]},
        "t": torch.arange(6).reshape(2, 3),
        "raw": b"\x00\xff",
        "nested": [{"u": torch.tensor([1.5])}],
    }
    back = parse(encode(SavedStream(3, state)), "stream/rank_00000.safetensors")
    assert back.pass_number == 3
    assert back.loader["a"] == (1, 2.5, "x") and back.loader["b"] == {3: [True, None]}
    assert back.loader["raw"] == b"\x00\xff"
    assert torch.equal(back.loader["t"], state["t"]) and torch.equal(back.loader["nested"][0]["u"], torch.tensor([1.5]))


@pytest.mark.parametrize(
    "value,where",
    [
        ({1, 2}, r"builtins\.set at state\['k'\]"),
        (float("nan"), r"nan at state\['k'\]"),
        (object(), r"builtins\.object at state\['k'\]"),
        ({"__syncpoint_tensor__": 1}, r"key '__syncpoint_tensor__' at state\['k'\], which syncpoint reserves"),
    ],
)
def test_the_stream_codec_refuses_anything_else_naming_its_path(value, where):
    with pytest.raises(StreamStateError, match=where):
        encode(SavedStream(0, {"k": value}))


def _stream_file(meta: object, **tensors: torch.Tensor) -> bytes:
    from safetensors.torch import save as st_save

    return st_save(tensors, metadata={"stream": json.dumps(meta)})


@pytest.mark.parametrize(
    "data,why",
    [
        (b"junk", "a safetensors header of"),
        (b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ", "no 'stream' metadata"),
        (_stream_file({"version": 9, "pass": 0, "loader": {}}), "stream state version 9"),
        (_stream_file({"version": 1, "pass": -1, "loader": {}}), "pass -1 is no count"),
        (_stream_file({"version": 1, "pass": 0, "loader": {"t": {"__syncpoint_tensor__": "7"}}}), "names no tensor"),
        (_stream_file({"version": 1, "pass": 0, "loader": {}}, **{"0": torch.zeros(1)}), "referenced nowhere"),
        (_stream_file([1] * 3), "not a stream state"),
    ],
)
def test_a_bad_stream_file_is_refused(data, why):
    with pytest.raises(StateRefused, match=re.escape(why)):
        parse(data, "stream/rank_00000.safetensors")


# ----------------------------------------------------------------------------- the rank's stream itself


def _examples(stream: RankStream, passes: int = 1) -> list[list[int]]:
    out = []
    for p in range(passes):
        stream.set_epoch(p)
        out.append([int(i) for batch in stream for i in batch["id"]])
    return out


class _Ids(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n, self.at = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.at = 0

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]

    def __iter__(self):
        while self.at < self.n:
            self.at += 1
            yield {"id": torch.tensor(self.at - 1)}


def test_the_shuffle_buffer_reorders_every_pass_and_keeps_every_example():
    def stream(buffer: int) -> RankStream:
        return RankStream(_Ids(20), seed=1, rank=0, micro_batch_size=2, collate=None, shuffle_buffer=buffer)

    assert _examples(stream(0), 2) == [list(range(20))] * 2
    first, second = _examples(stream(6), 2)
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != list(range(20)) and first != second
    assert _examples(stream(6), 2) == [first, second]  # a function of (seed, rank, pass): the same again


def test_a_stream_source_resumes_mid_buffer_to_the_same_batches():
    """Without DeepSpeed: a source's capture, parsed back, continues with the very batches the
    uninterrupted source yields next, shuffle buffer and pass boundary included."""
    from syncpoint.workers.data.stream import PreparedStream

    def source(saved=None):
        stream = RankStream(_Ids(11), seed=4, rank=0, micro_batch_size=2, collate=None, shuffle_buffer=4)
        return StreamSource(PreparedStream(stream, {}, None), seed=4, rank=0, num_workers=0, saved=saved)

    whole = source()
    ids = [whole.next_batch()["id"].tolist() for _ in range(3)]
    saved = parse(whole.capture(), "stream/rank_00000.safetensors")
    rest = [whole.next_batch()["id"].tolist() for _ in range(6)]  # a pass is 5 micro-batches
    resumed = source(saved)
    assert [resumed.next_batch()["id"].tolist() for _ in range(6)] == rest
    assert ids and whole.pass_number == resumed.pass_number == 1


def test_the_example_streams_parquet_shards_too(tmp_path):
    spec, task = _task("examples.stream_lm:build", tmp_path / "corpus", "task.config.format=parquet")
    prepared = prepare(spec, task.dataset, task.collate, 1, 2)
    assert [f["name"] for f in prepared.record["identity"]["files"]] == [f"shard_{i:03d}.parquet" for i in range(4)]
    source = StreamSource(prepared, seed=spec.train.seed, rank=1, num_workers=0, saved=None)
    batches = [source.next_batch() for _ in range(13)]  # rank 1's 2 shards are 12 micro-batches: a second pass
    assert all(b.shape == (2, 9) for b in batches) and source.pass_number == 1


def test_spec_fields_parse():
    spec = resolve_storage(
        parse_spec(
            "name: x\ntask: {path: a.b:c}\ntrain: {micro_batch_size: 1, max_steps: 2, "
            "stream_shuffle_buffer: 8, stream_epoch_steps: 3}\n",
            "x",
            ["storage=/tmp/x"],
        )
    )
    assert spec.train.stream_shuffle_buffer == 8 and spec.train.stream_epoch_steps == 3


# ----------------------------------------------------------------------------- the drill, on Ray


def test_a_resume_inside_the_last_pass_ends_at_the_uninterrupted_digest(tmp_path):
    """Resumed at micro-step 54 of 60 (two ranks, the shuffle buffer, no loader workers), the run ends with
    every pass exhausted as the uninterrupted one does, but ``datasets`` left its inner shard index at the
    last shard's end instead of past it: a position the stream never reads again, which the digest leaves
    out (``digest.settled_stream``). Before, the drill of the streaming example reported a MISMATCH here
    with every loss equal (issue 48's note of 2026-12-06)."""
    common = ("train.max_steps=30", "train.dataloader_workers=0")
    ref = stream_spec(tmp_path / "ref", tmp_path / "corpus", *common, workers=2)
    _uninterrupted(ref, 2)
    spec = stream_spec(tmp_path / "run", tmp_path / "corpus", *common, workers=2)
    crashing = with_overrides(spec, "faults=[{rank: 1, at_micro_step: 55, mode: exit}]")
    assert run_spawned(crashing) != [0, 0] and state_names(spec)[-1] == f"{54:012d}"
    assert run_spawned(spec) == [0, 0]
    _assert_same_run(ref, spec)
