"""The lease on S3: conditional writes (``If-None-Match: *`` to create, ``If-Match: <etag>`` to
replace) and ages from the server's own clock (LastModified against the response's Date), against
moto's real S3 server on loopback (the ``s3`` fixture of ``tests/conftest.py``)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from syncpoint.policies.contracts.errors import LeaseRefused
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import LEASE_MAX_BYTES, RunLease, read_lease
from tests import lease_drivers
from tests.s3_server import BUCKET

JOB = lease_drivers.JOB


def _lease(url: str, submission: str, ttl: float = 30.0) -> RunLease:
    return RunLease(RunStorage(url), job_identity=JOB, job_name="job", submission=submission, ttl_s=ttl)


def test_conditional_writes_are_checked_by_the_server(s3):
    store = RunStorage(f"s3://{BUCKET}/cas")
    assert store.conditional_writes == "s3"
    first = store.write_if(b"first", "lease.json", expect=None, limit=LEASE_MAX_BYTES)
    assert first is not None
    assert (
        store.write_if(b"second", "lease.json", expect=None, limit=LEASE_MAX_BYTES) is None
    )  # If-None-Match: * refused
    assert (
        store.write_if(b"third", "lease.json", expect='"0123456789abcdef0123456789abcdef"', limit=LEASE_MAX_BYTES)
        is None
    )
    assert s3.get_object(Bucket=BUCKET, Key="cas/lease.json")["Body"].read() == b"first"
    second = store.write_if(b"second", "lease.json", expect=first, limit=LEASE_MAX_BYTES)  # If-Match: the etag we read
    got = store.read_versioned("lease.json", limit=LEASE_MAX_BYTES)
    assert got.data == b"second" and got.version == second and 0 <= got.age_s < 5
    # a stale owner cannot write back
    assert store.write_if(b"late", "lease.json", expect=first, limit=LEASE_MAX_BYTES) is None


def test_racing_threads_on_s3_exactly_one_wins(s3):
    url = f"s3://{BUCKET}/race-threads"
    leases = [_lease(url, f"sub-{i}") for i in range(8)]
    won, _ = lease_drivers.race_threads(leases)
    try:
        assert len(won) == 1
        assert read_lease(RunStorage(url)).record["submission"] == won[0].identity["submission"]
        assert won[0].confirm() is None
    finally:
        for lease in leases:
            lease.stop()


@pytest.mark.slow
def test_racing_processes_on_s3_exactly_one_wins(s3):
    url = f"s3://{BUCKET}/race-procs"
    results = lease_drivers.race_processes(url, 3, timeout=120)
    winners = [r for r in results if r[1] == "won"]
    assert len(winners) == 1 and winners[0][2] is None, results
    assert read_lease(RunStorage(url)).record["submission"] == winners[0][0]


def test_a_stalled_owner_is_taken_over_and_fenced_by_the_etag(s3):
    url = f"s3://{BUCKET}/takeover"
    owner = _lease(url, "owner", ttl=3.0)  # room for one-second resolution and a loaded machine
    owner.acquire()
    with pytest.raises(LeaseRefused, match="in use by another running submission"):
        _lease(url, "early", ttl=3.0).acquire()
    owner.stop()  # stalls
    time.sleep(4.6)  # LastModified has one-second resolution
    successor = _lease(url, "successor", ttl=3.0)
    try:
        assert successor.acquire() == "takeover" and successor.generation == owner.generation + 1
        verdict = owner.confirm()
        assert verdict is not None and "to submission successor" in verdict
        assert read_lease(RunStorage(url)).record["submission"] == "successor"
    finally:
        successor.stop()


def test_a_successor_whose_clock_runs_ten_seconds_ahead_never_takes_over_on_s3(s3):
    url = f"s3://{BUCKET}/skew"
    owner = _lease(url, "owner", ttl=3.0)
    owner.acquire()
    try:
        ctx = mp.get_context("spawn")  # another machine: its own clock (moto shares this process's)
        out, start = ctx.Queue(), ctx.Barrier(1)
        successor = ctx.Process(target=lease_drivers.race, args=(url, "successor", start, out, 10.0))
        successor.start()
        submission, outcome, message = out.get(timeout=120)
        successor.join(30)
        assert outcome == "refused" and "in use by another running submission" in message
        assert owner.confirm() is None
    finally:
        owner.stop()


def test_a_malformed_lease_on_s3_expires_by_its_last_modified(s3, capsys):
    url = f"s3://{BUCKET}/malformed"
    s3.put_object(Bucket=BUCKET, Key="malformed/lease.json", Body=b'{"submission": "x", "heartbeat": "soon"}')
    # LastModified and Date have one-second resolution and a loaded machine adds its own delay:
    # the ttl leaves room for both before the first try, the sleep passes it for the second
    successor = _lease(url, "successor", ttl=4.0)
    with pytest.raises(LeaseRefused, match="malformed"):
        successor.acquire()
    assert "malformed" in capsys.readouterr().err
    time.sleep(5.2)
    try:
        assert successor.acquire() == "takeover" and successor.confirm() is None
    finally:
        successor.stop()
