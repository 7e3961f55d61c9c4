"""Corrupted states: each is detected before anything is loaded, reported with its reason, and the
run falls back to the previous resumable state and still ends bitwise equal to the reference."""

from __future__ import annotations

import json

import pytest

from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, TRAINER_MAX_BYTES
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, digest, lm_spec, run, run_until_crash, with_overrides

NEWEST = f"{10:012d}"
SHARD = "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt"


def flip_byte(store):
    data = bytearray(store.read_bytes("states", NEWEST, SHARD, limit=1 << 30))
    data[100] ^= 0x01
    store.write_bytes(bytes(data), "states", NEWEST, SHARD)


def truncate(store):
    data = store.read_bytes("states", NEWEST, SHARD, limit=1 << 30)
    store.write_bytes(data[: len(data) // 2], "states", NEWEST, SHARD)


def missing_shard(store):
    store.remove("states", NEWEST, SHARD)


def manifest_not_json(store):
    store.write_bytes(b'{"files": {"trainer.json": ', "states", NEWEST, "manifest.json")


def newer_schema(store):
    from syncpoint.workers.integrity.checksum import checksum_bytes

    t = json.loads(store.read_bytes("states", NEWEST, "trainer.json", limit=TRAINER_MAX_BYTES))
    t["schema_version"] = 99
    data = store.write_json(t, "states", NEWEST, "trainer.json")
    m = json.loads(store.read_bytes("states", NEWEST, "manifest.json", limit=MANIFEST_MAX_BYTES))
    m["files"]["trainer.json"] = {"size": len(data), "sha256": checksum_bytes(data, "sha256")}
    store.commit_bytes(json.dumps(m).encode(), "states", NEWEST, "manifest.json")


CASES = {
    flip_byte: "xxh3_128 does not match",
    truncate: "bytes, the manifest says",
    missing_shard: "missing file",
    manifest_not_json: "manifest.json unreadable",
    newer_schema: "newer than this syncpoint reads",
}


@pytest.mark.parametrize("corrupt", list(CASES), ids=[f.__name__ for f in CASES])
def test_corruption_is_detected_and_the_run_falls_back(tmp_path, corrupt):
    spec = lm_spec(
        tmp_path / "run",
        "task.config.num_samples=20",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 10, mode: raise}]",
    )
    assert run_until_crash(spec) and committed_steps(spec) == [4, 8, 10]
    store = RunStorage(spec.run_url)
    corrupt(store)
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == f"{8:012d}"
    decision = [e for e in EventLog(store).read_all() if e["kind"] == "resume_decision"][-1]
    reasons = {c["state"]: c["reason"] for c in decision["candidates"]}
    assert CASES[corrupt] in reasons[NEWEST], reasons
    ref = lm_spec(tmp_path / "ref", "task.config.num_samples=20", "train.epochs=2")
    run(ref)
    assert digest(spec, result.final_state) == digest(ref, result.final_state)
