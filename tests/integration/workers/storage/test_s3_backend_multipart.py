"""Big files on S3 move as parallel multipart uploads and parallel ranged reads (moto's real S3
server on loopback, the ``s3`` fixture of ``tests/conftest.py``), with the part size forced down to
S3's minimum (5 MiB) through s3fs's own ``default_block_size`` so that a small state has many parts:

* the backend's streaming writer, ``upload_file`` and ``download_file`` move the exact bytes in
  several parts (the object's ETag says how many), checksummed on the way (a download hashes the
  bytes as it writes them, never reading the file back); an error aborts the multipart upload and
  leaves no object;
* a verified download skips botocore's response CRC (its bytes are checked against the manifest's
  checksum) on a client with every other setting of the run's, unless the user set that option;
* a multi-part state saved on S3 is bitwise the state of the same run on local disk, a run resumed
  from it on S3 ends bitwise where the uninterrupted run ends, and one changed byte inside one part
  is refused by the checksum before anything is loaded.
"""

from __future__ import annotations

import os

import fsspec
import pytest

from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, TRAINER_MAX_BYTES
from syncpoint.policies.decisions.candidates import Candidate
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.state.reader import ChecksumMismatch, _other_shard, fetch_state
from syncpoint.workers.storage import RunStorage, s3_backend
from tests.helpers import committed_steps, digest, run, run_until_crash
from tests.s3_server import BUCKET

s3fs = pytest.importorskip("s3fs")

PART = 5 << 20  # S3's smallest part


@pytest.fixture
def small_parts(s3, monkeypatch):
    """s3fs configured with 5 MiB parts, 3 in flight (new filesystems, this process and spawned ones)."""
    conf = dict(fsspec.config.conf["s3"], default_block_size=PART, max_concurrency=3)
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    monkeypatch.setenv("FSSPEC_S3_DEFAULT_BLOCK_SIZE", str(PART))
    monkeypatch.setenv("FSSPEC_S3_MAX_CONCURRENCY", "3")
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3
    s3fs.S3FileSystem.clear_instance_cache()


def _parts(client, key: str) -> int:
    """How many parts an object was uploaded in (1 for a single PUT), from its ETag."""
    etag = client.head_object(Bucket=BUCKET, Key=key)["ETag"].strip('"')
    return int(etag.split("-")[1]) if "-" in etag else 1


def test_backend_moves_exact_bytes_in_parallel_parts(small_parts, tmp_path):
    client = small_parts
    store = RunStorage(f"s3://{BUCKET}/parts")
    assert store.backend.part_size == PART and store.backend.concurrency == 3
    data = os.urandom(4 * PART + 12345)

    with store.open_durable("streamed.bin") as w:  # odd write sizes, as torch.save's
        for start, size in ((0, 100), (100, 3 * PART), (3 * PART + 100, 7), (3 * PART + 107, len(data))):
            w.write(data[start : start + size])
    assert w.entry().record() == {"size": len(data), "xxh3_128": checksum_bytes(data, "xxh3_128")}
    assert _parts(client, "parts/streamed.bin") == 5
    assert store.read_bytes("streamed.bin", limit=1 << 30) == data

    local = tmp_path / "local.bin"
    local.write_bytes(data)
    assert store.upload_file(str(local), "uploaded.bin") == (len(data), checksum_bytes(data, "xxh3_128"))
    assert _parts(client, "parts/uploaded.bin") == 5

    back = tmp_path / "back" / "x.bin"
    flight, most = [0], [0]
    get_chunks = s3_backend.S3Backend._get_chunks

    async def counted(self, *a, **k):
        flight[0] += 1
        most[0] = max(most[0], flight[0])
        try:
            return await get_chunks(self, *a, **k)
        finally:
            flight[0] -= 1

    with pytest.MonkeyPatch.context() as mp:  # the parts are hashed as they land: no read back
        mp.setattr(s3_backend, "checksum_file", lambda *a: pytest.fail("the downloaded file was read back"))
        mp.setattr(s3_backend.S3Backend, "_get_chunks", counted)
        got = store.download_file(str(back), "streamed.bin", limit=len(data))
    assert got == (len(data), checksum_bytes(data, "xxh3_128"))
    assert back.read_bytes() == data
    assert most[0] == 3  # a window of max_concurrency ranges in flight, never more
    piece = tmp_path / "back" / "piece.bin"  # a range across parts, from an offset inside one
    store.download_range(str(piece), "streamed.bin", start=PART + 7, end=3 * PART + 11, limit=len(data))
    assert piece.read_bytes() == data[PART + 7 : 3 * PART + 11]

    with store.open_durable("small.bin") as w:  # under one part: one PUT
        w.write(b"tiny")
    assert _parts(client, "parts/small.bin") == 1 and store.read_bytes("small.bin", limit=1 << 30) == b"tiny"

    with pytest.raises(RuntimeError), store.open_durable("failed.bin") as w:
        w.write(data)
        raise RuntimeError("serialization failed")
    assert not store.exists("failed.bin")
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix="parts/").get("Uploads")


def test_verified_downloads_skip_botocores_crc_on_an_otherwise_identical_client(small_parts, monkeypatch):
    backend = RunStorage(f"s3://{BUCKET}/crc").backend
    verified = backend.verified_fs
    assert verified is not backend.fs
    assert verified.config_kwargs["response_checksum_validation"] == "when_required"
    assert (verified.default_block_size, verified.max_concurrency) == (PART, 3)
    assert verified.client_kwargs == backend.fs.client_kwargs  # the same endpoint

    conf = dict(fsspec.config.conf["s3"], config_kwargs={"response_checksum_validation": "when_supported"})
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    s3fs.S3FileSystem.clear_instance_cache()
    mine = RunStorage(f"s3://{BUCKET}/crc").backend.verified_fs
    assert mine.config_kwargs["response_checksum_validation"] == "when_supported"  # the user's choice stands


# An MLP of ~2.4M parameters (bench.p2_save_cost's task): model file ~9 MB (2 parts), the ZeRO-2
# optimizer shard ~28 MB (6 parts). 16 samples, accumulation 2: boundaries every 2 micro-steps.
MLP_LAYOUT = (
    "task.path=bench.p2_save_cost:build",
    "task.config={d_in: 256, width: 1024, depth: 1, num_samples: 16}",
    "train.grad_accum=2",
    "train.epochs=1",
    "deepspeed.zero_stage=2",
    "checkpoint.save_every={value: 2, unit: optimizer_steps}",
)


def test_multipart_state_is_bitwise_and_a_changed_part_is_refused(small_parts, tmp_path):
    from tests.helpers import linear_spec

    client = small_parts
    ref = linear_spec(tmp_path, *MLP_LAYOUT)
    ref_final = run(ref).final_state

    spec = linear_spec(f"s3://{BUCKET}/multipart", *MLP_LAYOUT, "faults=[{at_micro_step: 11, mode: raise}]")
    assert run_until_crash(spec)
    assert committed_steps(spec) == [4, 8]
    store = RunStorage(spec.run_url)
    manifest = store.read_json("states", f"{8:012d}", "manifest.json", limit=MANIFEST_MAX_BYTES)
    shard = next(rel for rel in manifest["files"] if rel.endswith("optim_states.pt"))
    key = f"multipart/linear/states/{8:012d}/{shard}"
    assert _parts(client, key) >= 5
    assert digest(spec, f"{8:012d}") == digest(ref, f"{8:012d}")  # the save is bitwise the local one

    result = run(spec)  # the restore reads the parts back with ranged GETs
    assert result.resumed_from == f"{8:012d}"
    assert result.final_state == ref_final
    assert digest(spec, ref_final) == digest(ref, ref_final)

    body = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[3 * PART + 17] ^= 0x01  # one bit inside the fourth part; the size is unchanged
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    cand = Candidate(
        name=f"{8:012d}",
        manifest=manifest,
        trainer=store.read_json("states", f"{8:012d}", "trainer.json", limit=TRAINER_MAX_BYTES),
    )
    with pytest.raises(ChecksumMismatch, match="does not match the manifest"):
        fetch_state(store, cand, 0)


def test_only_other_ranks_optimizer_shards_and_zero3_module_files_are_skipped():
    assert _other_shard("engine/zero_pp_rank_1_mp_rank_00_optim_states.pt", 0)
    assert _other_shard("engine/zero_pp_rank_1_mp_rank_00_model_states.pt", 0)  # ZeRO-3's module partition
    assert not _other_shard("engine/zero_pp_rank_0_mp_rank_00_model_states.pt", 0)
    assert _other_shard("engine/bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt", 0)
    assert not _other_shard("engine/zero_pp_rank_0_mp_rank_00_optim_states.pt", 0)
    assert not _other_shard("engine/zero_pp_rank_1_mp_rank_00_optim_states.pt", None)
    assert not _other_shard("engine/mp_rank_00_model_states.pt", 0)
    assert not _other_shard("optim/zero_pp_rank_1_mp_rank_00_optim_states.pt", 0)
