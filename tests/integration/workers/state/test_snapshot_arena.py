"""Async saves block only for a copy: the snapshot arena (``syncpoint.workers.state.snapshot_arena``) and the
checkpoint engine's capture/serialize split (``syncpoint.workers.state.checkpoint_engine``).

What is written must be the state at save time, bit for bit, whatever training does after
``save()`` returns; the host buffers are reused (same memory) save after save."""

from __future__ import annotations

import contextlib
import io
import math
import os
import time

import pytest
import torch

from syncpoint.workers.integrity.checksum import ChecksummingWriter, matches_entry
from syncpoint.workers.integrity.safe_load import load_state_file
from syncpoint.workers.state.checkpoint_engine import StreamingCheckpointEngine, write_captured
from syncpoint.workers.state.snapshot_arena import SnapshotArena
from syncpoint.workers.storage import RunStorage
from tests.helpers import lm_spec, run


class Config:
    """Stands for the config objects DeepSpeed puts in its state dicts."""

    def __init__(self) -> None:
        self.lr, self.betas = 0.1, [0.9, 0.99]


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    return {
        "module": {
            "w": w,
            "tied": w.detach(),
            "b": torch.randn(32, generator=g).bfloat16(),
            "mask": torch.rand(7, generator=g) > 0.5,
            "t": torch.randn(8, 6, generator=g).t(),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(64, 32, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "empty": torch.empty(0, 3),
        "global_steps": 12,
        "names": ["w", "b"],
        "ds_config": Config(),
    }


def _clone(obj):
    return torch.load(io.BytesIO(_bytes(obj)), weights_only=False)


def _bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _assert_bitwise(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bitwise(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bitwise(x, y)
    elif isinstance(a, Config):
        assert vars(a) == vars(b)
    else:
        assert a == b


def _tensor_ptrs(obj) -> list[int]:
    if isinstance(obj, torch.Tensor):
        return [obj.data_ptr()]
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in _tensor_ptrs(v)]
    if isinstance(obj, (list, tuple)):
        return [p for v in obj for p in _tensor_ptrs(v)]
    return []


def test_the_arena_is_reused_across_saves_of_the_same_shapes():
    arena, state = SnapshotArena(chunk_bytes=1 << 16), _state()
    ptrs = []
    for _ in range(3):
        arena.begin()
        ptrs.append(_tensor_ptrs(arena.capture(state)))
        arena.end_copies()
        arena.release()
    assert ptrs[0] == ptrs[1] == ptrs[2]  # the same host memory every save: no fresh pages, no growth
    assert arena.capacity == 1 << 16 and len(arena.chunks) == 1
    chunk = arena.chunks[0].owner
    lo, hi = chunk.data_ptr(), chunk.data_ptr() + chunk.numel()
    assert all(lo <= p < hi for p in ptrs[0] if p)


def test_the_arena_grows_only_when_the_state_grows():
    arena = SnapshotArena(chunk_bytes=1 << 12)
    small, big = {"x": torch.ones(256)}, {"x": torch.ones(256), "y": torch.ones(4096)}
    for state in (small, small, big, big, small):
        arena.begin()
        arena.capture(state)
        arena.release()
    assert arena.capacity == (1 << 12) + 4096 * 4  # one more chunk (the size of the big tensor), once


def test_no_reuse_while_a_save_is_still_being_written():
    arena = SnapshotArena()
    arena.begin()
    with pytest.raises(AssertionError, match="still being written"):
        arena.begin()
    arena.release()
    arena.begin()


def test_the_copy_has_the_same_values_types_and_sharing():
    state = _state()
    arena = SnapshotArena()
    arena.begin()
    copy = arena.capture(state)
    arena.end_copies()
    _assert_bitwise(state, copy)
    m = copy["module"]
    assert m["w"] is not m["tied"] and m["w"].untyped_storage().data_ptr() == m["tied"].untyped_storage().data_ptr()
    assert m["t"].is_contiguous() and m["b"].dtype == torch.bfloat16 and m["mask"].dtype == torch.bool
    assert isinstance(copy["ds_config"], Config) and copy["ds_config"] is not state["ds_config"]
    p = torch.nn.Parameter(torch.ones(3))
    pc = arena.capture({"p": p})["p"]
    assert isinstance(pc, torch.nn.Parameter) and pc.requires_grad and pc.data_ptr() != p.data_ptr()


def test_non_tensor_leaves_are_independent_copies():
    state = _state()
    arena = SnapshotArena()
    arena.begin()
    copy = arena.capture(state)
    state["names"].append("later")
    state["optimizer"]["param_groups"][0]["lr"] = 0.5
    state["ds_config"].betas[0] = 0.0
    state["module"]["extra"] = torch.ones(1)
    state["global_steps"] += 1
    assert copy["names"] == ["w", "b"] and copy["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert copy["ds_config"].betas == [0.9, 0.99] and "extra" not in copy["module"] and copy["global_steps"] == 12


def test_each_tensor_is_written_alone_not_its_whole_chunk():
    """torch.save writes a tensor's whole storage: each arena view has a storage of its own bytes."""
    state = {"a": torch.ones(1000), "b": torch.zeros(10)}
    arena = SnapshotArena(chunk_bytes=1 << 24)
    arena.begin()
    copy = arena.capture(state)
    assert copy["b"].untyped_storage().nbytes() == 40
    assert len(_bytes(copy)) == len(_bytes(state))


@contextlib.contextmanager
def _file_sink(root, rel):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        yield ChecksummingWriter(f, "xxh3_128")


def test_training_after_save_returns_does_not_change_what_is_written(tmp_path):
    """The engine's async path: save() copies and returns; the file, serialized afterwards while
    every tensor and container is mutated, equals a clone taken at save time, bit for bit."""
    ce, state = StreamingCheckpointEngine(), _state()
    root = str(tmp_path / "staging")
    with ce.capturing(root) as captured:
        ce.save(state, os.path.join(root, "engine", "mp_rank_00_model_states.pt"))
    at_save = _clone(state)
    with torch.no_grad():
        for t in (state["module"]["w"], state["module"]["t"], state["optimizer"]["state"][0]["exp_avg"]):
            t.add_(1.0)
        state["module"]["mask"].logical_not_()
        state["optimizer"]["state"][0]["step"] += 1
    state["names"].append("later")
    state["ds_config"].lr = 9.0
    assert ce.arena.busy
    files = write_captured(captured, lambda rel: _file_sink(tmp_path / "out", rel))
    ce.arena.release()
    path = tmp_path / "out" / "engine" / "mp_rank_00_model_states.pt"
    assert matches_entry(files["engine/mp_rank_00_model_states.pt"], path.read_bytes())
    _assert_bitwise(at_save, torch.load(path, weights_only=False))


def test_async_snapshot_of_a_real_engine_is_the_state_at_its_boundary(tmp_path, monkeypatch):
    """A real run (DeepSpeed ZeRO-2, checkpoint.async) whose staged copies come late (the upload
    thread sleeps before it makes them): at the first moment training may change the state again,
    right after the loop's wait before its next optimizer step, every parameter, fp32 master
    partition and Adam moment is changed in place, and the optimizer step follows; the committed
    files still hold the values of the boundary, bitwise."""
    import syncpoint.workers.state.writer as sw
    from syncpoint.workers.state.snapshot_arena import SnapshotArena

    seen: dict[str, dict] = {}
    mutated: set[str] = set()
    orig, orig_copies, orig_wait = sw.take_snapshot, SnapshotArena.end_copies, sw.StateWriter.wait_staged

    def take_and_record(engine, *a, **kw):
        snap = orig(engine, *a, **kw)
        if kw.get("direct") is not None:
            return snap  # the run's last save is synchronous: streamed, nothing staged
        assert snap.captured and not snap.files  # nothing serialized yet
        opt = engine.optimizer
        moments = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        seen[snap.name] = {
            "module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            "fp32": [t.detach().clone() for t in opt.single_partition_of_fp32_groups],
            "moments": [t.detach().clone() for t in moments],
        }
        return snap

    def late_copies(arena):
        time.sleep(0.3)
        orig_copies(arena)

    def wait_then_mutate(writer):
        snap = writer.upload.snap
        orig_wait(writer)
        if snap is None or snap.name not in seen or snap.name in mutated:
            return
        mutated.add(snap.name)
        opt = writer.engine.optimizer
        moments = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        with torch.no_grad():
            for t in [*writer.engine.module.parameters(), *opt.single_partition_of_fp32_groups, *moments]:
                t.add_(1.0)

    monkeypatch.setattr(SnapshotArena, "end_copies", late_copies)
    monkeypatch.setattr(sw.StateWriter, "wait_staged", wait_then_mutate)
    monkeypatch.setattr(sw, "take_snapshot", take_and_record)
    spec = lm_spec(
        tmp_path / "run",
        "task.config.num_samples=24",
        "train.grad_accum=2",
        "train.epochs=1",
        "checkpoint.save_every={value: 2, unit: micro_steps}",
        "checkpoint.async=true",
    )
    run(spec)
    assert seen and mutated
    store = RunStorage(spec.run_url)
    for name, ref in seen.items():
        assert store.exists("states", name, "manifest.json")
        model = load_state_file(
            store.read_bytes("states", name, "engine/mp_rank_00_model_states.pt", limit=1 << 30), name
        )
        _assert_bitwise(ref["module"], {k: model["module"][k] for k in ref["module"]})
        optim = load_state_file(
            store.read_bytes("states", name, "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt", limit=1 << 30), name
        )["optimizer_state_dict"]
        _assert_bitwise(ref["fp32"], optim["single_partition_of_fp32_groups"])
        saved = [
            t
            for s in optim["base_optimizer_state"]["state"].values()
            for t in s.values()
            if torch.is_tensor(t) and t.dim()
        ]
        _assert_bitwise(ref["moments"], saved)


def test_the_snapshots_finiteness_is_its_staged_tensors_not_its_buffers():
    """``SnapshotArena.finite``, which the upload thread asks on its copies: a NaN or an infinity in a
    parameter or a moment is seen (wherever it sits, in any floating dtype); a buffer (copied at
    once: what a forward changes) may hold -inf by design (a mask), and integers are not read."""
    arena = SnapshotArena(chunk_bytes=1 << 16)
    for bad in (math.nan, math.inf, -math.inf, None):
        for dtype in (torch.float32, torch.bfloat16):
            state = _state()
            mask = torch.full((4,), -math.inf)
            state["module"]["causal_mask"] = mask
            if bad is not None:
                state["optimizer"]["state"][0]["exp_avg"].view(-1)[1000] = bad
            state["module"]["b"] = state["module"]["b"].to(dtype)
            arena.begin()
            arena.capture(state, now=lambda t, mask=mask: t is mask)
            arena.end_copies()
            assert arena.finite() is (bad is None), (bad, dtype)
            arena.release()
