"""``syncpoint run --local``: the job's ranks on this machine without Ray, for the quickest iteration.

Why: the loop needs only a torch process group, and on one machine Ray's part of a cold start (its
local instance, Ray Train's controller, the worker group: more than half of the seconds to the first
step, bench P12) buys nothing a run of a few ranks here needs. Here the driver forks each rank from
this node's warm server (torch and DeepSpeed already imported, ``syncpoint.workers.supervision.zygote``)
through the same launcher the tests use, and keeps every rule of a run on Ray that is not Ray's own:
the same selection, resume and lease; failures within ``failure.max_failures`` recovered in place by
each rank's supervisor (a failure past it, or a refusal, fails the run with the same last line); the
driver's SIGINT, SIGTERM and SIGHUP as the job's stop notice (every rank saves at its next sync
boundary, then stops; a second signal stops at once); the same summary, events and exit codes.
What only a cluster gives is not here: more than one node, Ray Train's restarts of a lost worker
group, a node's drain notice.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.grace_window import Notice
from syncpoint.policies.decisions.redact import redact_text

if TYPE_CHECKING:
    from syncpoint.orchestrator.ray_runner import JobOutcome

STOP_FILE = "stop"  # in the driver's private temp directory: the signal's name once the driver is signalled


class LocalBoard:
    """The driver's stop notice for ranks on this machine, as ``DriverSignals`` marks a board
    (``board.stop.remote(notice)``): the signal's name written to a file in a directory only this user
    can enter (0700), which each rank's supervisor reads at every boundary
    (``syncpoint.workers.supervision.rank_process.driver_notice``)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, STOP_FILE)
        self.stop = self  # ``board.stop.remote(...)``, the heartbeat board's spelling

    def remote(self, notice: Notice) -> None:
        fd = os.open(self.path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, str(notice.get("signal", "SIGTERM")).encode("ascii"))
        finally:
            os.close(fd)
        os.replace(self.path + ".new", self.path)


@contextlib.contextmanager
def prewarmed(spec: JobSpec) -> Iterator[str]:
    """This run's warm server started now, for the block (the driver's checks of the spec, its task's
    imports and its storage, then ``run_local``); yields the submission id the ranks will find it by.

    Why before the checks: the server imports torch and DeepSpeed (seconds) in its own process, so
    it does so while the driver checks; the ranks' supervisors, forked seconds later, find it
    started (``zygote.ensure``: a keeper of the same key answers) instead of starting it then and
    waiting for its imports (bench P12). However the block ends (the run's end, a refused spec, a
    signal) it stops the server; the run watchdog, started first, ends it if the driver dies."""
    from syncpoint.orchestrator.run_watchdog import ensure
    from syncpoint.policies.decisions.seeds import hash_seed
    from syncpoint.workers.supervision import zygote
    from syncpoint.workers.supervision.fork_context import start_method

    ensure()  # the warm server carries the driver's mark from its start
    _import_path_as_on_ray()
    # DeepSpeed fixes its accelerator when imported: told it, the warm server imports it for these ranks
    # and loads its CPU op ahead (warm_ops), and the ranks fork from it (fork_context.start_method), as
    # a Ray worker's setup tells its node's server; without it every rank was spawned and imported cold
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if spec.scaling.use_gpu else "cpu")
    submission = uuid.uuid4().hex
    key = None
    if start_method(spec) == "forkserver":  # run_spawned's condition for a warm server
        seed = str(hash_seed(spec.train.seed))
        key = zygote.key(submission, seed)
        with contextlib.suppress(zygote.Unavailable, OSError):  # the ranks start it (or fork their own)
            sock, _ = zygote.ensure(key, seed, env=zygote.server_env(spec))
            sock.close()
    try:
        yield submission
    finally:
        if key is not None:
            zygote.stop(key)


def _import_path_as_on_ray() -> None:
    """The working directory first on the import path, as a Ray job's driver puts it on its workers'
    (the task's modules are found there, whatever directory the ``syncpoint`` command lives in): the
    ranks take this process's path, and the warm server the path of whoever starts it."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def run_local(spec: JobSpec, rerun: str, submission: str | None = None) -> JobOutcome:
    """Run the job's ranks here, without Ray; returns how it ended (``run_on_ray``'s ``JobOutcome``).
    ``submission``: ``prewarmed``'s, whose warm server the ranks fork from (default a new one)."""
    from syncpoint.orchestrator.driver_signals import DriverSignals
    from syncpoint.orchestrator.ray_runner import JobOutcome, await_predecessor, finished_since, stopped
    from syncpoint.orchestrator.run_watchdog import ensure
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.state.memory_copy import remove_for
    from syncpoint.workers.storage import RunStorage

    ensure()  # nothing the run starts (its warm server, its ranks, their loader workers) outlives it
    submitted = EventLog(RunStorage(spec.run_url), source="driver").emit(
        "submitted", name=spec.name, address="this machine (--local, no Ray)"
    )
    await_predecessor(spec)
    say = _say(spec)
    private = tempfile.mkdtemp(prefix="syncpoint-local-")  # 0700: only this user writes the stop notice
    submission = submission or uuid.uuid4().hex
    try:
        with DriverSignals(spec.checkpoint.sigterm_grace_s, say, rerun) as signals:
            signals.install()
            signals.attach(LocalBoard(private))
            try:
                codes = _ranks(spec, submission, os.path.join(private, STOP_FILE))
            except KeyboardInterrupt:  # a second signal (``driver_signals.StopNow``): the ranks were ended
                if not signals.at_once:
                    raise
                return stopped(spec, signals, at_once=True)
            if signals.received is not None and not finished_since(spec, submitted.time):
                return stopped(spec, signals)
    finally:
        remove_for(spec.run_url)  # the run's memory copies end with it
        shutil.rmtree(private, ignore_errors=True)
    if any(codes):
        return _failed(spec, submission, codes)
    from syncpoint.orchestrator.run_outcome import finish

    line, summary = finish(spec)
    return JobOutcome(line=line, failed=False, summary=summary)


def _ranks(spec: JobSpec, submission: str, stop_file: str) -> list[int]:
    """Each rank forked from the node's warm server, supervising its training process in place, with
    the working directory first on their import path (``_import_path_as_on_ray``)."""
    from syncpoint.orchestrator.quiet import quiet_training_process
    from syncpoint.workers.supervision.launch import run_spawned

    _import_path_as_on_ray()

    return run_spawned(
        spec,
        world_size=spec.scaling.max_workers,
        timeout=float("inf"),
        quiet=False,
        in_place=True,
        submission=submission,
        stop_file=stop_file,
        child_setup=quiet_training_process,  # as on Ray: DeepSpeed's deprecation and op-build lines dropped
    )


def _failed(spec: JobSpec, submission: str, codes: list[int]) -> JobOutcome:
    """The failed run's last line: the failure rank 0's supervisor recorded (its reason names where),
    else the ranks' exit codes."""
    from syncpoint.orchestrator.ray_runner import JobOutcome
    from syncpoint.orchestrator.run_outcome import not_retried
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    reason = f"the ranks exited {codes} (their errors are above)"
    with contextlib.suppress(Exception):  # an unreadable log: the exit codes still say it failed
        failures = [f for f in EventLog(RunStorage(spec.run_url)).journal().failures if f.submission == submission]
        if failures and failures[-1].decision == "RAISE":
            reason = failures[-1].reason + not_retried(spec, submission)
    reason = redact_text(reason, spec.storage)
    return JobOutcome(line=f"syncpoint: job {spec.name!r} failed: {reason}", failed=True, reason=reason)


def _say(spec: JobSpec) -> Any:
    def say(line: str) -> None:
        print(redact_text(line, spec.storage), file=sys.stderr, flush=True)

    return say
