"""``syncpoint.run``: a job run from Python, as ``syncpoint run`` runs it.

Why the same code path: the CLI's checks before Ray starts (storage made absolute, every import
path resolved in a child Python, the run directory written once) and its driver
(``syncpoint.orchestrator.ray_runner.run_job``: an embedded local Ray unless ``address`` or
``RAY_ADDRESS`` names a cluster) are what ``run`` calls; only the ending differs: instead of a last
line and an exit code, a ``RunResult`` or an exception.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from syncpoint.policies.contracts.errors import UsageError
from syncpoint.policies.contracts.spec import JobSpec


@dataclass(frozen=True)
class RunResult:
    """A finished run, as its last line states it.

    ``state``: the committed state the run finished with (None: it committed none); ``run_dir``:
    where its states, events and final model are (``<storage>/<name>``, an absolute URL); ``line``:
    the last line ``syncpoint run`` prints."""

    name: str
    state: str | None
    optimizer_steps: int
    micro_steps: int
    restarts: int
    lost_micro_steps: int
    wall_seconds: float
    run_dir: str
    line: str


class RunFailed(RuntimeError):
    """The run failed (an application error, retries exhausted, a refused resume, ...).

    ``reason`` is what the CLI's last line says after ``failed:``; ``details`` what it prints above
    that line (a candidates table, the failing rank's error), possibly empty; ``line`` the last line
    itself. The committed states stay: running the same job again resumes from them."""

    def __init__(self, reason: str, details: str, line: str, run_dir: str) -> None:
        super().__init__(reason)
        self.reason, self.details, self.line, self.run_dir = reason, details, line, run_dir


def run(
    spec: JobSpec | str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    address: str | None = None,
    progress_bar: bool = False,
    dashboard: bool = False,
    metrics_port: int | None = None,
) -> RunResult:
    """Run a job to completion and return its result, as ``syncpoint run JOB [--set ...]`` does.

    Args:
        spec: a job file (YAML) or a ``JobSpec``; a relative ``storage`` is taken relative to the
            working directory, and task paths are imported from it (first) and the installed packages.
        overrides: ``--set``-style ``key.path=value`` strings, applied to a job file.
        address: a running Ray cluster; default ``RAY_ADDRESS``, else an embedded local Ray (as the
            CLI), stopped before returning. A caller already connected (``ray.init``) is used as is.
        progress_bar: a live bar on stdout instead of the workers' progress lines.
        dashboard: an embedded Ray also starts Ray's dashboard (``syncpoint run --dashboard``).
        metrics_port: an embedded Ray serves its Prometheus endpoint, the run's ``syncpoint_*`` series
            among them, on this port (``syncpoint run --metrics-port``; docs/metrics.md).

    Returns:
        The finished run's ``RunResult``.

    Raises:
        SpecError: bad input (the spec, an override, an import path, unusable storage), before Ray
            starts: one paragraph per problem, as the CLI prints them (exit 2 there).
        RunFailed: the run failed (exit 1 there), with the CLI's reason.
    """
    from syncpoint.orchestrator.cli_jobs import prepare_run
    from syncpoint.orchestrator.quiet import quiet_cli
    from syncpoint.orchestrator.ray_runner import run_job
    from syncpoint.orchestrator.spec_file import load_spec

    quiet_cli()
    if isinstance(spec, JobSpec):
        if overrides:
            raise UsageError(
                "overrides",
                [
                    "overrides apply to a job file; change a JobSpec with "
                    "spec.model_copy(update=...) or pass the file's path"
                ],
            )
        source = f"JobSpec {spec.name!r}"
    else:
        source = os.fspath(spec)
        spec = load_spec(source, list(overrides))
    if metrics_port is not None:
        from syncpoint.orchestrator.cli_inputs import metrics_port_arg

        metrics_port = metrics_port_arg(str(metrics_port))  # a UsageError (a SpecError) names the argument
    spec = prepare_run(spec, source)
    outcome = run_job(spec, address, progress_bar=progress_bar, dashboard=dashboard, metrics_port=metrics_port)
    if outcome.failed:
        raise RunFailed(outcome.reason, outcome.details, outcome.line, spec.run_url)
    s = outcome.summary
    return RunResult(
        name=spec.name,
        state=s.state if s else None,
        optimizer_steps=s.optimizer_step if s else 0,
        micro_steps=s.micro_step if s else 0,
        restarts=s.restarts if s else 0,
        lost_micro_steps=s.lost_micro_steps if s else 0,
        wall_seconds=s.wall_seconds if s else 0.0,
        run_dir=spec.run_url,
        line=outcome.line,
    )
