"""Manifest checksums: xxh3-128 by default, sha256 on request, older sha256 manifests still verify;
DeepSpeed's shards are checksummed while they are serialized (no second read)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import xxhash

from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, ManifestEntry
from syncpoint.workers.integrity.checksum import (
    ChecksummingWriter,
    checksum_bytes,
    entry,
    matches_entry,
    new_hasher,
)
from syncpoint.workers.state.checkpoint_engine import StreamingCheckpointEngine
from syncpoint.workers.storage import RunStorage
from tests.helpers import digest, linear_spec, run, run_until_crash, state_names

BASE = ("task.config.num_samples=16", "train.grad_accum=2", "checkpoint.save_every={value: 2, unit: optimizer_steps}")


class _Sink:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    "algo,ref",
    [("xxh3_128", lambda b: xxhash.xxh3_128(b).hexdigest()), ("sha256", lambda b: hashlib.sha256(b).hexdigest())],
)
def test_writer_checksums_what_it_passes_on(algo, ref):
    sink = _Sink()
    w = ChecksummingWriter(sink, algo)
    for chunk in (b"abc", bytearray(b"def" * 1000), memoryview(b"ghi")):
        w.write(chunk)
    data = b"".join(sink.parts)
    assert data == b"abc" + b"def" * 1000 + b"ghi"
    assert w.entry().record() == {"size": len(data), algo: ref(data)}
    assert w.entry() == entry(len(data), algo, checksum_bytes(data, algo))
    assert matches_entry(w.entry(), data)
    assert not matches_entry(w.entry(), data[:-1] + b"x") and not matches_entry(w.entry(), data + b"x")


def test_unknown_algorithms_are_refused():
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        new_hasher("md5")
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        ManifestEntry.of(3, "md5", "x")


def test_default_manifest_is_xxh3_and_shards_were_streamed(tmp_path):
    spec = linear_spec(tmp_path, *BASE)
    run(spec)
    store = RunStorage(spec.run_url)
    for name in state_names(spec):
        manifest = json.loads(store.read_bytes("states", name, "manifest.json", limit=MANIFEST_MAX_BYTES))
        assert manifest["checksum"] == "xxh3_128"
        for rel, info in manifest["files"].items():
            assert set(info) == {"size", "xxh3_128"}, rel
            assert matches_entry(
                ManifestEntry.model_validate(info), store.read_bytes("states", name, rel, limit=1 << 30)
            )


def test_engine_uses_the_streaming_checkpoint_engine(tmp_path, monkeypatch):
    """The shards reach storage through DeepSpeed's checkpoint-engine hook, not a staged copy."""
    import syncpoint.workers.state.writer as sw

    seen = []
    orig = sw.take_snapshot

    def spy(engine, *a, **kw):
        snap = orig(engine, *a, **kw)
        staged = [f for _, _, names in os.walk(snap.staging) for f in names]  # files written locally
        seen.append((type(engine.checkpoint_engine), kw.get("direct") is not None, dict(snap.files), staged))
        return snap

    monkeypatch.setattr(sw, "take_snapshot", spy)
    run(linear_spec(tmp_path, *BASE))
    assert seen and all(t is StreamingCheckpointEngine for t, *_ in seen)
    for _, direct, files, staged in seen:  # sync saves: shards already in storage, nothing staged
        assert direct and any(k.startswith("engine/") for k in files) and not staged


def test_sha256_on_request_resumes_and_detects_corruption(tmp_path, tmp_path_factory):
    ref = linear_spec(tmp_path_factory.mktemp("ref"), *BASE)
    ref_final = run(ref).final_state
    spec = linear_spec(tmp_path, *BASE, "checkpoint.checksum=sha256", "faults=[{at_micro_step: 11, mode: raise}]")
    assert run_until_crash(spec)
    store = RunStorage(spec.run_url)
    newest = state_names(spec)[-1]
    manifest = json.loads(store.read_bytes("states", newest, "manifest.json", limit=MANIFEST_MAX_BYTES))
    assert manifest["checksum"] == "sha256" and all(set(i) == {"size", "sha256"} for i in manifest["files"].values())
    shard = next(r for r in manifest["files"] if r.startswith("engine/"))
    data = bytearray(store.read_bytes("states", newest, shard, limit=1 << 30))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(bytes(data), "states", newest, shard)
    result = run(spec)
    assert result.resumed_from != newest and result.resumed_from in state_names(spec)
    assert result.final_state == ref_final and digest(spec, result.final_state) == digest(ref, ref_final)


def test_manifests_written_with_sha256_only_still_load(tmp_path):
    """States committed before xxh3 (every entry sha256, no 'checksum' key) resume as before."""
    spec = linear_spec(tmp_path, *BASE, "faults=[{at_micro_step: 11, mode: raise}]")
    assert run_until_crash(spec)
    store = RunStorage(spec.run_url)
    newest = state_names(spec)[-1]
    manifest = json.loads(store.read_bytes("states", newest, "manifest.json", limit=MANIFEST_MAX_BYTES))
    manifest.pop("checksum")
    manifest["files"] = {
        rel: {
            "size": i["size"],
            "sha256": hashlib.sha256(store.read_bytes("states", newest, rel, limit=1 << 30)).hexdigest(),
        }
        for rel, i in manifest["files"].items()
    }
    store.commit_bytes(json.dumps(manifest).encode(), "states", newest, "manifest.json")
    assert run(spec).resumed_from == newest


def test_upload_with_a_known_checksum_does_not_read_the_file_again(tmp_path):
    src = tmp_path / "staged.bin"
    src.write_bytes(b"x" * 1000)
    store = RunStorage(f"file://{tmp_path}/run")
    known = entry(1000, "xxh3_128", "recorded-while-serialized")
    assert store.upload_file(str(src), "a", "b.bin", known=known) == (1000, "recorded-while-serialized")
    assert store.read_bytes("a", "b.bin", limit=1 << 30) == src.read_bytes()
    assert store.upload_file(str(src), "a", "c.bin") == (1000, checksum_bytes(src.read_bytes(), "xxh3_128"))


def test_another_deepspeed_checkpoint_engine_is_refused_naming_the_field():
    """A deepspeed.config that selects DeepSpeed's fast/decoupled writer is refused before training."""
    import types

    from syncpoint.policies.contracts.errors import JobConfigError
    from syncpoint.workers.state.checkpoint_engine import install

    class FastWriter:  # stands in for DeepSpeed's FastCheckpointEngine (needs the async_io op to build)
        pass

    engine = types.SimpleNamespace(checkpoint_engine=FastWriter(), _config=None)
    with pytest.raises(
        JobConfigError,
        match=r"deepspeed\.config: selects DeepSpeed's FastWriter.*remove the "
        r"checkpoint-engine keys from deepspeed\.config",
    ):
        install(engine)
