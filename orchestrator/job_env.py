"""What a job's Ray processes start with: the driver's environment for the job (Ray Train's settings,
where the trackers write, the import path), the job's and the workers' runtime environments, and
Ray Train's settings syncpoint chooses; and where the driver itself was submitted (a Ray Job's
entrypoint knows it from its environment).

Why apart from the Ray wiring (``syncpoint.orchestrator.ray_runner``): each is a pure function of the
spec and the driver's environment, read by the Ray path, ``syncpoint submit`` and the tests alike.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import TypedDict

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.redact import redact_url

# Where the trackers of train.report_to write, passed from the driver to every worker (a remote
# cluster's workers do not inherit the driver's environment); API keys and tokens are not among them.
TRACKER_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_ALLOW_FILE_STORE",
    "WANDB_MODE",
    "WANDB_PROJECT",
    "WANDB_ENTITY",
    "WANDB_DIR",
    "WANDB_BASE_URL",
)


class RuntimeEnv(TypedDict, total=False):
    """The parts of a Ray runtime env syncpoint sets (Ray's ``runtime_env`` argument takes this dict)."""

    env_vars: dict[str, str]
    worker_process_setup_hook: str


def ray_storage_path(spec: JobSpec) -> str:
    """Where Ray Train keeps its own bookkeeping (not our states)."""
    if spec.storage.startswith("file://"):
        return os.path.join(spec.storage[len("file://") :], spec.name, ".ray")
    return os.path.join(os.path.expanduser("~"), "ray_results", "syncpoint")


def worker_runtime_env(spec: JobSpec) -> RuntimeEnv:
    """What every Ray Train worker process starts with: the job's own variables (``scaling.env``: a
    remote node's workers do not inherit the driver's environment, and a rank forked from a warm
    server takes its worker's) and its ``PYTHONHASHSEED`` (from ``train.seed``), so an order that
    follows a set or dict of strings is the same on every restart.

    Why here and not in ``ray.init``: Ray Train v2 creates its worker actors with this runtime env
    on every restart, merged over the job's (``ray job submit``'s own, when a user submits ``syncpoint
    run`` themselves, which a driver's ``ray.init(runtime_env=...)`` may not contradict); Ray starts
    each worker process with it, and the hash secret is fixed when an interpreter starts."""
    from syncpoint.policies.decisions.seeds import hash_seed

    return {"env_vars": {**spec.scaling.env, "PYTHONHASHSEED": str(hash_seed(spec.train.seed))}}


# How often Ray Train's controller polls its workers when they are supervisors (Ray's default: 2 s).
# Why lower: a worker that died (a lost node) is noticed at the next poll, so the default added 1 s
# on average to every such restart (measured: detection 1.0-1.3 s). A supervisor answers a poll at
# once (its rank trains in another process), so polls that are 4x as frequent cost the controller
# one small call per worker per half second; set the variable to choose otherwise. Ray Train reads
# it in the controller, which gets it from the driver's environment (and reports keep their cadence:
# ``syncpoint.workers.observation.metric_sinks.REPORT_EVERY_S``).
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


SUPERVISOR_HEALTH_CHECK_S = 0.5


@contextlib.contextmanager
def ray_train_defaults(spec: JobSpec, embedded: bool = False) -> Iterator[None]:
    """Ray Train settings syncpoint chooses, in the driver's environment for the job's length (Ray
    Train propagates its ``RAY_TRAIN_*`` variables to the controller and the workers when the job
    starts); a value already set wins, and what was there before is back afterwards, so a later job
    in the same process (a drill, a bench's baseline) starts from the caller's environment.
    ``embedded``: the job's Ray is started by this driver (``embedded_ray.EMBEDDED_TRAIN_ENV``)."""
    from syncpoint.orchestrator.embedded_ray import EMBEDDED_TRAIN_ENV

    # Ray Train's print patch re-logs every worker print through its logger: lines appear twice.
    chosen = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if spec.failure.in_place:
        chosen[HEALTH_CHECK_ENV] = str(SUPERVISOR_HEALTH_CHECK_S)
    if embedded:
        chosen.update(EMBEDDED_TRAIN_ENV)
    added = [k for k in chosen if k not in os.environ]
    os.environ.update({k: chosen[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def driver_env_vars() -> dict[str, str]:
    """The variables of the driver's environment the job's processes get: Ray Train's settings (poll
    intervals, ...) reach the controller and workers, the trackers of ``train.report_to`` their
    locations (not their credentials: those belong on the cluster), and the driver's working
    directory leads the import path, so a task next to the job file imports (remote nodes get code
    through ``ray job submit --working-dir``)."""
    env_vars = {k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")}
    env_vars.update({k: os.environ[k] for k in TRACKER_ENV if k in os.environ})
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
    return env_vars


def job_runtime_env(env_vars: dict[str, str]) -> RuntimeEnv:
    """The job's runtime env: ``env_vars``, and the setup hook that tells every worker process its own
    cluster (``syncpoint.orchestrator.worker_setup``), unless the job already has a hook (``ray job submit
    --runtime-env``), which Ray would refuse to replace."""
    from syncpoint.orchestrator.ray_internals import ray_constants

    if ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR in os.environ:
        return {"env_vars": env_vars}
    from syncpoint.orchestrator.worker_setup import HOOK

    return {"env_vars": env_vars, "worker_process_setup_hook": HOOK}


# Where Ray's job supervisor keeps a Ray Job's config (its submission id among the metadata) in the
# environment of the job's entrypoint: ``syncpoint submit``'s, or a user's own ``ray job submit``.
RAY_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def submitted_to(address: str | None, environ: Mapping[str, str], *, connected: bool = False) -> str:
    """Where a submission runs, as its ``submitted`` event says it (``syncpoint events``: "submitted
    NAME to WHERE"): a Ray Job's entrypoint by its submission id and its cluster's address (the job
    supervisor sets ``RAY_ADDRESS``), a cluster by its address (redacted), a caller's own connection
    (a drill, a notebook) as such, else ``embedded`` (the local Ray ``syncpoint run`` starts)."""
    target = address or environ.get("RAY_ADDRESS")
    job = ray_job_submission(environ)
    if job is not None:
        return f"Ray job {job} on {redact_url(target)}" if target else f"Ray job {job}"
    if target:
        return redact_url(target)
    return "the caller's Ray" if connected else "embedded"


def ray_job_submission(environ: Mapping[str, str]) -> str | None:
    """The Ray Job submission id this process is the entrypoint of, else None."""
    import json

    try:
        metadata = json.loads(environ.get(RAY_JOB_CONFIG_ENV, "")).get("metadata") or {}
    except (ValueError, AttributeError):  # not a Ray Job (or a config this Ray version does not write)
        return None
    job = metadata.get("job_submission_id") if isinstance(metadata, dict) else None
    return str(job) if job else None
