"""Ray Train wiring: a ``TorchTrainer`` whose workers run ``workers.loop.run_worker``.

Storage is the source of truth for resuming: every new worker group (a Ray Train restart, a
re-submitted job, a new KubeRay cluster) negotiates its state from ``<storage>/<name>/states``
through the resume policy. Committed states are deliberately *not* registered with Ray's
checkpoint manager: Ray's snapshot would then name directories that syncpoint's retention
deletes, and Ray fails start-up on a checkpoint someone else removed.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

from orchestrator.spec import JobSpec


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point inside each Ray Train worker (a torch process group is already set up)."""
    import ray
    import ray.train

    from workers.loop import WorkerContext, run_worker

    ctx = ray.train.get_context()
    os.environ["LOCAL_RANK"] = str(ctx.get_local_rank())
    spec = JobSpec.model_validate(config["spec"])

    def notice() -> dict[str, Any] | None:
        info = ray.train.get_preemption_info()  # a collective: every rank calls it at every boundary
        if info is None:
            return None
        return {"source": "ray-drain", "deadline_ms": info.deadline_ms, "nodes": info.preempted_node_ids,
                "ranks": info.preempted_ranks}

    run_worker(spec, WorkerContext(preemption_notice=notice, node_id=ray.get_runtime_context().get_node_id(),
                                   submission_id=config["submission_id"]))


def _ray_storage_path(spec: JobSpec) -> str:
    """Where Ray Train keeps its own bookkeeping (not our states)."""
    if spec.storage.startswith("file://"):
        return os.path.join(spec.storage[len("file://"):], spec.name, ".ray")
    return os.path.join(os.path.expanduser("~"), "ray_results", "syncpoint")


def connect(spec: JobSpec, address: str | None) -> bool:
    """Connect to a cluster, or start an embedded local Ray; returns True if embedded."""
    import ray

    # Ray Train's print patch re-logs every worker print through its logger: lines appear twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Ray Train settings given to the driver (poll intervals, ...) reach the controller and workers too.
    env_vars = {k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")}
    # The driver's working directory on the import path, so a task next to the job file imports
    # (remote nodes get code through `ray job submit --working-dir`).
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
    if ray.is_initialized():  # a caller (drill, tests) already connected
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": env_vars})
        return False
    needed = spec.scaling.max_workers * spec.scaling.cpus_per_worker
    # The dashboard stays on: Ray Train's placement-group cleaner polls the State API it serves.
    ray.init(num_cpus=max(int(needed + 0.999), 1), log_to_driver=True, runtime_env={"env_vars": env_vars})
    return True


def run_on_ray(spec: JobSpec, address: str | None = None) -> int:
    """Run the job to completion on Ray; returns the process exit code (0 ok, 1 failed)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from workers.events import EventLog
    from workers.storage import RunStorage

    EventLog(RunStorage(spec.run_url), source="driver").emit("submitted", name=spec.name, address=address or "embedded")
    embedded = connect(spec, address)
    submission = uuid.uuid4().hex
    try:
        s = spec.scaling
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"spec": spec.model_dump(mode="json"), "submission_id": submission},
            scaling_config=ScalingConfig(num_workers=(s.min_workers, s.max_workers) if s.elastic else s.max_workers,
                                         use_gpu=s.use_gpu,
                                         resources_per_worker={"CPU": s.cpus_per_worker}),
            torch_config=TorchConfig(backend="nccl" if s.use_gpu else "gloo"),
            run_config=RunConfig(
                name=spec.name, storage_path=_ray_storage_path(spec),
                failure_config=FailureConfig(max_failures=spec.failure.max_failures,
                                             max_preemption_failures=spec.failure.max_preemptions)),
        )
        from orchestrator.failure_policy import installed

        try:
            with installed(spec.run_url):
                trainer.fit()
        except Exception as e:  # noqa: BLE001 - turn Ray's error into one paragraph
            print(f"syncpoint: job {spec.name!r} failed: {failure_summary(e)}", file=sys.stderr)
            return 1
        print(f"syncpoint: job {spec.name!r} finished; states and final model under {spec.run_url}")
        return 0
    finally:
        from workers.lease import release_lease

        release_lease(RunStorage(spec.run_url), submission)  # the submission is over, whatever its outcome
        if embedded:
            ray.shutdown()


def failure_summary(e: BaseException) -> str:
    """The user's own error message (last line of the worker traceback), not Ray's wrapper."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    interesting = [ln for ln in lines if ("Error" in ln or "Refused" in ln or "Exception" in ln) and not ln.startswith("File ")]
    core = interesting[-1] if interesting else (lines[-1] if lines else type(e).__name__)
    if "ResumeRefused" in text:
        start = text.find("ResumeRefused")
        core = text[start:].split("\n\n")[0]
    return core
