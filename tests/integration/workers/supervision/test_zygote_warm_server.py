"""The node's warm training-process server (``syncpoint.workers.supervision.zygote``): training processes are
forked from it with torch and DeepSpeed imported, it outlives the workers that held it (so a new
worker group skips the imports) but never the job, its children never outlive their supervisor,
and anything planted where it lives means "no warm server", never someone else's process.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from multiprocessing import Pipe

import psutil
import pytest

from syncpoint.policies.contracts.journal import AttemptStarted
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision import zygote
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import ROOT, digest, linear_spec, state_names
from tests.own_processes import process_gone

pytestmark = pytest.mark.slow

SEED = "4242"


def _started_under(root: str) -> list[psutil.Process]:
    """The keepers and their servers this module's tests started: processes that started with their
    temp dir under ``root`` (found by the test's own temp dir, never by name) and left this process's
    tree (a keeper forks away from its starter). This process's own children (multiprocessing's
    resource tracker, started by a test under its dir) live as long as it does."""
    own = {p.pid for p in psutil.Process().children(recursive=True)}
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid not in own and proc.environ().get("TMPDIR", "").startswith(root + os.sep):
                found.append(proc)
    return found


@pytest.fixture(scope="module")
def short_tmp_root():
    """Where each test's own temp dir is made (short: a Unix socket's path is bounded), removed once
    the module's tests are done and every keeper they stopped has ended: a keeper that was asked to
    stop is still ending, and its fork server's and multiprocessing's own files live under its dir."""
    root = tempfile.mkdtemp(prefix="spw-", dir="/tmp")
    yield root
    psutil.wait_procs(_started_under(root), timeout=60)  # waits only: each was asked to stop
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def private_tmp(monkeypatch, tmp_path_factory, short_tmp_root):
    """A temp dir of the test's own: the keepers' sockets live under it, and every keeper the test
    started is stopped at the end by its key."""
    tmp_path_factory.getbasetemp()  # pytest's and multiprocessing's own temp dirs, fixed before TMPDIR changes
    multiprocessing.util.get_temp_dir()
    short = tempfile.mkdtemp(dir=short_tmp_root)
    monkeypatch.setenv("TMPDIR", short)
    monkeypatch.setattr(tempfile, "tempdir", None)
    server = multiprocessing.forkserver._forkserver
    pid_before = server._forkserver_pid
    keys: list[str] = []
    yield keys
    for k in keys:
        zygote.stop(k)
    if server._forkserver_pid not in (None, pid_before):  # this process's fork server, started under this dir
        server._stop()  # a later test starts it again, under its own


@pytest.fixture
def light_server(monkeypatch):
    """Servers that import nothing ahead, for the tests of a server's life (started, stopped, idle,
    dead, touched by the driver) that fork nothing from it: what a server imports is the first test's
    (seconds of CPU each). The scripts a test starts set the same themselves."""
    monkeypatch.setattr(zygote, "PRELOAD", [])


def _probe(conn) -> None:
    print("a line from the forked process", flush=True)
    conn.send((os.getppid(), "torch" in sys.modules, "deepspeed" in sys.modules, hash("syncpoint")))


def _sleep_forever() -> None:
    time.sleep(600)


def _hash_under(seed: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", "print(hash('syncpoint'))"],
        env={**os.environ, "PYTHONHASHSEED": seed},
        text=True,
        capture_output=True,
        check=True,
    )
    return int(out.stdout)


def _new_key(keys: list[str]) -> str:
    k = zygote.key(uuid.uuid4().hex, SEED)
    keys.append(k)
    return k


def test_a_forked_process_starts_warm_with_the_jobs_hash_seed_and_its_starters_output(private_tmp, capfd):
    k = _new_key(private_tmp)
    holder = zygote.hold(k, SEED)
    try:
        assert holder.server.started_here
        for _ in range(2):  # the second fork reuses the same warm server
            mine, theirs = Pipe()
            proc = holder.process(target=_probe, args=(theirs,))
            proc.start()
            theirs.close()
            parent, has_torch, has_deepspeed, hashed = mine.recv()
            proc.join(30)
            assert proc.exitcode == 0
            assert parent == holder.server.pid  # forked by the server, not by this process
            assert has_torch and has_deepspeed
            assert hashed == _hash_under(SEED)  # the server started with the job's PYTHONHASHSEED
    finally:
        holder.close()
    assert capfd.readouterr().out.count("a line from the forked process") == 2  # into this process's stdout

    again = zygote.hold(k, SEED)  # the server outlived its first holder: found warm, not started
    try:
        assert not again.server.started_here and again.server.pid == holder.server.pid
    finally:
        again.close()


def test_the_server_ends_when_stopped_or_when_nobody_held_it_for_its_idle_time(private_tmp, monkeypatch, light_server):
    k = _new_key(private_tmp)
    holder = zygote.hold(k, SEED)
    pid = holder.server.pid
    holder.close()
    assert psutil.pid_exists(pid)
    assert zygote.stop(k)
    assert not os.path.exists(zygote._socket_path(k))  # removed once stop() returns: a driver may exit next
    assert process_gone(pid, 60)
    assert not os.listdir(zygote.base_dir())  # its socket and lock file removed
    assert not zygote.stop(k)  # nothing left to stop

    monkeypatch.setattr(zygote, "IDLE_S", 1.0)
    k2 = _new_key(private_tmp)
    holder = zygote.hold(k2, SEED)
    pid = holder.server.pid
    time.sleep(2.5)
    assert psutil.pid_exists(pid)  # held: it stays past its idle time
    holder.close()
    assert process_gone(pid, 60)  # nobody holds it: it ends within its idle time


STARTER = textwrap.dedent(
    """
    import sys, time
    from syncpoint.workers.supervision import zygote
    from tests.integration.workers.supervision.test_zygote_warm_server import _sleep_forever
    zygote.PRELOAD = []  # a light server: what it imports is the first test's
    holder = zygote.hold(sys.argv[1], sys.argv[2])
    proc = holder.process(target=_sleep_forever)
    proc.start()
    print(proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_forked_process_ends_with_its_starter_while_the_server_stays(private_tmp):
    """The server outlives a supervisor that is killed outright (SIGKILL: no cleanup runs), so the
    kernel's parent-death signal does not end the supervisor's training process: it watches its
    starter, and ends when it goes."""
    k = _new_key(private_tmp)
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, k, SEED],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert starter.stdout is not None
        child = int(starter.stdout.readline())
        assert psutil.pid_exists(child)
        server = psutil.Process(child).ppid()
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        assert process_gone(child, 60)
        assert psutil.pid_exists(server)  # the server stays for the next worker group
    finally:
        if starter.poll() is None:
            starter.kill()


def test_anything_planted_where_the_server_lives_means_no_warm_server(private_tmp, tmp_path):
    k = _new_key(private_tmp)
    base = zygote.base_dir()
    os.mkfifo(zygote._socket_path(k))  # not a socket: never connected to, never replaced
    with pytest.raises(zygote.Unavailable, match="not a socket"):
        zygote.hold(k, SEED)

    k2 = _new_key(private_tmp)
    os.symlink(tmp_path / "elsewhere", zygote._lock_path(k2))  # the lock file is never followed
    with pytest.raises(OSError):
        zygote.hold(k2, SEED)
    assert not (tmp_path / "elsewhere").exists()

    for name in os.listdir(base):
        os.unlink(os.path.join(base, name))
    os.rmdir(base)
    os.symlink(tmp_path, base)  # the directory itself a link: refused
    with pytest.raises(zygote.Unavailable, match="not a private directory"):
        zygote.hold(_new_key(private_tmp), SEED)
    os.unlink(base)
    os.mkdir(base, 0o755)  # open to others: refused
    with pytest.raises(zygote.Unavailable, match="not a private directory"):
        zygote.hold(_new_key(private_tmp), SEED)


def test_in_place_recovery_from_the_warm_server_is_bitwise_and_leaves_no_server(private_tmp, tmp_path):
    save = "checkpoint.save_every={value: 1, unit: optimizer_steps}"
    ref = linear_spec(tmp_path / "ref", save, workers=2)
    assert run_spawned(ref) == [0, 0]
    final = state_names(ref)[-1]
    spec = linear_spec(
        tmp_path / "run", save, "failure.max_failures=1", "faults=[{rank: 1, at_micro_step: 9, mode: exit}]", workers=2
    )
    assert run_spawned(spec, in_place=True, warm=True) == [0, 0]
    assert state_names(spec)[-1] == final and digest(spec, final) == digest(ref, final)
    started = EventLog(RunStorage(spec.run_url)).journal().of_kind(AttemptStarted)
    assert [a.attempt for a in started] == [1, 2]
    assert started[1].warm_start is True  # the recovery's processes came from the server, warm
    assert started[0].warm_start is not None  # the first generation's too (cold or warm: which rank started it)
    assert not os.listdir(zygote.base_dir())  # stopped with the run


def test_a_temp_dir_too_long_for_a_socket_means_no_warm_server(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(zygote.Unavailable, match="too long for a Unix socket"):
        zygote.hold(zygote.key(uuid.uuid4().hex, SEED), SEED)


def test_a_server_that_died_fails_the_fork_with_an_os_error_and_its_keeper_leaves(private_tmp, light_server):
    """The supervisor forks from its own server on that error (``Supervisor._start``): a warm server
    is a shortcut, never a dependency. Its keeper notices the dead server and removes its socket."""
    k = _new_key(private_tmp)
    holder = zygote.hold(k, SEED)
    try:
        os.kill(holder.server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(zygote._socket_path(k)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(zygote._socket_path(k))
        with pytest.raises(OSError):
            holder.process(target=_sleep_forever).start()
    finally:
        holder.close()


STARTERS = textwrap.dedent(
    """
    import sys
    from syncpoint.workers.supervision import zygote
    zygote.PRELOAD = []  # a light server: what it imports is the first test's
    sock, server = zygote.ensure(sys.argv[1], sys.argv[2], "touch")
    print(server.pid, server.started_here, flush=True)
    """
)


def test_starters_at_the_same_moment_start_one_server(private_tmp):
    """Both ranks' supervisors and the driver's warm task may ask a node at once: the lock file lets
    one of them start the keeper, and every one gets that same server."""
    k = _new_key(private_tmp)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-c", STARTERS, k, SEED], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(4)
    ]
    answers = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), answers
    assert len({pid for pid, _ in answers}) == 1  # one server
    assert sorted(started for _, started in answers) == ["False", "False", "False", "True"]  # one starter


def test_the_job_asks_for_warm_servers_only_where_they_apply():
    from syncpoint.orchestrator.warm_nodes import wanted

    assert wanted(linear_spec("memory://w"))
    assert not wanted(linear_spec("memory://w", "failure.warm_nodes=false"))
    assert not wanted(linear_spec("memory://w", "failure.in_place=false"))  # the Ray worker trains itself


def test_an_embedded_run_keeps_its_own_node_warm_without_ray_and_stops_it_after(private_tmp, monkeypatch, light_server):
    """On an embedded Ray the cluster is the driver's node: the driver touches that node's server
    itself each round (no Ray is needed, none runs here: a round through Ray tasks would fail and
    leave no server), and stops it when the job ends."""
    import ray

    from syncpoint.orchestrator import warm_nodes

    assert not ray.is_initialized()
    monkeypatch.setattr(zygote, "WARM_EVERY_S", 0.2)
    spec = linear_spec("memory://w")
    submission = uuid.uuid4().hex
    k, hash_seed = warm_nodes.server_key(spec, submission)
    private_tmp.append(k)
    sock = zygote._socket_path(k)
    with warm_nodes.warm_nodes(spec, submission, embedded=True):
        deadline = time.monotonic() + 120
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(sock)  # started by the driver's own round
        conn, server = zygote.ensure(k, hash_seed, "touch")
        conn.close()
        assert not server.started_here
        keeper = psutil.Process(server.pid).ppid()  # the fork server's parent, which cleans up after it
    assert process_gone(server.pid, 60) and process_gone(keeper, 60)  # stopped with the job
    assert not os.path.exists(sock)


def test_a_keeper_serves_only_its_own_network_namespace(private_tmp):
    """A forked process lives in its server's network namespace: Ray nodes of one host in namespaces
    of their own (tests/drills/ray/test_silent_node.py) each get their own keeper, not one shared by
    the temp dir, whose store agent could not bind the other node's address."""
    k = _new_key(private_tmp)
    here = os.stat("/proc/self/ns/net").st_ino
    assert zygote._socket_path(k).endswith(f"{k}-n{here}.sock") and zygote._lock_path(k).endswith(f"{k}-n{here}.lock")
    other = subprocess.run(  # another network namespace of this host: another keeper's paths
        [
            "unshare",
            "--net",
            sys.executable,
            "-c",
            f"from syncpoint.workers.supervision import zygote; print(zygote._socket_path({k!r}))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if other.returncode != 0 and "Operation not permitted" in other.stderr:
        pytest.skip("no network namespaces for this account")
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip() != zygote._socket_path(k) and other.stdout.strip().startswith(zygote.base_dir())
