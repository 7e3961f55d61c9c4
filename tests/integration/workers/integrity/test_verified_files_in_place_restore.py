"""A local state is restored where it lies (``syncpoint.workers.integrity.verified_files``) and keeps every rule the
private copy gave: a changed byte, a symbolic link (to identical bytes, even), a path outside the
state and a file written after its checksum was verified are each refused; DeepSpeed is served only
the verified files; cleanup never deletes the state; and a run resumed this way (no temporary copy
made) ends bitwise where the uninterrupted run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from syncpoint.workers.integrity.verified_files import available
from syncpoint.workers.state.checkpoint_engine import StreamingCheckpointEngine
from syncpoint.workers.state.discovery import read_candidate
from syncpoint.workers.state.reader import ChecksumMismatch, StateRefused, fetch_state
from syncpoint.workers.storage import RunStorage
from tests.helpers import digest, run, with_overrides
from tests.integration.workers.integrity.test_safe_load_trust_load import MODEL, NEWEST, SHARD, _escaping_state

pytestmark = pytest.mark.skipif(not available(), reason="in-place reads need /proc/self/fd")


def _fetch(spec, **kwargs):
    store = RunStorage(spec.run_url)
    return fetch_state(store, read_candidate(store, NEWEST), 0, in_place=True, **kwargs)


def _state_dir(spec) -> str:
    path = RunStorage(spec.run_url).local_path("states", NEWEST)
    assert path is not None
    return path


def test_in_place_reads_the_state_where_it_lies_and_cleanup_leaves_it(crashed, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-copies"))  # a copy would land here (and fail)
    before = sorted(os.listdir(os.path.join(_state_dir(crashed), "engine")))
    fetched = _fetch(crashed)
    assert fetched.in_place and fetched.local_dir == _state_dir(crashed)
    assert fetched.verified is not None and set(fetched.verified) >= {MODEL, SHARD}
    fds = [f.fd for f in fetched.verified.values()]
    fetched.cleanup()
    assert sorted(os.listdir(os.path.join(_state_dir(crashed), "engine"))) == before  # nothing deleted
    for fd in fds:  # only our descriptors went
        with pytest.raises(OSError):
            os.fstat(fd)


def test_in_place_refuses_a_changed_byte(crashed):
    path = os.path.join(_state_dir(crashed), SHARD)
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatch, match="xxh3_128 does not match the manifest"):
        _fetch(crashed)


@pytest.mark.parametrize("linked", ["file", "directory"])
def test_in_place_refuses_a_symbolic_link_even_to_the_committed_bytes(crashed, tmp_path, linked):
    """The link's target holds exactly the committed bytes, so only the link rule can refuse it."""
    state = _state_dir(crashed)
    outside = tmp_path / "outside"
    outside.mkdir()
    if linked == "file":
        target = shutil.move(os.path.join(state, SHARD), outside / "shard.pt")
        os.symlink(target, os.path.join(state, SHARD))
        name = SHARD
    else:
        target = shutil.move(os.path.join(state, "engine"), outside / "engine")
        os.symlink(target, os.path.join(state, "engine"))
        name = "engine/"
    with pytest.raises(StateRefused, match="symbolic link") as e:
        _fetch(crashed)
    assert str(e.value).startswith(name.rstrip("/")), e.value


def test_in_place_refuses_a_manifest_path_outside_the_state(tmp_path):
    store = RunStorage(str(tmp_path / "run"))
    (tmp_path / "run" / "states" / NEWEST / "engine").mkdir(parents=True)
    _escaping_state(store, NEWEST, "engine/../../elsewhere.pt", b"outside the state")
    with pytest.raises(StateRefused, match=r"has a '\.\.' segment"):
        fetch_state(store, read_candidate(store, NEWEST), 0, want_rng=False, in_place=True)


def test_a_file_written_after_its_checksum_was_verified_is_refused(crashed):
    fetched = _fetch(crashed)
    try:
        fetched.unchanged()  # nothing written yet
        path = os.path.join(_state_dir(crashed), SHARD)
        with open(path, "r+b") as f:  # the same byte written back: only the write itself is the change
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(byte)
        with pytest.raises(StateRefused, match=f"{SHARD} changed while it was being loaded"):
            fetched.unchanged()
    finally:
        fetched.cleanup()


def test_the_checkpoint_engine_serves_deepspeed_only_the_verified_files(crashed):
    fetched = _fetch(crashed)
    state = fetched.local_dir
    assert fetched.verified is not None
    engine = StreamingCheckpointEngine()
    try:
        with engine.serving(state, {MODEL: fetched.verified[MODEL].path}):
            with pytest.raises(StateRefused, match=f"{SHARD}: DeepSpeed asked for a file this rank did not verify"):
                engine.load(os.path.join(state, SHARD), map_location="cpu")
            first = engine.load(os.path.join(state, MODEL), map_location=lambda storage, loc: storage)
            again = engine.load(os.path.join(state, MODEL), map_location=lambda storage, loc: storage)
            third = engine.load(os.path.join(state, MODEL), map_location=lambda storage, loc: storage)
            assert again is first and third is not first  # a repeat read at once is served once from memory
            assert all(torch.equal(first["module"][k], third["module"][k]) for k in first["module"])
        with pytest.raises(FileNotFoundError):  # outside the block: DeepSpeed's paths as they are
            engine.load(os.path.join(state, "engine", "absent.pt"), map_location="cpu")
    finally:
        fetched.cleanup()


def test_a_local_resume_reads_in_place_and_is_bitwise(crashed, tmp_path, monkeypatch):
    ref = with_overrides(crashed, f"storage={tmp_path / 'ref'}", "faults=[]")
    ref_final = run(ref).final_state
    copies = tmp_path / "copies"
    copies.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(copies))  # where a private copy would be made
    result = run(with_overrides(crashed, "faults=[]"))
    assert result.resumed_from == NEWEST
    assert not [p for p in copies.iterdir() if p.name.startswith("syncpoint-load-")]
    assert result.final_state == ref_final
    assert digest(crashed, ref_final) == digest(ref, ref_final)
