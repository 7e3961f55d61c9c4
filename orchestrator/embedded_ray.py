"""What an embedded local Ray (``syncpoint run`` without an address) leaves out: the processes that
serve a long-lived cluster and not a run whose cluster ends with its driver.

Why: on an embedded run every Ray process starts on the job's own cores, and a cold start spawned
about twenty of them before the first step (profiled on two cores: the dashboard and its nine module
processes, two worker processes Ray starts ahead for jobs without a runtime environment, which a
syncpoint job never is, Ray Data's autoscaling coordinator and Ray Train's placement-group cleaner,
both of which the controller waits for before its workers start). None of them does anything for a
cluster that is torn down with the job:

* the **dashboard** serves the State API and the web UI of a cluster that lives on; ``syncpoint run
  --dashboard`` keeps it;
* the **prestarted workers** have no runtime environment, so no actor of a syncpoint job (every one
  has the job's) can use them;
* the **autoscaling coordinator** forwards resource requests to a cluster autoscaler, and a local
  instance has none;
* the **placement-group cleaner** removes a placement group whose controller died while the cluster
  lives on; it polls the dashboard's State API;
* the **dataset manager** (an actor per worker group) hands out shards of Ray Datasets, and syncpoint
  gives the trainer none: each rank reads its own data (``syncpoint.workers.data``). Left out on a
  cluster too: there it is a process and a round trip to every worker in each worker group's start, a
  restart's included, for nothing;
* the **preemption watcher** (an actor per worker group, started beside the ranks' first steps) polls
  the GCS for drain notices of the workers' nodes; an embedded Ray's one node is this machine, which
  no autoscaler or kubelet drains: its preemption reaches the driver as a signal
  (``driver_signals``). Left out through Ray Train's own switch (``EMBEDDED_TRAIN_ENV``; a value the
  user set wins).

On a cluster (an address, ``RAY_ADDRESS``, ``ray job submit``, KubeRay) nothing else here applies: Ray
Train runs with every other helper it starts by default.
"""

from __future__ import annotations

from typing import Any, TypedDict

from syncpoint.orchestrator.ray_internals import DatasetsCallback, FixedScalingPolicy, PlacementGroupCleanerCallback

# Ray's raylet starts one worker process per CPU for the first driver, with no runtime environment.
NO_PRESTART = {"prestart_worker_first_driver": False}
# Ray Train's settings for an embedded run (``job_env.ray_train_defaults``): its preemption watcher off.
EMBEDDED_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


class InitOptions(TypedDict, total=False):
    """The ``ray.init`` keyword arguments ``init_options`` sets."""

    include_dashboard: bool
    _system_config: dict[str, bool]
    _metrics_export_port: int


def init_options(dashboard: bool, metrics_port: int | None = None) -> InitOptions:
    """``ray.init``'s options for an embedded instance (beyond its address, CPUs and runtime env):
    ``metrics_port``, Ray's Prometheus endpoint (``syncpoint run --metrics-port``), served by the node's
    metrics agent, which the raylet starts with or without the dashboard."""
    options: InitOptions = {"include_dashboard": dashboard, "_system_config": dict(NO_PRESTART)}
    if metrics_port is not None:
        options["_metrics_export_port"] = metrics_port
    return options


def lean_trainer(trainer_cls: type, embedded: bool, keep_cleaner: bool = True) -> type:
    """``trainer_cls`` (Ray Train's ``DataParallelTrainer`` or ``TorchTrainer``) whose controller starts
    without a dataset manager when the trainer has no datasets (on any cluster) and, ``embedded``,
    without the autoscaling coordinator and, unless ``keep_cleaner`` (the dashboard it polls runs),
    without the placement-group cleaner.

    Why a subclass at ``_initialize_and_run_controller``: it is the one place where the trainer hands
    the controller its scaling policy and callbacks, and Ray is pinned (``pyproject.toml``), so a
    rename there fails this project's Ray tests rather than a user's run."""

    class LeanTrainer(trainer_cls):
        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            left_out: tuple[type, ...] = () if keep_cleaner or not embedded else (PlacementGroupCleanerCallback,)
            if not self.datasets:
                left_out += (DatasetsCallback,)
            kwargs["callbacks"] = [c for c in kwargs["callbacks"] if not isinstance(c, left_out)]
            if embedded:
                kwargs["scaling_policy"] = without_autoscaler(kwargs["scaling_policy"])
            return super()._initialize_and_run_controller(**kwargs)

    prefix = "Embedded" if embedded else "Lean"
    LeanTrainer.__name__ = LeanTrainer.__qualname__ = f"{prefix}{trainer_cls.__name__}"
    return LeanTrainer


def without_autoscaler(policy: Any) -> Any:
    """A fixed-size policy that never asks an autoscaler for resources; any other policy (an elastic
    one reads what the coordinator granted) as it is."""
    if type(policy) is not FixedScalingPolicy:
        return policy
    return LocalFixedScalingPolicy(scaling_config=policy.scaling_config)


class LocalFixedScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size policy without its autoscaling coordinator (a detached Ray Data actor the
    controller would start, and wait for, only to forward requests that no autoscaler reads). The
    controller unpickles it by this module's name."""

    def after_controller_start(self, train_run_context: Any) -> None:
        """No coordinator to register with."""

    def _maybe_send_resource_request(self) -> None:
        """Nothing to ask for: a local instance has what it was started with."""

    def _send_resource_request(self) -> None:
        """As ``_maybe_send_resource_request``."""

    def _cancel_resource_request(self) -> None:
        """Nothing was asked for."""
