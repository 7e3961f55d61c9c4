"""Warm servers through the real path: ``syncpoint run --address`` on a `ray start` cluster of two
one-CPU worker nodes (each with its own temp dir, as separate machines have), one rank, and a
preemption notice that hands the rank's node to Ray Train. The driver warms both nodes while the
job runs, the spare one too (a lost node's replacement already in the cluster); Ray Train's new
worker group forks its training process from a warm server, the run ends bitwise where the
uninterrupted one ends, and no server outlives the job.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest

from syncpoint.policies.contracts.journal import AttemptStarted
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests import ray_processes as rp
from tests.helpers import committed_steps, digest, lm_spec

COMMON = ["task.config.num_samples=96", "train.epochs=1", "checkpoint.save_every={value: 4, unit: micro_steps}"]


def _sockets(temp: str) -> list[str]:
    warm = os.path.join(temp, f"syncpoint-warm-{os.getuid()}")
    return [n for n in os.listdir(warm) if n.endswith(".sock")] if os.path.isdir(warm) else []


# make test: an embedded run keeps its node warm and stops its server, and an in-place recovery
# forks warm and bitwise (tests/integration/workers/supervision/test_zygote_warm_server.py); spares on a
# cluster (tests/ray/test_spare_workers_on_ray.py)
@pytest.mark.long
def test_every_node_is_warm_a_restart_forks_warm_and_no_server_outlives_the_job(tmp_path):
    ref = lm_spec(tmp_path / "ref", *COMMON, workers=1)
    assert run_spawned(ref) == [0]
    ref_final = f"{max(committed_steps(ref)):012d}"

    spec = lm_spec(tmp_path / "run", *COMMON, "faults=[{rank: 0, at_micro_step: 10, mode: sigterm}]", workers=1)
    temps = [tempfile.mkdtemp(prefix="spn-", dir="/tmp") for _ in range(2)]  # short: a socket's path is bounded
    try:
        with rp.local_head(rp.ray_env(), num_cpus=0) as head, rp.worker_nodes(head, 0, rp.ray_env()) as nodes:
            for temp in temps:
                nodes.append(rp.add_worker_node(head, {**rp.ray_env(), "TMPDIR": temp}))
            proc = rp.run_driver(head, spec, tmp_path / "job.yaml", rp.ray_env())
            warm = rp.seen_while_running(proc, [functools.partial(_sockets, t) for t in temps])
            out, _ = proc.communicate(timeout=60)
            left = [_sockets(t) for t in temps]
        assert proc.returncode == 0, out[-4000:]
        assert warm == [True, True]  # the node without a rank was warm too
        assert left == [[], []]  # the driver stopped both servers at the job's end
        started = EventLog(RunStorage(spec.run_url)).journal().of_kind(AttemptStarted)
        assert [a.attempt for a in started] == [1, 2]
        assert started[1].warm_start is True, out[-4000:]  # Ray Train's new worker group forked warm
        final = f"{max(committed_steps(spec)):012d}"
        assert final == ref_final and digest(spec, final) == digest(ref, ref_final)
    finally:
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)
