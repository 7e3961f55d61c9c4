"""This node's memory copy of the newest committed state (``syncpoint.workers.state.memory_copy``), on a
run stored in S3 (moto's server on loopback):

* a restart on the same node restores from the copy, reads no state file from the object store,
  and ends bitwise where the uninterrupted run ends (sync and asynchronous saves);
* a copy with a changed byte, an older state's bytes, a missing file, or none at all, falls back
  to storage and says so; the resume is the same;
* a node keeps only the newest committed state; a finished run removes its copy;
* a shared-memory directory that is not this user's private one is never written or read, and a
  save goes on without a copy; local storage writes no copy (its states restore in place).
"""

from __future__ import annotations

import os

import pytest

import syncpoint.workers.state.downloads as state_downloads
from syncpoint.policies.contracts.state_format import rng_file
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.memory_copy import MEMORY_DIR_ENV, MemoryCopy, run_key
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, digest, linear_spec, run, run_until_crash, with_overrides
from tests.integration.workers.storage.test_s3_backend import RESUME_LAYOUT, assert_same_run
from tests.s3_server import BUCKET

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

NEWEST = f"{10:012d}"  # the crash at micro-step 13 leaves states 4, 8, 10 committed
CRASH = "faults=[{at_micro_step: 13, mode: raise}]"


@pytest.fixture
def shm(tmp_path, monkeypatch):
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setenv(MEMORY_DIR_ENV, str(base))
    return base


@pytest.fixture
def reference(tmp_path_factory):
    ref = linear_spec(tmp_path_factory.mktemp("ref"), *RESUME_LAYOUT)
    return ref, run(ref).final_state


@pytest.fixture
def downloads(monkeypatch):
    """Every state file this process downloads from storage for a restore."""
    seen: list[str] = []
    orig = state_downloads.download_verified

    def spy(storage, name, rel, entry, local):
        seen.append(f"{name}/{rel}")
        return orig(storage, name, rel, entry, local)

    monkeypatch.setattr(state_downloads, "download_verified", spy)
    return seen


def _run_dir(shm, spec) -> str:
    return os.path.join(shm, f"syncpoint-memory-{os.getuid()}", run_key(spec.run_url))


def _crashed(prefix: str, *extra: str):
    spec = linear_spec(f"s3://{BUCKET}/{prefix}", *RESUME_LAYOUT, *extra, CRASH)
    assert run_until_crash(spec)
    return spec


@pytest.fixture
def mappings(monkeypatch):
    """How many optimizer tensors each load copied out of its mapped files, and how many mappings of
    the fetched files were left once each fetch was cleaned up."""
    import gc

    from syncpoint.workers.state import reader
    from syncpoint.workers.state.mapped_state import mapped_ranges

    seen: dict[str, list[int]] = {"copied": [], "left": []}
    real_cleanup, real_copy = reader.FetchedState.cleanup, reader.copy_mapped_optimizer_state

    def cleanup(self):
        real_cleanup(self)
        gc.collect()
        seen["left"].append(len(mapped_ranges(self.local_dir)))

    def copy(engine, directory):
        seen["copied"].append(real_copy(engine, directory))
        return seen["copied"][-1]

    monkeypatch.setattr(reader.FetchedState, "cleanup", cleanup)
    monkeypatch.setattr(reader, "copy_mapped_optimizer_state", copy)
    return seen


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_a_restart_restores_from_the_nodes_memory_copy_bitwise(
    s3, shm, reference, downloads, mappings, capsys, save_mode
):
    """The copy's files are mapped, not read: the optimizer's moments DeepSpeed would keep as views
    of them are copied, and nothing maps the copy once the restore is done."""
    if save_mode == "async":  # crash right after the second save commits, however late its upload ends
        spec = linear_spec(
            f"s3://{BUCKET}/mem-async",
            *RESUME_LAYOUT,
            "checkpoint.async=true",
            "faults=[{phase: before_retention, at_save: 2, mode: raise}]",
        )
        assert run_until_crash(spec)
    else:
        spec = _crashed("mem-sync")
    assert committed_steps(spec), "no state committed before the crash"
    newest = f"{max(committed_steps(spec)):012d}"
    run_dir = _run_dir(shm, spec)
    assert sorted(os.listdir(run_dir))[0] == newest  # nothing older than the newest committed state is kept
    copied = {
        os.path.relpath(os.path.join(d, f), os.path.join(run_dir, newest))
        for d, _, names in os.walk(os.path.join(run_dir, newest))
        for f in names
    }
    assert "trainer.json" in copied and rng_file(0) in copied and any(p.startswith("engine/") for p in copied)
    assert oct(os.stat(os.path.dirname(run_dir)).st_mode & 0o777) == "0o700"
    capsys.readouterr()

    result = run(with_overrides(spec, "faults=[]"))
    out = capsys.readouterr().out
    assert result.resumed_from == newest
    assert f"restoring {newest} from this node's memory copy" in out, out
    assert downloads == []  # no state file came from the object store
    assert mappings["copied"] and mappings["copied"][-1] > 0 and mappings["left"] == [0], mappings
    ref, ref_final = reference
    assert_same_run(ref, ref_final, spec, result.final_state)
    assert not os.path.exists(run_dir)  # the run finished: its copy is gone


def test_a_changed_byte_in_the_copy_falls_back_to_storage_and_says_so(s3, shm, reference, downloads, capsys):
    spec = _crashed("mem-corrupt")
    engine_dir = os.path.join(_run_dir(shm, spec), NEWEST, "engine")
    victim = os.path.join(engine_dir, sorted(os.listdir(engine_dir))[0])
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(victim, "wb") as f:
        f.write(data)
    capsys.readouterr()

    result = run(with_overrides(spec, "faults=[]"))
    out = capsys.readouterr().out
    assert f"memory copy of {NEWEST} failed verification" in out and "restoring from storage" in out, out
    assert any(d.startswith(f"{NEWEST}/engine/") for d in downloads)
    assert result.resumed_from == NEWEST  # the state itself is sound: never called corrupt
    assert _restored_from(spec) == ["storage"]
    ref, ref_final = reference
    assert digest(spec, result.final_state) == digest(ref, ref_final)


def test_no_copy_on_this_node_restores_from_storage_and_says_so(s3, shm, reference, downloads, capsys):
    spec = _crashed("mem-missing")
    MemoryCopy(str(shm), spec.run_url).remove()  # as on a replacement node
    capsys.readouterr()
    result = run(with_overrides(spec, "faults=[]"))
    out = capsys.readouterr().out
    assert f"no memory copy of {NEWEST} on this node: restoring from storage" in out, out
    assert downloads and result.resumed_from == NEWEST
    ref, ref_final = reference
    assert digest(spec, result.final_state) == digest(ref, ref_final)


@pytest.mark.parametrize("stale", ["older", "dropped"])
def test_a_stale_or_incomplete_copy_falls_back_to_storage_and_says_so(s3, shm, reference, downloads, capsys, stale):
    """The copy under the newest state's name holds an older committed state's files (as a copy left
    from before a re-save would), or lacks one file (a write that met a full ``/dev/shm`` drops that
    file's copy, never the save): neither is used, and the resume is the same."""
    import fsspec

    spec = _crashed(f"mem-stale-{stale}")
    copy = os.path.join(_run_dir(shm, spec), NEWEST)
    files = sorted(os.path.relpath(os.path.join(d, f), copy) for d, _, names in os.walk(copy) for f in names)
    if stale == "older":
        older = f"{spec.run_url}/states/{8:012d}"
        for rel in files:
            with fsspec.open(f"{older}/{rel}", "rb") as src, open(os.path.join(copy, rel), "wb") as dst:
                dst.write(src.read())
    else:
        os.unlink(os.path.join(copy, next(rel for rel in files if rel.startswith("engine/"))))
    capsys.readouterr()

    result = run(with_overrides(spec, "faults=[]"))
    out = capsys.readouterr().out
    assert f"memory copy of {NEWEST} failed verification" in out and "restoring from storage" in out, out
    assert any(d.startswith(f"{NEWEST}/engine/") for d in downloads)
    assert result.resumed_from == NEWEST
    ref, ref_final = reference
    assert digest(spec, result.final_state) == digest(ref, ref_final)


def test_a_shared_directory_that_is_not_private_is_never_used_and_the_save_goes_on(s3, shm, reference, capsys):
    user_dir = shm / f"syncpoint-memory-{os.getuid()}"
    user_dir.mkdir(mode=0o777)
    os.chmod(user_dir, 0o777)  # another user could plant files here
    spec = _crashed("mem-open")
    assert os.listdir(user_dir) == []  # nothing was written into it
    capsys.readouterr()
    result = run(with_overrides(spec, "faults=[]"))
    out = capsys.readouterr().out
    assert "cannot be opened" in out and "not this user's private directory" in out, out
    ref, ref_final = reference
    assert digest(spec, result.final_state) == digest(ref, ref_final)


def test_a_planted_link_at_the_runs_copy_is_never_followed(s3, shm, tmp_path, capsys):
    spec = linear_spec(f"s3://{BUCKET}/mem-link", *RESUME_LAYOUT, CRASH)
    user_dir = shm / f"syncpoint-memory-{os.getuid()}"
    user_dir.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, user_dir / run_key(spec.run_url))
    assert run_until_crash(spec)
    assert os.listdir(elsewhere) == []  # the link was replaced, its target never written
    assert not os.path.islink(user_dir / run_key(spec.run_url))


def test_local_storage_and_off_write_no_copy(s3, shm, tmp_path):
    assert run_until_crash(linear_spec(tmp_path / "local", *RESUME_LAYOUT, CRASH))  # auto: restores in place
    assert run_until_crash(linear_spec(f"s3://{BUCKET}/mem-off", *RESUME_LAYOUT, "checkpoint.memory_copy=false", CRASH))
    assert not (shm / f"syncpoint-memory-{os.getuid()}").exists()


@pytest.mark.parametrize("plant", ["fifo", "link", "huge"])
def test_a_planted_entry_in_the_copy_is_never_read_through_and_storage_serves(
    s3, shm, reference, downloads, capsys, tmp_path, plant
):
    """Whoever can write this user's shared memory can plant a FIFO (a read would block), a link to
    another file, or a file far larger than the manifest says: each is refused without being read
    (or read past its listed size), and the rank restores from storage."""
    spec = _crashed(f"mem-plant-{plant}")
    engine_dir = os.path.join(_run_dir(shm, spec), NEWEST, "engine")
    victim = os.path.join(engine_dir, sorted(os.listdir(engine_dir))[0])
    os.unlink(victim)
    if plant == "fifo":
        os.mkfifo(victim)
    elif plant == "link":
        target = tmp_path / "elsewhere.pt"
        target.write_bytes(b"x" * 100)
        os.symlink(target, victim)
    else:
        with open(victim, "wb") as f:
            f.truncate(1 << 40)  # sparse: 1 TiB listed, nothing to read
    capsys.readouterr()
    result = run(with_overrides(spec, "faults=[]"))
    out = capsys.readouterr().out
    assert f"memory copy of {NEWEST} failed verification" in out and "restoring from storage" in out, out
    assert any(d.startswith(f"{NEWEST}/engine/") for d in downloads)
    ref, ref_final = reference
    assert digest(spec, result.final_state) == digest(ref, ref_final)


def test_two_ranks_on_one_node_both_restore_from_its_copy(s3, shm, tmp_path):
    """Each rank writes its own files; the node's copy is the whole state, and both ranks load it
    (where each read it, from the run's own record: a forked rank's output goes where its fork
    server's goes, which an earlier test may have started)."""
    from syncpoint.workers.supervision.launch import run_spawned

    layout = (*RESUME_LAYOUT, "train.grad_accum=2")  # 2 ranks x 1 x 2 = 4 samples per optimizer step
    ref = linear_spec(tmp_path / "ref", *layout, workers=2)
    assert run_spawned(ref) == [0, 0]
    ref_final = f"{max(committed_steps(ref)):012d}"
    spec = linear_spec(f"s3://{BUCKET}/mem-two", *layout, "faults=[{at_micro_step: 8, mode: raise}]", workers=2)
    assert run_spawned(spec)[0] != 0
    newest = f"{max(committed_steps(spec)):012d}"
    copied = os.listdir(os.path.join(_run_dir(shm, spec), newest, "engine"))
    assert len([f for f in copied if "optim_states" in f]) == 2, copied  # both ranks' optimizer shards
    assert run_spawned(with_overrides(spec, "faults=[]")) == [0, 0]
    resumed = EventLog(RunStorage(spec.run_url)).journal().attempts[-1]
    assert (resumed.resumed_from, resumed.restored_from) == (newest, ["memory", "memory"]), resumed
    assert digest(spec, f"{max(committed_steps(spec)):012d}") == digest(ref, ref_final)


def test_an_elastic_zero_runs_staged_optimizer_files_are_copied_and_it_restores_from_memory(s3, shm, downloads, capsys):
    """Elastic ZeRO saves also stage the gathered optimizer state (``optim/``) and upload it; the
    node's copy holds those files too, so a same-size restart needs nothing from the object store."""
    spec = _crashed("mem-elastic", "scaling.num_workers={min: 1, max: 2}")
    newest = f"{max(committed_steps(spec)):012d}"
    state = os.path.join(_run_dir(shm, spec), newest)
    assert os.listdir(os.path.join(state, "optim")), "the staged optimizer state was not copied"
    capsys.readouterr()
    result = run(with_overrides(spec, "faults=[]"))
    out = capsys.readouterr().out
    assert result.resumed_from == newest
    assert f"restoring {newest} from this node's memory copy" in out, out
    assert downloads == []


def _restored_from(spec) -> list[str]:
    """Where the newest attempt's ranks read the state it resumed, as its start event records it."""
    return EventLog(RunStorage(spec.run_url)).journal().attempts[-1].restored_from
