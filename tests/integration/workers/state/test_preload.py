"""A restore from a download unpickles each verified DeepSpeed file on a second thread while the
next one downloads (``syncpoint.workers.state.preload``): only files already verified are
preloaded, DeepSpeed's reads take each result once (only when they ask for host memory), what
nobody took is dropped with the fetch's cleanup or its refusal, a state verified in place is not
preloaded, and a resume through the download path takes every preload and ends bitwise.
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch

from syncpoint.policies.contracts.state_format import local_path, rng_file
from syncpoint.workers.integrity.safe_load import load_state_file
from syncpoint.workers.integrity.verified_files import available
from syncpoint.workers.state import preload as preload_module
from syncpoint.workers.state.checkpoint_engine import StreamingCheckpointEngine
from syncpoint.workers.state.discovery import read_candidate
from syncpoint.workers.state.reader import StateRefused, fetch_state
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, digest, lm_spec, run, run_until_crash, with_overrides
from tests.integration.workers.integrity.test_safe_load_trust_load import MODEL, NEWEST, SHARD

pytestmark = pytest.mark.skipif(not available(), reason="in-place reads need /proc/self/fd")


def _fetch(spec, **kwargs):
    store = RunStorage(spec.run_url)
    return fetch_state(store, read_candidate(store, NEWEST), 0, own_shard=0, preload=True, **kwargs)


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_downloaded_engine_file_is_preloaded_and_taken_once(crashed):
    fetched = _fetch(crashed, in_place=False)
    assert fetched.preloads is not None and not fetched.in_place
    state = fetched.local_dir
    paths = {rel: os.path.join(state, rel) for rel in fetched.names}
    assert fetched.preloads.names == sorted(r for r in paths if r.startswith("engine/") and r.endswith(".pt"))
    assert {MODEL, SHARD} <= set(fetched.preloads.names)
    direct = {rel: load_state_file(paths[rel], rel) for rel in (MODEL, SHARD)}
    engine = StreamingCheckpointEngine()
    try:
        with engine.serving(state, paths, fetched.preloads):
            model = engine.load(os.path.join(state, MODEL), map_location=lambda storage, loc: storage)
            assert MODEL not in fetched.preloads.names  # taken, once
            assert _equal(model["module"], direct[MODEL]["module"])
            # a read that asks for another placement reads the file itself and leaves the preload
            mapped = engine.load(os.path.join(state, SHARD), map_location={"cuda:0": "cpu"})
            assert SHARD in fetched.preloads.names
            taken = engine.load(os.path.join(state, SHARD), map_location="cpu")
            assert SHARD not in fetched.preloads.names and taken is not mapped
            want = direct[SHARD]["optimizer_state_dict"]["single_partition_of_fp32_groups"]
            for saved in (mapped, taken):
                flat = saved["optimizer_state_dict"]["single_partition_of_fp32_groups"]
                assert all(torch.equal(a, b) for a, b in zip(flat, want, strict=True))
    finally:
        fetched.cleanup()
    assert fetched.preloads.names == [] and not os.path.exists(state)


def test_a_state_verified_in_place_is_not_preloaded(crashed):
    fetched = _fetch(crashed, in_place=True)
    try:
        assert fetched.in_place and fetched.preloads is None
    finally:
        fetched.cleanup()
    assert not [t for t in threading.enumerate() if t.name.startswith("syncpoint-preload")]


def test_a_refused_fetch_leaves_no_preload_running(crashed, monkeypatch):
    """A fetch that fails after some files were handed over (here: the RNG file's checksum) closes
    what it started: nothing is left unpickling once ``fetch_state`` has raised."""
    closed = []
    real_close = preload_module.Preloads.close

    def close(self):
        closed.append(self.names)
        real_close(self)

    monkeypatch.setattr(preload_module.Preloads, "close", close)
    rng_path = local_path(RunStorage(crashed.run_url).local_path("states", NEWEST) or "", rng_file(0))
    with open(rng_path, "ab") as f:
        f.write(b" ")
    with pytest.raises(StateRefused, match="changed after commit"):
        _fetch(crashed, in_place=False)
    assert {MODEL, SHARD} <= set(closed[0])  # handed over before the RNG file was read, then dropped
    assert not [t for t in threading.enumerate() if t.name.startswith("syncpoint-preload")]


@pytest.mark.parametrize(
    ("where", "stage"), [("local", 2), ("memory", 1), ("memory", 2), ("memory", 3)], ids=lambda v: str(v)
)
def test_a_resume_takes_every_preloaded_file_and_is_bitwise(tmp_path, monkeypatch, where, stage):
    """The download path (``memory://``) hands DeepSpeed the preloaded files: every one added is
    taken, none is left at cleanup, and nothing maps the fetched files once the fetch is cleaned up
    (the optimizer's moments, which it would keep as views of the mapped file, were copied); the
    in-place path (local storage) preloads none; every resumed run ends where the uninterrupted one
    ends, byte for byte."""
    import gc

    from syncpoint.workers.state import reader
    from syncpoint.workers.state.mapped_state import mapped_ranges

    added, left, mapped, copied = [], [], [], []
    real_add, real_close = preload_module.Preloads.add, preload_module.Preloads.close
    real_cleanup, real_copy = reader.FetchedState.cleanup, reader.copy_mapped_optimizer_state

    def cleanup(self):
        real_cleanup(self)
        gc.collect()
        mapped.append(len(mapped_ranges(self.local_dir)))

    def copy(engine, directory):
        copied.append(real_copy(engine, directory))
        return copied[-1]

    monkeypatch.setattr(reader.FetchedState, "cleanup", cleanup)
    monkeypatch.setattr(reader, "copy_mapped_optimizer_state", copy)

    def add(self, rel, path):
        added.append(rel)
        real_add(self, rel, path)

    def close(self):
        left.extend(self.names)
        real_close(self)

    monkeypatch.setattr(preload_module.Preloads, "add", add)
    monkeypatch.setattr(preload_module.Preloads, "close", close)
    root = tmp_path if where == "local" else f"memory://preload-{uuid.uuid4().hex}"
    overrides = (
        "task.config.num_samples=20",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        f"deepspeed.zero_stage={stage}",
    )
    crashed = lm_spec(f"{root}/run", *overrides, "faults=[{at_micro_step: 10, mode: raise}]")
    assert run_until_crash(crashed) and committed_steps(crashed) == [4, 8, 10]
    assert not added  # a fresh start restores nothing
    ref = lm_spec(f"{root}/ref", *overrides)
    ref_final = run(ref).final_state
    result = run(with_overrides(crashed, "faults=[]"))
    assert result.resumed_from == NEWEST
    model = MODEL if stage < 3 else "engine/zero_pp_rank_0_mp_rank_00_model_states.pt"
    shard = SHARD if stage < 3 else "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert (set(added) >= {model, shard} if where == "memory" else not added) and not left
    if where == "memory":  # the optimizer was handed views of the mapped file; none outlives the cleanup
        assert copied and copied[-1] > 0 and mapped == [0], (copied, mapped)
    assert result.final_state == ref_final
    assert digest(crashed, ref_final) == digest(ref, ref_final)
