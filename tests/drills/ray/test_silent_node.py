"""A worker node that goes silent mid-run: its link stops carrying packets (no RST, no FIN, no exit
code), as when a reclaimed VM vanishes. Each worker node runs in a network namespace of the test's own
making (tests/netns.py: a bridge on a free 10.213.k.0/24, a veth per node, no other route), the head in
the root namespace bound to the bridge's address; everything any process contacts is an address the
test created.

Asserted: the run notices within a bound (Ray's GCS health check, tuned on this head, declares the node
dead; ``scaling.collective_timeout_s`` is the backstop for the survivors' collectives), the controller
classifies the failure as node loss (the run has ``failure.max_failures: 0``, so only the preemption
budget can pay for it), Ray Train restarts on the remaining node and the spare one, and the run ends at
the digest of an uninterrupted reference.
"""

from __future__ import annotations

import json
import time

import pytest

from syncpoint.orchestrator.timeline import restarts
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import digest, lm_spec, state_names
from tests.netns import INNER_IF, private_network
from tests.ray_processes import add_worker_node, local_head, ray_env, run_driver, worker_nodes
from tests.ray_processes import events as _events
from tests.ray_processes import wait_for_driver as _wait_for

# The GCS declares a silent node dead after `failure_threshold` health checks in a row fail, each after
# `timeout_ms` of silence, `period_ms` apart: here at most 5 x (3 + 1) = 20 s (Ray's defaults: 5 x
# (10 + 3) = 65 s). Not tighter: a healthy node on this loaded 2-core machine must not miss 5 in a row.
HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 3000, "health_check_failure_threshold": 5}
# The survivors' backstop (the default is 600 s; torch's and Ray Train's 1800 s). Not what detects the
# silence here (the health check does, long before); it must only never cut a legitimate wait short: on
# this loaded machine a rank building DeepSpeed's shm op (seen: 6 minutes) keeps the other waiting in
# DeepSpeed's first new_group, and 60 s failed a restart that way.
COLLECTIVE_TIMEOUT_S = 300
# what the test accepts between the cut and the controller's decision: the health check (20 s) and the
# controller's bounded wait for the node's death (SYNCPOINT_NODE_DEATH_WAIT_S, 30 s), with room for this
# machine's load; torch's default collective timeout alone would be 1800 s (measured here: ~21 s)
DETECTION_BOUND_S = 20 + 30 + 90

# ~400 micro-steps paced at 50 ms (numerics unchanged): long enough to cut the link mid-run
LENGTH = ["task.config.num_samples=1600", "train.epochs=1", "checkpoint.save_every={value: 40, unit: micro_steps}"]
RUN = [
    *LENGTH,
    "failure.max_failures=0",
    f"scaling.collective_timeout_s={COLLECTIVE_TIMEOUT_S}",
    "task.path=tests.tasks:paced_lm",
    "task.config.pace_s=0.05",
]


def _env() -> dict:
    env = ray_env()
    # gloo binds to the interface of this name (each namespace's end of its veth); the host name
    # resolves to 127.0.0.1 here, which gloo would otherwise fall back to and other nodes cannot reach
    env.update(GLOO_SOCKET_IFNAME=INNER_IF, RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="0.5")
    return env


@pytest.mark.timeout(1800)  # three Ray worker nodes and two worker groups on 2 shared cores
def test_a_node_that_goes_silent_is_node_loss_and_the_run_resumes_exactly(tmp_path):
    spec = lm_spec(tmp_path / "run", *RUN, workers=2)
    with (
        private_network() as net,
        local_head(_env(), num_cpus=0, system_config=json.dumps(HEALTH), node_ip=net.head_ip) as head,
        worker_nodes(head, 0, _env()) as nodes,
    ):
        netns_of = {}
        for _ in range(3):  # two for the ranks, one spare (the autoscaler's replacement, already up)
            ns = net.add_node()
            node = add_worker_node(head, _env(), prefix=ns.prefix, node_ip=ns.ip)
            nodes.append(node)
            netns_of[node.node_id] = ns
        proc = run_driver(head, spec, tmp_path / "job.yaml", _env())
        try:
            _wait_for(lambda: bool(_events(spec, "state_committed")), proc, "a committed state")
            first = _events(spec, "attempt_started")[0]
            victim = netns_of[first["nodes"][1]]  # rank 1's node
            victim.cut()
            cut_at = time.time()
            out, _ = proc.communicate(timeout=1500)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-4000:]

    failure = _events(spec, "failure")[0]  # later ones only if this loaded machine stalls a restart
    assert failure["classified"] == "preemption" and failure["decision"] == "RETRY", failure  # max_failures is 0
    assert failure["dead_nodes"] == [first["nodes"][1]], failure
    measured = _events(spec, "interrupted")
    assert measured, f"no interruption point was measured; the driver's output ends:\n{out[-3000:]}"
    interrupted = measured[0]
    detected_after = interrupted["detected_at"] - cut_at
    print(f"the silent node was detected {detected_after:.1f} s after its link was cut ({failure['reason']})")
    assert detected_after < DETECTION_BOUND_S, (detected_after, failure)
    last = _events(spec, "attempt_started")[-1]
    assert last["resumed_from"] is not None and first["nodes"][1] not in last["nodes"]  # off the silent node
    assert all(r.cause == "preemption" for r in restarts(EventLog(RunStorage(spec.run_url)).journal()))
    final = state_names(spec)[-1]
    ref = lm_spec(tmp_path / "ref", *LENGTH, workers=2)  # the example's task, unpaced: the same numerics
    assert run_spawned(ref) == [0, 0]
    assert digest(spec, final) == digest(ref, final)
