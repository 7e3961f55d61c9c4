"""The messages the CLI's process quiets (the mechanism: ``syncpoint.workers.log_filters``); the
driver (``syncpoint.orchestrator.ray_runner``) and every Ray worker process of a job
(``syncpoint.orchestrator.worker_setup``) use ``drop`` from here too."""

from __future__ import annotations

import re

from syncpoint.workers.log_filters import drop

# DeepSpeed logs (its "DeepSpeed" logger, warning) whenever it is imported without DS_ACCELERATOR on a
# machine without a GPU. The CLI's own process (digest, the drill's comparison) imports it to read
# states, which needs no accelerator; the workers are told which one (ray_runner.quiet_worker).
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
