"""A job's last line: the summary of a finished run (with its plot), or why a failed one stopped.

Why apart from the Ray wiring: the line is read by a person (and by scripts, in ``--json``), whatever
launched the job; it is built from the journal and the failure alone, paths shown as a newcomer types them.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from syncpoint.orchestrator.failure_report import own_exception
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.redact import redact_url

if TYPE_CHECKING:
    from syncpoint.orchestrator.timeline import RunSummary
    from syncpoint.policies.contracts.journal import Journal
    from syncpoint.workers.storage import RunStorage


def finish_line(spec: JobSpec) -> str:
    """The run's one-line summary (final state, steps, wall time, restarts, lost work, where the model
    and plot are), after drawing the plot into ``<run>/plot.png``."""
    return finish(spec)[0]


def finish(spec: JobSpec) -> tuple[str, RunSummary | None]:
    """``finish_line``'s line and the summary it states (None: no finish event in the journal)."""
    from syncpoint.orchestrator.timeline import format_summary, summarize
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    storage = RunStorage(spec.run_url)
    journal = EventLog(storage).journal()
    summary = summarize(journal)
    if summary is None:  # fit() returned without a finish event: say where to look rather than guess
        return f"syncpoint: job {spec.name!r} finished; states under {shown(storage)}", None
    plot = None
    try:
        plot = _draw_plot(storage, journal, spec.name)
    except Exception as e:  # noqa: BLE001 - the plot is a courtesy: the run finished, and the line says how to draw it
        print(
            f"syncpoint: the plot was not drawn ({type(e).__name__}: {e}); "
            f"`syncpoint events {shown(storage)} --plot FILE.png` draws it",
            file=sys.stderr,
        )
    model = shown(storage, "final", "model.safetensors") if storage.exists("final", "model.safetensors") else None
    return format_summary(spec.name, summary, model, plot), summary


def _draw_plot(storage: RunStorage, journal: Journal, title: str) -> str:
    from syncpoint.orchestrator.plot import render_plot

    storage.write_bytes(render_plot(journal, title=title), "plot.png")  # never through a planted link
    return shown(storage, "plot.png")


def shown(storage: RunStorage, *parts: str) -> str:
    """A path as a newcomer types it: relative to the working directory when under it."""
    path = storage.local_path(*parts)
    if path is None:
        return redact_url(storage.url_of(*parts))
    try:
        rel = os.path.relpath(path)
    except OSError:  # the working directory is gone (seen under `ray job submit`: its package was cleaned up)
        return path
    return rel if not rel.startswith("..") else path


def not_retried(spec: JobSpec, submission: str) -> str:
    """``; it failed twice the same way ...`` when the failure policy stopped retrying a repeated bug
    (its decision, journaled by the controller before ``fit()`` returned), else nothing."""
    from syncpoint.policies.decisions.failures import APPLICATION, not_retried_line
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    try:
        last = EventLog(RunStorage(spec.run_url)).journal().last_failure(submission, APPLICATION)
    except Exception:  # noqa: BLE001 - the log is unreadable: the reason alone still says why
        return ""
    return f"; {not_retried_line(last.micro_step)}" if last and last.repeated and last.micro_step is not None else ""


def placement_report(spec: JobSpec, error: BaseException) -> tuple[str, str] | None:
    """The run gave up waiting for room (``failure.placement_timeout_s``): say that, with the fix,
    instead of Ray's per-try timeout text (which only suggests raising that timeout)."""
    from syncpoint.orchestrator.ray_internals import WorkerGroupStartupTimeoutError
    from syncpoint.policies.decisions.failures import placement_gave_up

    if not isinstance(own_exception(error), WorkerGroupStartupTimeoutError):
        return None
    s = spec.scaling
    return placement_gave_up(
        s.max_workers if not s.elastic else s.min_workers,
        s.cpus_per_worker,
        s.use_gpu,
        spec.failure.placement_timeout_s,
    ), str(own_exception(error))
