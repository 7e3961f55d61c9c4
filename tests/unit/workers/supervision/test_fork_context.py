"""A process forked from a fork server takes its caller's environment whole (``adopt_environment``):
nothing the server read from its own, older environment survives."""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import fsspec.config

from syncpoint.workers.supervision.fork_context import adopt_environment


def test_a_forked_process_forgets_the_servers_temp_dir_variables_and_s3_endpoint(tmp_path):
    gone = tmp_path / "the-servers-private-tmp"  # removed since the server cached it, as in make test
    mine = tmp_path / "the-callers-tmp"
    mine.mkdir()
    saved = dict(os.environ)
    borrowed = multiprocessing.current_process()._config.get("tempdir")
    try:
        os.environ.update(STALE_JOB_VARIABLE="1", FSSPEC_S3_ENDPOINT_URL="http://127.0.0.1:1")
        adopt_environment(dict(os.environ))  # what the fork server read when it started
        tempfile.tempdir = str(gone)
        multiprocessing.current_process()._config["tempdir"] = str(gone / "pymp-x")
        assert fsspec.config.conf["s3"]["endpoint_url"] == "http://127.0.0.1:1"

        caller = {k: v for k, v in saved.items() if not k.startswith("FSSPEC_")}
        adopt_environment({**caller, "TMPDIR": str(mine), "FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:2"})
        assert "STALE_JOB_VARIABLE" not in os.environ
        assert tempfile.gettempdir() == str(mine)
        with tempfile.TemporaryDirectory() as made:  # failed with FileNotFoundError before
            assert os.path.dirname(made) == str(mine)
        assert "tempdir" not in multiprocessing.current_process()._config  # the server's pymp dir, forgotten
        assert fsspec.config.conf["s3"]["endpoint_url"] == "http://127.0.0.1:2"
    finally:
        adopt_environment(saved)
        if borrowed is not None:
            multiprocessing.current_process()._config["tempdir"] = borrowed  # this process's own, kept
