"""A process forked from a fork server takes its caller's environment whole (``adopt_environment``):
nothing the server read from its own, older environment survives. A process keeps a server per hash
seed (``fork_server_with``)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import signal
import subprocess
import sys
import tempfile

import fsspec.config
import psutil
import pytest

from syncpoint.workers.supervision import fork_context
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


def _hash_of_a_name(queue) -> None:
    queue.put(hash("syncpoint"))


def _hash_under(seed: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", "print(hash('syncpoint'))"], env=env, capture_output=True, text=True)
    return int(out.stdout)


@pytest.fixture
def own_fork_server(monkeypatch):
    """A fork server of this test's own in place of this process's (other tests fork from that one), and
    servers that import nothing ahead; every server the test started is stopped at its end."""
    own = forkserver.ForkServer()
    for name in ("ensure_running", "connect_to_new_process", "set_forkserver_preload", "get_inherited_fds"):
        monkeypatch.setattr(forkserver, name, getattr(own, name))
    monkeypatch.setattr(forkserver, "_forkserver", own)
    monkeypatch.setattr(fork_context, "PRELOAD", [])
    monkeypatch.setattr(fork_context, "_parked", {})
    monkeypatch.setattr(fork_context, "_fork_server_hash_seed", None)
    yield own
    for parked in fork_context._parked.values():
        fork_context._stop_parked(parked)
    own._stop()


def test_a_server_of_another_seed_is_parked_and_taken_back_not_started_again(own_fork_server):
    """Runs of several hash seeds in turn (a test worker, a bench's grid) fork from a server per seed,
    each started once: the one of the seed before is parked, alive, and becomes the running one again
    when its seed comes back; past ``KEEP_PARKED`` the one parked longest is stopped. A forked process
    hashes as its seed says."""
    server, ctx = own_fork_server, multiprocessing.get_context("forkserver")

    def forked_hash(seed: str) -> int:
        assert fork_context.fork_server_with(seed)
        queue = ctx.Queue()
        child = ctx.Process(target=_hash_of_a_name, args=(queue,))
        child.start()
        value = queue.get(timeout=60)
        child.join(timeout=60)
        return value

    assert forked_hash("11") == _hash_under("11")
    first = server._forkserver_pid
    assert forked_hash("12") == _hash_under("12") and server._forkserver_pid != first
    assert fork_context.parked_seeds() == ["11"] and psutil.pid_exists(first)
    assert fork_context.fork_server_running("11") and fork_context.fork_server_running("12")
    assert forked_hash("11") == _hash_under("11") and server._forkserver_pid == first  # taken back, not started
    assert fork_context.parked_seeds() == ["12"]

    second = fork_context._parked["12"][2]
    for seed in ("13", "14"):
        assert fork_context.fork_server_with(seed)
    assert fork_context.parked_seeds() == ["11", "13"]  # 12's, parked longest, stopped and reaped
    assert not psutil.pid_exists(second)

    # a parked server that died is started again for its seed
    os.kill(fork_context._parked["11"][2], signal.SIGKILL)
    assert forked_hash("11") == _hash_under("11") and server._forkserver_pid != first
