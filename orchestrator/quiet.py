"""The messages syncpoint quiets: in the CLI's process, on the driver (the worker log stream and the
cluster's error messages it prints), in every Ray worker process of a job and in every process that
trains (the mechanism: ``syncpoint.workers.observation.log_filters``; ``syncpoint.orchestrator.worker_setup``
uses ``drop`` from here too)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from syncpoint.workers.observation.log_filters import drop

if TYPE_CHECKING:  # every Ray worker process imports this module (its setup hook): nothing heavy at import
    from syncpoint.policies.contracts.spec import JobSpec

# DeepSpeed logs (its "DeepSpeed" logger, warning) whenever it is imported without DS_ACCELERATOR on a
# machine without a GPU. The CLI's own process (digest, the drill's comparison) imports it to read
# states, which needs no accelerator; the workers are told which one (quiet_worker, below).
ACCELERATOR_LINE = r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it\.$"


def quiet_cli() -> None:
    """In the CLI's process, before anything imports DeepSpeed."""
    drop("DeepSpeed", ACCELERATOR_LINE)


# ---------------------------------------------------------------- what Ray publishes when a node dies
# Each Ray agent of a node (the dashboard's and the runtime env's) publishes to every driver, when its
# raylet dies unexpectedly (a lost spot node, a kill), "Raylet is terminated. Termination is unexpected.
# Possible reasons include: (1) ..., (3) Other termination signals. Last 20 lines of the Raylet logs:"
# followed by those 20 lines: the raylet's own log of starting workers and gRPC clients, nothing about why
# it died (ray._private.process_watcher.report_raylet_error_logs). Its first sentences stay, once (both
# agents send the same text, and it names no node); the log lines go.
RAYLET_DIED = re.compile(
    r"^(Raylet is terminated\. Termination is unexpected\.[^\n]*?)\s*Last \d+ lines of the Raylet logs:\n", re.DOTALL
)
# The GCS says which node it marked dead, then lists two possible causes over two more lines: the first
# sentence, with the node's id and address, stays (syncpoint's own line says what the run does about it).
NODE_MARKED_DEAD = re.compile(
    r"^(The node with node id: \w+ and address: \S+ and node name: \S+ has been marked dead because the "
    r"detector has missed too many heartbeats from it\.) This can happen when a\s"
)


def quiet_raylet_message(message: str, seen: set[str]) -> str | None:
    """One message Ray shows as ``(raylet)``: as it is, cut to its first sentences (the two above), or
    None when ``seen`` (this driver's earlier ones) holds it already."""
    for pattern in (RAYLET_DIED, NODE_MARKED_DEAD):
        if (m := pattern.match(message)) is not None:
            message = m.group(1)
            break
    else:
        return message
    if message in seen:
        return None
    seen.add(message)
    return message


# ---------------------------------------------------------------- the driver and the job's processes
# A successful run shows syncpoint's lines and real problems. Each message below is quieted at its
# source, by exact text, and only because it says nothing about this run; anything else from the
# same loggers and streams still shows (every worker process of the job as it starts:
# syncpoint.orchestrator.worker_setup).
# Ray's core worker logs (C++, once per process, error level) that the PreemptionWatcher actor has
# "constructor arguments in the object store and max_restarts > 0". Ray Train's PreemptionCallback
# creates it (max_restarts=-1) with the worker group's actor handles as arguments; the watcher is
# killed with that worker group, whose handles the controller holds all along, so a restart of the
# watcher finds them (ray-project/ray#53727 is about arguments that go out of scope). Not ours to
# change: we drop that one line, for that one class, from the log stream the driver prints.
WATCHER_ARGS_LINE = re.compile(
    r"Actor with class name: 'PreemptionWatcher' and ID: '\w+' has constructor arguments "
    r"in the object store and max_restarts > 0"
)


_RAYLET_SEEN: set[str] = set()  # the (raylet) messages this driver showed (quiet.quiet_raylet_message)


def quiet_stream_data(data: dict) -> dict | None:
    """One batch of lines Ray is about to print on the driver, without the messages above and with
    the node-death messages cut to their first sentences (``syncpoint.orchestrator.quiet``); None: nothing left."""
    lines = [ln for ln in data.get("lines", []) if not WATCHER_ARGS_LINE.search(ln)]
    if data.get("pid") == "raylet":
        lines = [kept for ln in lines if (kept := quiet_raylet_message(ln, _RAYLET_SEEN)) is not None]
    return {**data, "lines": lines} if lines else None


def _filtered_log_handler(handler: Callable[[dict], None]) -> Callable[[dict], None]:
    def handle(data: dict) -> None:
        if (kept := quiet_stream_data(data)) is not None:
            handler(kept)

    handle._syncpoint_filtered = True  # type: ignore[attr-defined]  # a marker: quiet_driver wraps a handler once
    return handle


def _quiet_error_messages() -> None:
    """Ray's driver prints the errors the cluster publishes (a node's death among them) through
    ``ray._private.worker.print_to_stdstream``, which its error thread looks up at each message: that
    function, filtered by ``quiet_stream_data``, once per process."""
    try:
        from syncpoint.orchestrator.ray_internals import ray_worker
    except ImportError:  # another Ray: the messages show whole, nothing else changes
        return
    original = ray_worker.print_to_stdstream
    if getattr(original, "_syncpoint_filtered", False):
        return

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        if (kept := quiet_stream_data(data)) is not None:
            original(kept, ignore_prefix)

    print_to_stdstream._syncpoint_filtered = True  # type: ignore[attr-defined]  # a marker: wrapped once
    ray_worker.print_to_stdstream = print_to_stdstream


def quiet_driver() -> None:
    """On the driver, after ``ray.init``: filter the worker log stream and the cluster's error
    messages it prints (see above)."""
    _quiet_error_messages()
    try:
        from syncpoint.orchestrator.ray_internals import stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray: the line shows, nothing else changes
        return
    with dispatcher._lock:
        dispatcher.handlers = [
            (
                name,
                h if getattr(h, "_syncpoint_filtered", False) or name != "ray_print_logs" else _filtered_log_handler(h),
            )
            for name, h in dispatcher.handlers
        ]


def quiet_driver_start() -> None:
    """On the driver, before ``ray.init``: Ray's notice that a new local cluster uses token
    authentication by default (it does; nothing to act on) is dropped at its logger."""
    from syncpoint.orchestrator.ray_internals import AUTH_TOKEN_LOGGER

    drop(AUTH_TOKEN_LOGGER, r"^Token authentication is enabled for this Ray cluster\.")


def quiet_worker(spec: JobSpec, trains_here: bool = True) -> None:
    """In a worker, before DeepSpeed is imported. ``trains_here`` false: a supervisor, whose training
    process quiets DeepSpeed itself; importing DeepSpeed here would cost the worker group seconds."""
    # Ray Train v2 logs every ray.train.report at INFO ("Reporting training result N: TrainingReport(
    # checkpoint=None, metrics={...}) from rank R"), once per rank and logged step: the metrics are the
    # ones the progress line (or the driver's bar) already shows. Its logger is named by its file path.
    try:
        from syncpoint.orchestrator.ray_internals import train_context
    except ImportError:  # another Ray: the lines show, nothing else changes
        pass
    else:
        drop(train_context.logger.name, r"^Reporting training result \d+: ")
    # Ray Train logs every failing rank's traceback ("Error in training function:"), at each rank: a bug
    # in the task fails every rank the same way, and a rank whose collective lost its peer only says that
    # another rank died first. The failure is printed once where every rank's is known: the failing rank's
    # traceback, one line for each other rank (the failure policy in the controller:
    # failure_policy.print_failure; in place, rank 0's decision: syncpoint.workers.supervision.supervisor).
    from syncpoint.orchestrator.ray_internals import TRAINING_ERROR_LOGGER

    drop(TRAINING_ERROR_LOGGER, r"^Error in training function:\n")
    if trains_here:
        quiet_training_process(spec)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if spec.scaling.use_gpu else "cpu")  # the server's import


def quiet_training_process(spec: JobSpec) -> None:
    """In a process that trains (a Ray worker, or the training process its supervisor starts, which
    imports no Ray: ``syncpoint.workers.supervision.supervisor``), before DeepSpeed builds its engine."""
    # DeepSpeed picks its accelerator at import; told which (the spec knows), it does not warn
    # "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if spec.scaling.use_gpu else "cpu")
    # DeepSpeed's ZeRO calls torch's all_gather_into_tensor and (ZeRO-3) reduce_scatter_tensor, both
    # deprecated in torch 2.13: not ours to change.
    for deprecated in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        warnings.filterwarnings(
            "ignore", message=rf"`torch\.distributed\.{deprecated}` is deprecated", category=FutureWarning
        )
    # DeepSpeed prints (print, not its logger) "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built
    # successfully" whenever a process loads its CPU shared-memory op: that one line is dropped.
    try:
        import importlib

        # the module itself: `deepspeed.comm.torch` as an attribute is torch (deepspeed.comm imports it)
        ds_torch: Any = importlib.import_module("deepspeed.comm.torch")  # its attributes vary by version
        original = ds_torch.build_shm_op
    except Exception:  # noqa: BLE001 - no DeepSpeed, or another one: its line shows, nothing else changes
        return
    if getattr(original, "_syncpoint_quiet", False):
        return

    def build_shm_op() -> Any:
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                return original()
        finally:
            rest = [
                ln
                for ln in out.getvalue().splitlines(keepends=True)
                if not re.fullmatch(r"DeepSpeed \S+ built successfully\s*", ln)
            ]
            if rest:
                sys.stdout.write("".join(rest))

    build_shm_op._syncpoint_quiet = True  # type: ignore[attr-defined]  # a marker: patched once per process
    ds_torch.build_shm_op = build_shm_op
