"""Run in every Ray worker process of a syncpoint job as it starts (Ray's ``worker_process_setup_hook``).

Why the cluster address: Ray's State API client (``ray.util.state``) finds its cluster from ``RAY_ADDRESS``, else by
looking for Ray processes on the machine; where more than one Ray instance runs on the host (a test's
cluster, a colleague's, the embedded one ``syncpoint run`` starts beside a ``ray start`` head) it
raises "Found multiple active Ray instances". Ray Train's placement-group cleaner, a detached actor
of the job, polls that API in a thread, which then dies with a 25-line traceback and stops guarding
the placement group. Each worker process knows which cluster it belongs to: this says so in its
environment, so the cleaner (and any State API call of the task's) asks that one.
"""

from __future__ import annotations

import os

HOOK = "syncpoint.orchestrator.worker_setup.set_up"
# Ray Train's controller warns, with a traceback, that shutting down a worker group whose worker
# crashed could not be graceful, and says itself that this is expected: the failure policy's line
# already says which failure it was.
SHUTDOWN_LINE = r"^Graceful shutdown of backend failed\. This is expected if one of the workers has crashed\.$"
# Its autoscaling client warns, with a traceback, when a resource request times out on a busy machine,
# and says itself that this is safe to ignore when transient; a cluster that lacks room for the
# workers fails with failure.placement_timeout_s's own message instead.
RESOURCE_REQUEST_LINE = r"^Failed to send resource request for \S+\. If this only happens transiently"


def set_up() -> None:
    """The hook: this process's cluster address, and the controller's expected-shutdown and transient
    resource-request warnings quieted.
    Never raises: a failing hook makes Ray stop the worker."""
    try:
        from syncpoint.orchestrator.quiet import drop
        from syncpoint.orchestrator.ray_internals import BACKEND_SETUP_LOGGER, RESOURCE_REQUEST_LOGGER

        drop(BACKEND_SETUP_LOGGER, SHUTDOWN_LINE)
        drop(RESOURCE_REQUEST_LOGGER, RESOURCE_REQUEST_LINE)
    except Exception:  # noqa: BLE001 - the warning shows, nothing else changes
        pass
    own_cluster_address()


def own_cluster_address() -> None:
    """``RAY_ADDRESS`` := this worker's own cluster (its GCS address), unless something set it already."""
    if os.environ.get("RAY_ADDRESS"):
        return
    try:
        import ray

        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - not connected (another Ray): the State API looks it up
        return
    if address:
        os.environ["RAY_ADDRESS"] = str(address)
