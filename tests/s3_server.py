"""moto's S3 server on loopback for the tests that need an object store (the ``s3`` fixture of
tests/conftest.py): the bucket, the credentials, and the server itself."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
import pytest

BUCKET = "syncpoint-test"
KEY, SECRET = "testing", "testing"


def _atomic_conditional_puts(mp: pytest.MonkeyPatch) -> None:
    """S3 checks a PUT's ``If-None-Match``/``If-Match`` and writes the object as one step; moto's
    threaded server checks, then writes, so two racing conditional creates can both succeed (seen
    under load in the lease race test). One lock around moto's PUT handler gives it S3's semantics;
    every other request runs concurrently as before."""
    responses = pytest.importorskip("moto.s3.responses")
    put, lock = responses.S3Response.put_object, threading.Lock()

    def atomic_put(self: Any) -> Any:
        with lock:
            return put(self)

    mp.setattr(responses.S3Response, "put_object", atomic_put)


@contextmanager
def moto_s3() -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1:<free port>, a bucket, and fsspec/s3fs pointed at it; yields a
    boto3 client on it."""
    boto3 = pytest.importorskip("boto3")
    s3fs = pytest.importorskip("s3fs")
    ThreadedMotoServer = pytest.importorskip("moto.server").ThreadedMotoServer

    from syncpoint.workers.supervision.free_ports import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    werkzeug_log = logging.getLogger("werkzeug")
    level = werkzeug_log.level
    werkzeug_log.setLevel(logging.WARNING)  # one INFO line per request otherwise
    endpoint = f"http://127.0.0.1:{port}"
    mp = pytest.MonkeyPatch()
    try:
        _atomic_conditional_puts(mp)
        for k, v in {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "FSSPEC_S3_ENDPOINT_URL": endpoint,
            "FSSPEC_S3_KEY": KEY,
            "FSSPEC_S3_SECRET": SECRET,
        }.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        mp.setitem(
            fsspec.config.conf, "s3", {"client_kwargs": {"endpoint_url": endpoint}, "key": KEY, "secret": SECRET}
        )
        s3fs.S3FileSystem.clear_instance_cache()
        client = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY, aws_secret_access_key=SECRET
        )
        client.create_bucket(Bucket=BUCKET)
        fs, path = fsspec.core.url_to_fs(f"s3://{BUCKET}/probe")  # exactly how RunStorage resolves a URL
        assert isinstance(fs, s3fs.S3FileSystem) and path == f"{BUCKET}/probe"
        fs.pipe_file(f"{BUCKET}/probe/x", b"x")
        assert client.get_object(Bucket=BUCKET, Key="probe/x")["Body"].read() == b"x"  # really on the server
        yield client
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        mp.undo()
        server.stop()
        werkzeug_log.setLevel(level)
