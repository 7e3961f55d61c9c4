"""Resume through ``s3://`` (s3fs) against a real S3-protocol server on loopback (moto's server).

* a run interrupted mid-cycle and resumed on S3 is the uninterrupted run on local storage;
* commit semantics on an object store: a crash before the manifest PUT leaves a torn directory
  that the next attempt classifies as torn and skips;
* the manifest is one PUT (no temp object, no copy/rename);
* ``syncpoint states`` / ``digest`` / ``events`` work on ``s3://`` URLs;
* a reader that has already listed the run sees what another writer commits afterwards (s3fs
  caches directory listings).

s3fs is pointed at the server through fsspec's config (``fsspec.config.conf["s3"]``), which
``fsspec.core.url_to_fs`` — and so ``syncpoint.workers.storage.RunStorage`` — applies to every new
``S3FileSystem``; the ``FSSPEC_S3_*`` environment variables are set too, for processes started
later (fsspec reads them only when it is imported, so setting them alone does not reach this one).
"""

from __future__ import annotations

import json

import pytest

from syncpoint.orchestrator.cli import main
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.discovery import discover
from syncpoint.workers.storage import RunStorage
from tests.helpers import (
    committed_steps,
    digest,
    linear_spec,
    run,
    run_until_crash,
    state_names,
    step_history,
    trainer_json,
)
from tests.s3_server import BUCKET

boto3 = pytest.importorskip("boto3")
s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

# 10 micro-batches per epoch, accumulation 4: boundaries at 4, 8, 10, 14, 18, 20; save requests every
# 3 micro-steps are serviced at the next boundary (states 4, 8, 10, 14, 18, 20).
RESUME_LAYOUT = (
    "task.config.num_samples=10",
    "train.grad_accum=4",
    "train.epochs=2",
    "checkpoint.save_every={value: 3, unit: micro_steps}",
    "deepspeed.zero_stage=2",
    "train.scheduler={type: cosine, warmup: 2}",
)
# 8 micro-batches, accumulation 2, a state every optimizer step: 2, 4, 6, 8.
SMALL_LAYOUT = (
    "task.config.num_samples=8",
    "train.grad_accum=2",
    "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    "deepspeed.zero_stage=1",
)


def keys(client, prefix: str) -> list[str]:
    out = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def assert_same_run(ref_spec, ref_final: str, spec, final: str) -> None:
    assert final == ref_final
    ref_hist, hist = step_history(ref_spec), step_history(spec)
    assert sorted(hist) == sorted(ref_hist) and ref_hist
    for step, rec in ref_hist.items():
        assert hist[step].loss == rec.loss, f"loss differs at optimizer step {step}"
        assert hist[step].lr == rec.lr, f"lr differs at optimizer step {step}"
    assert digest(spec, final) == digest(ref_spec, ref_final)


def test_resume_on_s3_equals_uninterrupted_local_run(s3, tmp_path):
    ref = linear_spec(tmp_path, *RESUME_LAYOUT)
    ref_final = run(ref).final_state

    spec = linear_spec(f"s3://{BUCKET}/resume", *RESUME_LAYOUT, "faults=[{at_micro_step: 13, mode: raise}]")
    assert spec.run_url == f"s3://{BUCKET}/resume/linear"
    assert run_until_crash(spec)  # after micro-step 13: mid-cycle (the next boundary is 14)
    assert committed_steps(spec) == [4, 8, 10]
    for name in state_names(spec):  # only boundaries were ever written
        t = trainer_json(spec, name)
        assert t["position_in_epoch"] % 4 == 0 or t["position_in_epoch"] == t["micro_batches_per_epoch"]

    result = run(spec)
    assert result.resumed_from == f"{10:012d}"
    assert_same_run(ref, ref_final, spec, result.final_state)
    assert committed_steps(spec) == committed_steps(ref) == [4, 8, 10, 14, 18, 20]
    assert any(k.endswith(f"states/{ref_final}/manifest.json") for k in keys(s3, "resume/linear/"))


def test_crash_before_manifest_on_s3_is_torn_and_skipped(s3, tmp_path):
    ref = linear_spec(tmp_path, *SMALL_LAYOUT)
    ref_final = run(ref).final_state

    spec = linear_spec(
        f"s3://{BUCKET}/torn", *SMALL_LAYOUT, "faults=[{phase: before_manifest, at_save: 2, mode: raise}]"
    )
    assert run_until_crash(spec)
    torn = f"{4:012d}"
    store = RunStorage(spec.run_url)
    assert torn in state_names(spec)
    listed = store.listing("states", torn).files
    assert "trainer.json" in listed and any(p.startswith("engine/") for p in listed)  # everything but the manifest
    assert "manifest.json" not in listed
    assert f"torn/linear/states/{torn}/manifest.json" not in keys(s3, "torn/linear/")
    assert committed_steps(spec) == [2]

    result = run(spec)
    assert result.resumed_from == f"{2:012d}"
    decisions = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "resume_decision"]
    assert len(decisions) == 2
    second = decisions[-1]
    assert second["chosen"] == f"{2:012d}"
    verdicts = {c["state"]: c["verdict"] for c in second["candidates"]}
    assert verdicts[torn] == "torn"
    assert verdicts[f"{2:012d}"] == "resumable"
    assert_same_run(ref, ref_final, spec, result.final_state)
    assert committed_steps(spec) == [2, 4, 6, 8]  # the torn directory was re-saved and committed this time


@pytest.fixture
def s3_calls(monkeypatch):
    """Every S3 API call s3fs makes in this test: (operation, key)."""
    from fsspec.asyn import sync_wrapper

    calls: list[tuple[str, str]] = []
    original = s3fs.S3FileSystem._call_s3

    async def spy(self, method, *akwarglist, **kwargs):
        calls.append((method, kwargs.get("Key", "")))
        return await original(self, method, *akwarglist, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", spy)
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", sync_wrapper(spy))  # S3File's (upload) path
    return calls


def test_manifest_is_one_put_without_temp_object_or_rename(s3, s3_calls):
    spec = linear_spec(f"s3://{BUCKET}/single-put", *SMALL_LAYOUT)
    result = run(spec)
    states = committed_steps(spec)
    assert states == [2, 4, 6, 8] and result.final_state == f"{8:012d}"

    all_keys = keys(s3, "single-put/linear/")
    assert not [k for k in all_keys if k.endswith(".tmp")]
    for step in states:
        assert f"single-put/linear/states/{step:012d}/manifest.json" in all_keys

    writes = [
        (op, key)
        for op, key in s3_calls
        if op
        in ("put_object", "create_multipart_upload", "copy_object", "upload_part_copy", "complete_multipart_upload")
    ]
    assert writes, "the spy saw no S3 writes"
    assert not [w for w in s3_calls if w[0] in ("copy_object", "upload_part_copy")], "a copy (rename) was issued"
    assert not [w for w in writes if w[1].endswith(".tmp")], "a temp object was written"
    for step in states:
        key = f"single-put/linear/states/{step:012d}/manifest.json"
        assert [op for op, k in writes if k == key] == ["put_object"], f"{key} was not written as one PUT"


def test_cli_states_digest_and_events_on_s3(s3, tmp_path, capsys):
    ref = linear_spec(tmp_path, *SMALL_LAYOUT)
    ref_final = run(ref).final_state
    spec = linear_spec(f"s3://{BUCKET}/cli", *SMALL_LAYOUT, "faults=[{at_micro_step: 5, mode: raise}]")
    assert run_until_crash(spec)
    final = run(spec).final_state
    url = spec.run_url

    capsys.readouterr()
    assert main(["states", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"] == url
    assert {c["state"]: c["verdict"] for c in out["candidates"]} == {f"{s:012d}": "resumable" for s in (2, 4, 6, 8)}
    assert out["choice"]["state"] == final == ref_final

    assert main(["states", url]) == 0
    text = capsys.readouterr().out
    assert f"resume from {final}" in text

    assert main(["digest", f"{url}/states/{final}"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == digest(spec, final) == digest(ref, ref_final)

    assert main(["digest", f"{url}/states/{final}", "--json"]) == 0
    parts = json.loads(capsys.readouterr().out)
    assert parts["digest"] == printed and {"parameters", "optimizer", "position", "rng"} <= set(parts)

    assert main(["events", url]) == 0
    timeline = capsys.readouterr().out
    assert "attempt 2" in timeline and f"from {4:012d}" in timeline

    assert main(["digest", f"{url}/states/{9:012d}"]) == 2  # no such state: bad input, not a traceback
    assert "not a committed state" in capsys.readouterr().err

    assert main(["status", url, "--json"]) == 0  # the lease, the events and the manifests through s3fs
    status = json.loads(capsys.readouterr().out)
    assert (status["run"], status["state"], status["attempt"]) == (url, "finished", 2)
    assert status["newest_resumable"]["state"] == final and status["lease"]["why"] == "released"
    assert status["goodput"]["restarts"] == 1 and status["last_interruption"]["resumed_from"] == f"{4:012d}"
    assert main(["status", f"s3://{BUCKET}/no-such-run"]) == 2
    assert "not a run directory" in capsys.readouterr().err


@pytest.fixture
def listed_run(s3, request):
    """A finished run on S3 (its own prefix per test) that this process has already listed (states/, events/)."""
    spec = linear_spec(f"s3://{BUCKET}/{request.node.name}", *SMALL_LAYOUT)
    run(spec)
    store = RunStorage(spec.run_url)
    assert [c.name for c in discover(store)][0] == f"{8:012d}"
    return spec, len(EventLog(store).read_all())


def test_discovery_sees_a_state_committed_by_another_writer_after_listing(s3, listed_run):
    spec, _ = listed_run
    # Another writer, through its own client (as another process would), commits state 10.
    prefix = spec.run_url[len(f"s3://{BUCKET}/") :]
    src, new = f"{prefix}/states/000000000008/", f"{prefix}/states/000000000010/"
    for key in keys(s3, src):
        s3.copy_object(Bucket=BUCKET, Key=new + key[len(src) :], CopySource={"Bucket": BUCKET, "Key": key})
    fresh = RunStorage(spec.run_url)  # what the next reader in this process does
    assert f"{10:012d}" in [c.name for c in discover(fresh)], "discovery missed a freshly committed state"


def test_event_log_sees_an_event_written_by_another_writer_after_listing(s3, listed_run):
    spec, n_events = listed_run
    prefix = spec.run_url[len(f"s3://{BUCKET}/") :]
    s3.put_object(
        Bucket=BUCKET,
        Key=f"{prefix}/events/99999999999999999999-finished-abcdef.json",
        Body=json.dumps({"kind": "finished", "time": 9e9, "source": "other"}).encode(),
    )
    assert len(EventLog(RunStorage(spec.run_url)).read_all()) == n_events + 1, "the event log missed a new event"
