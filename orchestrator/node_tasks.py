"""Run a small function on given Ray nodes: zero CPU reserved, pinned to each node, never retried.

Why a helper: the driver does node-local housekeeping on nodes that hold no syncpoint process it
can ask (a memory copy kept for a restart that never came, a warm server for a replacement that
may come); each is a plain function run once on each node, the caller choosing whether to wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def live_nodes(min_cpus: float = 0.0) -> set[str]:
    """The cluster's live nodes with at least ``min_cpus`` CPUs (a worker's share: nodes that can host a rank)."""
    import ray

    return {
        n["NodeID"] for n in ray.nodes() if n.get("Alive") and float(n.get("Resources", {}).get("CPU", 0)) >= min_cpus
    }


def run_on_nodes(func: Callable[..., Any], nodes: Iterable[str], *args: Any) -> list[Any]:
    """Start ``func(*args)`` on each node; returns the object refs (``ray.wait`` them, or drop them)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task: Any = ray.remote(num_cpus=0, max_retries=0)(func)
    return [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
        for node in sorted(nodes)
    ]
