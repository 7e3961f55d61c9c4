"""Quiet by default (issue 50): what a user reads of a run says each thing once and says it right.

Here: the ``submitted`` event names where the submission really went (a Ray Job by its submission id,
not "embedded"); a node's death shows as Ray's first sentences, not 20 lines of the raylet's log; a rank's
output stream keeps or drops whole lines (tests/integration/workers/observation/test_rank_output_quiet_output.py: on
real ranks)."""

from __future__ import annotations

import json

from syncpoint.orchestrator.ray_runner import submitted_to


def _ray_job_environ(job_id: str, gcs: str) -> dict[str, str]:
    """A Ray Job entrypoint's environment, as the installed Ray's job supervisor builds it (its own
    constants: a Ray that renames them fails this test)."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.dashboard.modules.job.common import JOB_ID_METADATA_KEY, JOB_NAME_METADATA_KEY

    config = {"runtime_env": {}, "metadata": {JOB_ID_METADATA_KEY: job_id, JOB_NAME_METADATA_KEY: job_id}}
    return {RAY_JOB_CONFIG_JSON_ENV_VAR: json.dumps(config), "RAY_ADDRESS": gcs}


def test_a_ray_job_submission_is_named_as_one_and_a_local_run_as_embedded():
    job = _ray_job_environ("raysubmit_8RkJ", "10.0.0.7:6379")
    assert submitted_to(None, job) == "Ray job raysubmit_8RkJ on 10.0.0.7:6379"
    assert submitted_to(None, {}) == "embedded"
    assert submitted_to(None, {"RAY_ADDRESS": "10.0.0.7:6379"}) == "10.0.0.7:6379"
    assert submitted_to("ray://u:secret@head:10001", {}) == "ray://***@head:10001"
    assert submitted_to(None, {}, connected=True) == "the caller's Ray"
    assert submitted_to(None, {"RAY_JOB_CONFIG_JSON_ENV_VAR": "not json"}) == "embedded"


def test_the_timeline_says_where_a_ray_job_went():
    from syncpoint.orchestrator.timeline import _line
    from syncpoint.policies.contracts.journal import Submitted

    where = submitted_to(None, _ray_job_environ("raysubmit_8RkJ", "10.0.0.7:6379"))
    line = _line(Submitted(time=1.0, source="driver", name="nanogpt", address=where), 0.0)
    assert line is not None and "nanogpt to Ray job raysubmit_8RkJ on 10.0.0.7:6379" in line
    assert "embedded" not in line


# ---------------------------------------------------------------- a node's death on the driver
# The raylet's own log as its agents read it back when it dies (its start-up: workers and gRPC clients).
RAYLET_LOG = [
    "[2026-12-05 15:30:40,198 I 30625 30625] (raylet) runtime_env_agent_client.cc:395: Create runtime env for job 01",
    "[2026-12-05 15:30:40,199 I 30625 30634] (raylet) object_store.cc:37: Object store current usage 8e-09 / 0.16 GB.",
    "[2026-12-05 15:30:40,324 I 30625 30625] (raylet) worker_pool.cc:564: Started worker process with pid 31209",
    "[2026-12-05 15:30:53,800 I 30625 30625] (raylet) grpc_client_manager.h:65: Starting gRPC client manager",
] * 8
# What the GCS publishes when it marks a node dead (Ray's C++ wording, as a driver received it).
NODE_DEAD = (
    "The node with node id: 84bde642aeab3e982c559eac73ec4573d358498e2cd424c848f4a956 and address: 192.0.2.2 and "
    "node name: 192.0.2.2 has been marked dead because the detector has missed too many heartbeats from it. This "
    "can happen when a \t(1) raylet crashes unexpectedly (OOM, etc.) \n\t(2) raylet has lagging heartbeats due to "
    "slow network or busy workload."
)


def _raylet_died_message(tmp_path, monkeypatch) -> str:
    """The message a node's agent publishes when its raylet dies, made by the installed Ray's own code."""
    import ray._private.utils
    from ray._private import process_watcher

    (tmp_path / "raylet.out").write_text("\n".join(RAYLET_LOG) + "\n")
    published: list[str] = []
    monkeypatch.setattr(ray._private.utils, "publish_error_to_driver", lambda kind, msg, **kw: published.append(msg))
    process_watcher.report_raylet_error_logs(str(tmp_path), gcs_client=None)
    (message,) = published
    return message


def test_a_dead_raylets_log_dump_is_cut_to_its_first_sentences_once(tmp_path, monkeypatch):
    from syncpoint.orchestrator.quiet import quiet_raylet_message

    message = _raylet_died_message(tmp_path, monkeypatch)
    assert len(message.splitlines()) > 20  # what Ray alone prints: the header and 20 lines of the raylet's log
    seen: set[str] = set()
    kept = quiet_raylet_message(message, seen)
    assert kept is not None and kept.startswith("Raylet is terminated. Termination is unexpected.")
    assert "\n" not in kept and "Last 20 lines" not in kept and "worker_pool.cc" not in kept, kept
    assert quiet_raylet_message(message, seen) is None  # the node's other agent sends the same text
    dead = quiet_raylet_message(NODE_DEAD, seen)
    assert dead is not None and "\n" not in dead and "84bde642aeab" in dead and dead.endswith("heartbeats from it.")
    other = "A worker died or was killed while executing a task by an unexpected system error."
    assert quiet_raylet_message(other, seen) == other  # anything else the raylet says shows as it is


def test_the_driver_prints_a_nodes_death_in_two_lines(tmp_path, monkeypatch, capsys):
    """Through the function Ray's driver prints the cluster's error messages with (its error thread
    looks it up at each message, so the driver's filter is in place after ``ray.init``)."""
    import inspect

    from ray._private import worker as ray_worker

    from syncpoint.orchestrator import quiet

    assert "print_to_stdstream(" in inspect.getsource(ray_worker.listen_error_messages)
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored afterwards
    monkeypatch.setattr(quiet, "_RAYLET_SEEN", set())
    quiet.quiet_driver()
    message = _raylet_died_message(tmp_path, monkeypatch)
    for text in (NODE_DEAD, message, message):  # as the GCS and the node's two agents send them
        ray_worker.print_to_stdstream({"lines": [text], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "marked dead" in out[0] and "Raylet is terminated" in out[1], out


# ---------------------------------------------------------------- a rank's output
def test_a_ranks_stream_keeps_whole_lines_and_syncpoints_own():
    import io

    from syncpoint.workers.observation.rank_output import RankStream

    dropped = io.StringIO()
    s = RankStream(dropped, "[rank 1] ", keep=False)  # train.prints: rank0, on rank 1
    print("model has 49 parameters", file=s)
    s.write("[sync")
    s.write("point] rank 1: no warm server\nloss ")  # syncpoint's own line, written in pieces
    s.write("0.5\n[s\nsyncpoint: waiting for the lease\n:task_name:f\n")  # Ray's marker passes as it is
    assert dropped.getvalue() == "[syncpoint] rank 1: no warm server\nsyncpoint: waiting for the lease\n:task_name:f\n"
    kept = io.StringIO()
    s = RankStream(kept, "[rank 1] ", keep=True)  # train.prints: all, or any rank's stderr
    print("step", 3, file=s)
    s.write("a\nb")
    s.write("c\n:actor_name:RayTrainWorker\n[s")
    s.flush()  # a kept line's start shows when flushed
    s.write("yncpoint] x\n")
    assert kept.getvalue() == (
        "[rank 1] step 3\n[rank 1] a\n[rank 1] bc\n:actor_name:RayTrainWorker\n[rank 1] [syncpoint] x\n"
    )


# ---------------------------------------------------------------- a worker group's failure on Ray
def _wrapped(error: BaseException) -> BaseException:
    """``error`` raised in a Ray Train rank and logged by Ray's own ``construct_user_exception_with_traceback``
    (inside its handler: it formats the exception being handled)."""
    from ray.train.v2._internal.util import construct_user_exception_with_traceback

    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - the test wants it with its traceback
        return construct_user_exception_with_traceback(e)


def _rank_failure(error: BaseException) -> BaseException:
    """``error`` as the controller receives it from a rank: raised through the rank's entry point
    (``train_loop_per_worker`` attaches its traceback), pickled across processes without its traceback."""
    import pickle

    from syncpoint.workers.supervision.failure_site import attach_traceback

    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - the test wants it with its traceback
        attach_traceback(e)
        return pickle.loads(pickle.dumps(e))


def _group_failure(**by_rank: BaseException) -> BaseException:
    """A worker group's failure as Ray Train v2's controller gets it: each rank's own exception
    (Ray's poll unwraps its ``UserExceptionWithTraceback``) under the group's error snippet."""
    from ray.train.v2.api.exceptions import WorkerGroupError

    return WorkerGroupError("snippet", {int(r[4:]): _rank_failure(e) for r, e in by_rank.items()})


def test_ray_trains_per_rank_traceback_is_dropped_in_the_worker(monkeypatch, tmp_path):
    """The installed Ray Train's own log of a failing rank (every rank logs one) never leaves the worker."""
    import logging

    from ray.train.v2._internal import util as train_util

    from syncpoint.orchestrator.quiet import quiet_worker
    from tests.helpers import linear_spec

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    logger = logging.getLogger(train_util.logger.name)
    kept: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        quiet_worker(linear_spec(tmp_path), trains_here=False)
        _wrapped(ValueError("bad batch at call 3"))
        logger.error("something else went wrong")
    finally:
        logger.removeHandler(handler)
        for f in list(logger.filters):
            logger.removeFilter(f)
    assert kept == ["something else went wrong"]


def test_the_controller_prints_the_failing_ranks_traceback_once(capsys):
    from syncpoint.orchestrator.failure_policy import print_failure
    from syncpoint.workers.supervision.supervisor import reported

    bug = _group_failure(rank0=ValueError("bad batch at call 3"), rank1=ValueError("bad batch at call 3"))
    print_failure(bug, repeats=False)
    err = capsys.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1 and err.startswith("[syncpoint] rank 0 failed:\n"), err
    assert err.strip().splitlines()[-1] == "[syncpoint] rank 1 also failed: ValueError: bad batch at call 3", err
    print_failure(bug, repeats=True)
    assert capsys.readouterr().err.splitlines() == [
        "[syncpoint] rank 0 failed again the same way: ValueError: bad batch at call 3",
        "[syncpoint] rank 1 also failed: ValueError: bad batch at call 3",
    ]
    # in place: rank 0's decision printed it already
    print_failure(_group_failure(rank0=reported(ValueError("bad batch at call 3"))), repeats=False)
    assert capsys.readouterr().err == ""


def test_a_lost_nodes_decision_line_names_the_node_not_the_health_check(capsys):
    """Ray's error on the ranks a lost node left behind is a failed health check; syncpoint's line says
    what happened (no traceback: nothing of the user's failed)."""
    import uuid

    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.config import FailureConfig

    from syncpoint.orchestrator.failure_policy import SyncpointFailurePolicy
    from syncpoint.policies.decisions.failures import FailureFacts

    policy = SyncpointFailurePolicy(FailureConfig(max_failures=0), f"memory://lost-{uuid.uuid4().hex[:8]}")
    facts = FailureFacts(
        ray_says_preempted=False,
        dead_attempt_nodes=("84bde642aeab3e982c559eac73ec4573d358498e2cd424c848f4a956",),
        notice_logged=False,
        messages=("WorkerHealthCheckFailedError: A worker health check failed.",),
    )
    lost = _group_failure(rank1=RuntimeError("A worker health check failed."))
    assert policy.decide(facts, lost) == FailureDecision.RETRY
    err = capsys.readouterr().err
    assert err.startswith("[syncpoint] attempt failed (a preemption: node(s) lost: 84bde642aeab): retry"), err
    assert "Traceback" not in err and "health check" not in err, err


def test_a_crash_or_a_refusal_prints_no_failure_lines_of_its_own():
    """Only a raised error of the task's has a traceback worth printing; a process that died (a drill's
    crash) or syncpoint's own refusal is said by the decision's line and the run's last line."""
    from syncpoint.policies.decisions.failures import DIED, RAISED, RankEnd, failure_lines

    peer = RankEnd(rank=0, status=RAISED, message="RuntimeError: Connection closed by peer", traceback="Traceback ...")
    died = RankEnd(rank=1, status=DIED, message="the training process exited with code 17")
    refused = RankEnd(rank=0, status=RAISED, message="Task.loss must return ...", ours=True, traceback="Traceback ...")
    assert failure_lines([peer, died], repeats=False) == []
    assert failure_lines([refused, died], repeats=False) == []
    bug = RankEnd(rank=1, status=RAISED, message="ValueError: x", traceback="Traceback (most recent call last):\n")
    assert failure_lines([peer, bug], repeats=False) == [
        "[syncpoint] rank 1 failed:",
        "Traceback (most recent call last):",
        "[syncpoint] rank 0 also failed: RuntimeError: Connection closed by peer",
    ]
