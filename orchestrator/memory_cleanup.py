"""Remove a run's memory copies on every node its workers ran on, when the job ends.

Why the driver: a supervisor's reaper keeps its node's copy when it hands a failure to Ray Train,
because a new worker group on that node may restore from it. If Ray Train then gives up, the job
ends with no syncpoint process left on that node to remove the copy, and it would hold the node's
shared memory until the run's next commit there or a reboot. The driver outlives every attempt and
knows the nodes from the journal (each attempt's ``nodes``), so it runs one small task on each of
them (no CPU reserved, pinned to the node, bounded wait) before it releases the run's lease: a
successor submission that takes the lease afterwards cannot have written a copy yet.
"""

from __future__ import annotations

from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.memory_copy import remove_for
from syncpoint.workers.storage import RunStorage

WAIT_S = 30.0  # a node that does not answer by then is gone or busy: its tmpfs goes with it


def _remove_remote(run_url: str) -> bool:
    remove_for(run_url)
    return True


def nodes_of(run_url: str, submission: str) -> set[str]:
    """The Ray nodes that ran a rank of this submission (the journal's attempts)."""
    journal = EventLog(RunStorage(run_url)).journal()
    return {node for a in journal.attempts if a.submission == submission for node in a.nodes if node}


def remove_on_nodes(run_url: str, submission: str) -> list[str]:
    """Remove the run's copy on each live node (other than this one) that ran a rank of the
    submission; returns the nodes asked. Best effort: a node that is gone took its copy with it."""
    import ray

    from syncpoint.orchestrator.node_tasks import live_nodes, run_on_nodes

    own = ray.get_runtime_context().get_node_id()
    targets = sorted((nodes_of(run_url, submission) & live_nodes()) - {own})
    if not targets:
        return []
    refs = run_on_nodes(_remove_remote, targets, run_url)
    ray.wait(refs, num_returns=len(refs), timeout=WAIT_S)
    return targets
