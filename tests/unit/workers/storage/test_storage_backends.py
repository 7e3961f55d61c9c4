"""The storage backends behind ``RunStorage``: which store gets which backend, the best-effort
compare-and-swap of stores without conditional writes, links refused locally, and the
half-manifest rehearsal that fault injection writes through storage.

The lease's conditional writes on each store are exercised end to end in tests/integration/workers/storage/test_lease.py
(local, memory://) and tests/integration/workers/storage/test_lease_s3.py (s3:// against moto's server)."""

from __future__ import annotations

import os
import uuid

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from syncpoint.policies.contracts.spec import CrashFault
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.fsspec_backend import FsspecBackend
from syncpoint.workers.storage.local_backend import LocalBackend
from syncpoint.workers.supervision.faults import Faults, InjectedCrash


def _memory_url() -> str:
    return f"memory://backends-{uuid.uuid4().hex}"


def test_each_store_gets_its_backend(tmp_path):
    local = RunStorage(str(tmp_path / "run"))
    assert isinstance(local.backend, LocalBackend) and local.conditional_writes == "flock"
    assert RunStorage(f"file://{tmp_path}/run").conditional_writes == "flock"
    assert local.local_path("states", "x") == str(tmp_path / "run" / "states" / "x")
    memory = RunStorage(_memory_url())
    assert memory.conditional_writes == "process-lock" and memory.local_path("states") is None


def test_a_store_without_conditional_writes_compares_writes_and_reads_back():
    backend = FsspecBackend(MemoryFileSystem())  # only what every fsspec filesystem offers
    path = f"/backends-{uuid.uuid4().hex}/lease.json"
    assert backend.conditional_writes == "none"
    first = backend.write_if(b"first", path, expect=None, limit=1 << 30)
    assert first is not None and backend.write_if(b"again", path, expect=None, limit=1 << 30) is None
    assert backend.write_if(b"stale", path, expect="not-the-version", limit=1 << 30) is None
    second = backend.write_if(b"second", path, expect=first, limit=1 << 30)
    got = backend.read_versioned(path, limit=1 << 30)
    assert got is not None and (got.data, got.version, got.age_s) == (b"second", second, None)


def test_local_deletion_never_follows_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_bytes(b"{}")
    store = RunStorage(str(tmp_path / "run"))
    store.write_bytes(b"x", "states", "000000000004", "trainer.json")
    os.symlink(outside, tmp_path / "run" / "states" / "000000000008")
    assert store.is_link("states", "000000000008") and not store.is_link("states", "000000000004")
    assert store.entry_kinds("states") == {"000000000004": "dir", "000000000008": "link"}
    with pytest.raises(OSError):  # its parent is a link: refused, not followed
        store.remove("states", "000000000008", "manifest.json")
    with pytest.raises(OSError, match="symbolic link"):
        store.delete_tree("states", "000000000008")
    assert (outside / "manifest.json").exists()
    store.delete_tree("states", "000000000004")
    assert store.list_names("states") == ["000000000008"]


@pytest.mark.parametrize("at_save,fires", [(1, True), (2, False)])
def test_the_half_manifest_rehearsal_writes_half_under_the_temp_name_only_when_it_fires(at_save, fires):
    store = RunStorage(_memory_url())
    faults = Faults([CrashFault(phase="during_manifest", at_save=at_save, mode="raise")], store, rank=0)
    faults.save_started()
    manifest = b'{"format": "syncpoint-state/1", "files": {}}'
    if fires:
        with pytest.raises(InjectedCrash):
            faults.during_manifest(store, manifest, "states", "000000000004", "manifest.json")
        half = store.read_bytes("states", "000000000004", "manifest.json.tmp", limit=1 << 30)
        assert half == manifest[: len(manifest) // 2]
    else:
        faults.during_manifest(store, manifest, "states", "000000000004", "manifest.json")
        assert store.listing("states").files == {}
    assert not store.exists("states", "000000000004", "manifest.json")
