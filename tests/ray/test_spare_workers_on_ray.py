"""Spare Ray worker processes (``syncpoint.orchestrator.spare_workers``) on real Ray: an embedded
instance whose raylet preloads Ray Train's worker module, and a `ray start` head. A request from a
worker of the job starts processes the next actors of that job take (found by identity, not by
timing), each with Ray Train imported before it was asked for; the job's end ends the spares; a
process that is no Ray worker cannot ask, and says so instead of raising.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from syncpoint.orchestrator import spare_workers
from syncpoint.orchestrator.embedded_ray import NO_PRESTART
from tests.helpers import lm_spec
from tests.own_processes import MARK, marked_env, marked_processes

WAIT_S = 120.0  # a bound for processes to appear or go on a loaded two-core machine, never a measurement


def _wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"not within {WAIT_S:.0f} s: {what}"
        time.sleep(0.2)


def _registered(pid: int) -> bool:
    """Whether the worker process ``pid`` has registered with the raylet and serves: its core worker's log
    says "Initializing worker at address", which it writes once the raylet answered its registration and its
    own server listens. Not just its log files existing (created as the interpreter starts, seconds before):
    waiting for those, a probe once took a new process beside a spare that was not registered yet, and again
    on a loaded machine (make test beside other checks)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    for log in logs.glob(f"python-core-worker-*_{pid}.log"):
        with contextlib.suppress(OSError), log.open(errors="replace") as f:
            if "Initializing worker at address" in f.read(1 << 20):
                return True
    return False


def test_the_next_actors_of_the_job_take_the_spares_with_ray_train_imported(tmp_path):
    import ray

    spec = lm_spec(tmp_path, workers=2)  # in place, warm nodes, CPU: spares wanted
    _, mark = marked_env({})
    with spare_workers.preloading_raylet(spec):
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            runtime_env={"env_vars": {MARK: mark}},  # every worker process of this job carries the mark
            _system_config=dict(NO_PRESTART),
        )
    try:

        @ray.remote(num_cpus=0)
        class Asker:
            def ask(self, count: int) -> tuple[bool, int]:
                import os

                return spare_workers.request(count), os.getpid()

        @ray.remote(num_cpus=1)
        class Probe:
            def __init__(self) -> None:
                self.preloaded = spare_workers.TRAIN_WORKER_MODULE in sys.modules  # before anything imports it

            def where(self) -> tuple[int, bool]:
                import os

                return os.getpid(), self.preloaded

        asker = Asker.remote()
        asked, asker_pid = ray.get(asker.ask.remote(2))
        assert asked
        spares: set[int] = set()

        def both_up() -> bool:
            spares.update(p.pid for p in marked_processes(mark) if p.pid != asker_pid)
            return len(spares) >= 2 and all(_registered(pid) for pid in spares)

        # each registered with the raylet, which hands an actor to an idle registered worker, never to a
        # process still starting (seen once: a probe took a new process beside a spare not yet registered)
        _wait_for(both_up, "two spare worker processes of the job, each registered with the raylet")
        assert len(spares) == 2, spares  # what was asked for, no more
        probes = [Probe.remote() for _ in range(2)]
        found = ray.get([p.where.remote() for p in probes])
        assert {pid for pid, _ in found} == spares  # the actors took the spares, no new process
        assert all(preloaded for _, preloaded in found)  # Ray Train was imported before the actor came
    finally:
        ray.shutdown()


DRIVER = textwrap.dedent(
    """
    import sys, time, ray
    from syncpoint.orchestrator import spare_workers
    ray.init(address=sys.argv[1], runtime_env={"env_vars": {sys.argv[2]: sys.argv[3]}})

    @ray.remote(num_cpus=0)
    class Asker:
        def ask(self):
            return spare_workers.request(2)

    asker = Asker.remote()
    assert ray.get(asker.ask.remote())
    print("asked", flush=True)
    sys.stdin.readline()  # the test says when the job ends
    """
)


def test_the_spares_end_with_the_job_on_a_cluster(tmp_path, shared_head):
    _, mark = marked_env({})
    head, env = shared_head  # the Ray tests' `ray start` head (tests/ray/conftest.py), its token in env
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, head.gcs_address, MARK, mark],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        seen = []
        for line in proc.stdout:  # Ray's own lines first; ends if the driver exits without asking
            seen.append(line)
            if line.strip() == "asked":
                break
        assert seen and seen[-1].strip() == "asked", "".join(seen)[-3000:]
        _wait_for(lambda: len(marked_processes(mark)) >= 3, "the asker and two spares")  # seen: the finder works
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
        _wait_for(lambda: not marked_processes(mark), "no spare left after the job's end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_process_that_is_no_ray_worker_cannot_ask_and_does_not_raise():
    import ray

    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray instance")
    assert spare_workers.request(1) is False
