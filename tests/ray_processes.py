"""Real Ray processes a test starts and stops itself: a head (`ray start --head`) and worker nodes
(`ray start --address=... --block`, each its own node), never `ray stop` (which stops every Ray on
the machine, another engineer's included). Everything is stopped by its own process ids.

Why worker nodes with ``--block``: that process is what a KubeRay worker pod runs as its main
process, and a spot reclaim reaches it as SIGTERM; Ray's handler then asks the GCS to drain the node
(``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``) before it stops the node's processes.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil

from tests.helpers import stop_processes
from tests.own_processes import marked_env, marked_processes, owned

BIN = os.path.dirname(sys.executable)
# Each node's object store, small: by default every `ray start` takes 30% of the machine's memory for
# one (shared memory), and a test runs up to five nodes on this 24 GB machine beside the other half of
# the suite; the tests pass kilobytes through it.
OBJECT_STORE = f"--object-store-memory={256 * 1024 * 1024}"
# Ray's token authentication (Ray >= 2.52): what a test clears for "no token anywhere".
TOKEN_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
DRAIN_S = 8  # the node's grace: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S of its `ray start --block`


def free_ports(n: int) -> list[int]:
    """``n`` free TCP ports on loopback, below the kernel's ephemeral range and never handed out twice
    (``syncpoint.workers.supervision.free_ports``): a node draws its ports before it binds them, its
    agents seconds later."""
    from syncpoint.workers.supervision.free_ports import free_ports as draw

    return draw(n)


def ray_env() -> dict:
    """This venv's `ray`/`python` first on PATH, no inherited RAY_ADDRESS, token auth when set up."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # the head runs `python` entrypoints from this venv
    if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        env["RAY_AUTH_MODE"] = "token"  # Ray 2.60: token auth is on when ~/.ray/auth_token exists
    return env


def drain_env() -> dict:
    """ray_env() with a SIGTERM drain of DRAIN_S and a fast preemption poll, as a reclaimed pod's node has."""
    env = ray_env()
    env.update(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=str(DRAIN_S), RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="0.2")
    return env


@dataclass
class Head:
    address: str  # the Job API (dashboard) address, for `ray job submit` / `syncpoint submit`
    gcs_address: str  # what drivers and worker nodes connect to
    temp_dir: str
    mark: str = ""  # the environment marker of every process of this cluster (tests.own_processes)

    @property
    def processes(self) -> list[psutil.Process]:
        """The head's processes now: those carrying the mark they inherited (the GCS, raylet,
        dashboard) and their descendants (``tests.own_processes.owned``), nothing else."""
        return list(owned(self.mark))


@contextlib.contextmanager
def local_head(
    env: dict, num_cpus: int = 2, system_config: str | None = None, node_ip: str | None = None
) -> Iterator[Head]:
    """A real Ray head on its own ports and temp dir, started with ``env`` (its PATH decides which
    ``python`` runs job entrypoints); stopped by its own process ids and their children.
    ``node_ip``: the head advertises and serves its dashboard on that address (a test's own network,
    tests/netns.py) instead of 127.0.0.1."""
    head = _start_head(env, num_cpus, system_config, node_ip)
    try:
        wait_for_job_agent(head.address, env)
        yield head
    finally:
        stop_processes(head.processes, mark=head.mark)  # this cluster's processes only, found by its mark


HEAD_START_TRIES = 2


def _start_head(env: dict, num_cpus: int, system_config: str | None, node_ip: str | None = None) -> Head:
    """`ray start --head`, once more on fresh ports and a fresh temp dir if it fails: on a loaded
    machine its raylet can give up waiting for its own dashboard agent ("Timed out waiting for
    file .../ports_by_node.json"), a start-up race, not the test's subject. A second failure is
    reported with `ray start`'s own output."""
    for attempt in range(1, HEAD_START_TRIES + 1):
        temp = tempfile.mkdtemp(prefix="sp-ray-")
        ports = free_ports(7)
        head_env, mark = marked_env(env)
        host = node_ip or "127.0.0.1"
        head = Head(f"http://{host}:{ports[1]}", f"{host}:{ports[0]}", temp, mark)
        try:
            r = subprocess.run(
                [
                    f"{BIN}/ray",
                    "start",
                    "--head",
                    f"--port={ports[0]}",
                    f"--dashboard-port={ports[1]}",
                    f"--dashboard-agent-listen-port={ports[2]}",
                    f"--dashboard-agent-grpc-port={ports[3]}",
                    f"--metrics-export-port={ports[4]}",
                    f"--runtime-env-agent-port={ports[5]}",
                    f"--ray-client-server-port={ports[6]}",
                    f"--num-cpus={num_cpus}",
                    f"--temp-dir={temp}",
                    "--disable-usage-stats",
                    "--include-dashboard=true",
                    OBJECT_STORE,
                    *([f"--node-ip-address={node_ip}", f"--dashboard-host={node_ip}"] if node_ip else []),
                    *([f"--system-config={system_config}"] if system_config else []),
                ],
                env=head_env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            failure = None if r.returncode == 0 else f"exit status {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}"
        except subprocess.TimeoutExpired:
            failure = "no answer within 180 s"
        if failure is None:
            return head
        stop_processes(head.processes, mark=mark)
        if attempt == HEAD_START_TRIES:
            raise AssertionError(f"`ray start --head` failed {attempt} times; the last: {failure}")
    raise AssertionError("unreachable")


def wait_for_job_agent(address: str, env: dict | None = None) -> None:
    """The head answers before its job agent is up; wait (bounded) until a job can be listed (with
    ``env``: the head's own environment, its token included, when it has one)."""
    deadline = time.monotonic() + 90
    while (
        subprocess.run(
            [f"{BIN}/ray", "job", "list", "--address", address], env=env or ray_env(), capture_output=True
        ).returncode
        != 0
    ):
        assert time.monotonic() < deadline, "the head's job agent never came up within 90 s"
        time.sleep(1)


@dataclass
class WorkerNode:
    proc: subprocess.Popen  # the `ray start --block` process: the pod's main process
    node_id: str
    mark: str = ""  # the environment marker of this node's processes (tests.own_processes)

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []


@contextlib.contextmanager
def worker_nodes(head: Head, count: int, env: dict) -> Iterator[list[WorkerNode]]:
    """``count`` worker nodes of one CPU each; the list may grow (``add_worker_node``); every node's
    processes are stopped at the end, whatever state the test left them in."""
    nodes: list[WorkerNode] = []
    try:
        for _ in range(count):
            nodes.append(add_worker_node(head, env))
        yield nodes
    finally:
        for n in nodes:  # each node's processes: its `ray start` and whatever carries its mark (orphans too)
            roots = {*marked_processes(n.mark), *([psutil.Process(n.proc.pid)] if n.proc.poll() is None else [])}
            stop_processes(list(roots), mark=n.mark)


WORKER_START_TRIES = 3


def add_worker_node(
    head: Head, env: dict, timeout: float = 240, prefix: list[str] | None = None, node_ip: str | None = None
) -> WorkerNode:
    """Start one `ray start --address=HEAD --num-cpus=1 --block` node (its own agent ports: several
    nodes share this machine) and wait, bounded, until its raylet runs; returns it with its node id.
    A node whose `ray start` exits before its raylet registers is started again (new ports, a new
    temp dir), up to ``WORKER_START_TRIES`` times, as a head's start is: on two loaded cores a raylet
    aborts at start when its dashboard agent writes its port file late (Ray's ``Check failed ... Timed
    out waiting for file dashboard_agent_listen_port_<node>``, seen in make test-all), which is Ray's
    start-up, not what a test checks; the last try's failure is raised with what the node said."""
    for attempt in range(1, WORKER_START_TRIES + 1):
        try:
            return _start_worker_node(head, env, timeout, prefix, node_ip)
        except NodeStartFailed:
            if attempt == WORKER_START_TRIES:
                raise
    raise AssertionError("unreachable")


class NodeStartFailed(AssertionError):
    """A worker node's `ray start` exited before its raylet registered (its processes are stopped)."""


def _start_worker_node(
    head: Head, env: dict, timeout: float, prefix: list[str] | None, node_ip: str | None
) -> WorkerNode:
    """One try of ``add_worker_node``.
    Each node has its own temp dir, as separate machines have: nodes sharing the head's unpack one
    job's ``working_dir`` into one ``runtime_resources`` folder, each node's agent managing (and
    evicting) it as its own, and a `ray job submit` driver then failed to import a module that the
    folder held again afterwards.
    ``prefix``/``node_ip``: run it inside a network namespace (``ip netns exec NS``, which execs, so
    the process is `ray start` itself) bound to the namespace's address (tests/netns.py)."""
    ports = free_ports(4)
    node_env, mark = marked_env(env)
    temp = tempfile.mkdtemp(prefix="sp-rayw-")  # a node's own /tmp, as on a real machine (below)
    proc = subprocess.Popen(
        [
            *(prefix or []),
            f"{BIN}/ray",
            "start",
            f"--address={head.gcs_address}",
            "--num-cpus=1",
            "--block",
            f"--dashboard-agent-listen-port={ports[0]}",
            f"--dashboard-agent-grpc-port={ports[1]}",
            f"--metrics-export-port={ports[2]}",
            f"--runtime-env-agent-port={ports[3]}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            OBJECT_STORE,
            *([f"--node-ip-address={node_ip}"] if node_ip else []),
        ],
        env=node_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in WorkerNode(proc, "", mark).children():
            with contextlib.suppress(psutil.Error):
                cmd = child.cmdline()
                if cmd and cmd[0].endswith("raylet"):
                    ids = [a.split("=", 1)[1] for a in cmd if a.startswith("--node_id=")]
                    if ids:
                        try:
                            wait_until_registered(head, ids[0], env, deadline, proc, temp)
                        except AssertionError as e:
                            if proc.poll() is None:
                                raise
                            _stop_failed_start(proc, mark)
                            raise NodeStartFailed(str(e)) from None
                        return WorkerNode(proc, ids[0], mark)
        if proc.poll() is not None:
            _stop_failed_start(proc, mark)
            raise NodeStartFailed(f"`ray start --block` for a worker node exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"a worker node's raylet did not start within {timeout:.0f} s")


def _stop_failed_start(proc: subprocess.Popen, mark: str) -> None:
    """What a node whose `ray start` exited left (its agents, found by the node's own mark)."""
    stop_processes(list(marked_processes(mark)), mark=mark)
    proc.wait()


def wait_until_registered(
    head: Head, node_id: str, env: dict, deadline: float, proc: subprocess.Popen | None = None, temp: str = ""
) -> None:
    """A raylet runs some seconds (tens on a loaded machine) before the GCS lists its node as
    active, and Ray Train sees no capacity until then: wait, bounded, for `ray status` to list it.
    When it does not, say what the node was doing (its `ray start`, its raylet's last log lines)."""
    status = ""
    while time.monotonic() < deadline:
        r = subprocess.run(
            [f"{BIN}/ray", "status", "--address", head.gcs_address], env=env, capture_output=True, text=True, timeout=60
        )
        status = r.stdout
        alive = r.stdout.split("Pending:", 1)[0]  # the Active: and Idle: sections (not recent failures)
        if f"node_{node_id}" in alive:
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(1)
    started = "running" if proc is None or proc.poll() is None else f"exited with {proc.returncode}"
    raise AssertionError(
        f"worker node {node_id[:12]} did not register with the head in time (its `ray start`: {started}); "
        f"`ray status` said:\n{status[-1500:]}\nits raylet's last lines:\n{_raylet_tail(temp)}"
    )


def _raylet_tail(temp: str, lines: int = 15) -> str:
    """The last lines of a node's raylet log, under the node's own temp dir (empty when there is none)."""
    logs = sorted(pathlib.Path(temp).glob("session_*/logs/raylet.out")) if temp else []
    if not logs:
        return "(no raylet log)"
    return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:])


def events(spec, kind: str) -> list[dict]:
    """The run's events of one kind, oldest first (what a test watching a driver asks of the log)."""
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == kind]


def run_driver(head: Head, spec, job, env: dict) -> subprocess.Popen:
    """``syncpoint run JOB --address`` against ``head`` as a user on the cluster runs it, the spec
    written to ``job`` first; its output (stdout and stderr together) on the process's stdout pipe."""
    from tests.helpers import ROOT, write_job

    write_job(spec, job)
    return subprocess.Popen(
        [sys.executable, "-m", "syncpoint", "run", str(job), "--address", head.gcs_address],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_driver(
    pred, proc: subprocess.Popen, what: str, timeout: float = 600, output: Callable[[], str] | None = None
) -> None:
    """Poll ``pred`` until it holds, failing with the driver's output if the driver exits first or
    ``timeout`` passes (the driver is then killed). ``output``: where that output is (default: the
    driver's stdout pipe)."""

    def tail() -> str:
        return (output() if output else proc.stdout.read() if proc.stdout else "")[-4000:]

    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited ({proc.returncode}) before {what}:\n{tail()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {timeout:.0f} s:\n{tail()}")
        time.sleep(0.1)


def seen_while_running(proc: subprocess.Popen, probes: list[Callable[[], bool]], timeout: float = 600) -> list[bool]:
    """Poll each probe every 0.1 s until the driver exits (bounded); which ones ever held."""
    seen = [False] * len(probes)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        seen = [s or bool(probe()) for s, probe in zip(seen, probes, strict=True)]
        time.sleep(0.1)
    return seen
