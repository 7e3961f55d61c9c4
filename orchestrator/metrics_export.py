"""The driver's publisher of the run's ``syncpoint_*`` series through ``ray.util.metrics``.

Why in the driver, through Ray: Ray's metrics go wherever a platform team already scrapes them (an
embedded run's ``--metrics-port``, a ``ray start`` node's ``--metrics-export-port``, KubeRay's pods
behind a PodMonitor), and the driver outlives every worker group. Its values are
``syncpoint.policies.decisions.metric_samples.samples`` over the run's event log, the same accounting
as the run's last line, so the two agree. A daemon thread reads only the event files it has not read
(``progress_bar.EventFollower``) every ``POLL_S`` and sets the gauges when something new came; it
ends with the run.

Publishing never fails a run: the first error is printed once (on stderr) and the run goes on.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from syncpoint.orchestrator.progress_bar import EventFollower, polled
from syncpoint.policies.contracts.journal import Event, Journal, UnknownEvent
from syncpoint.policies.decisions.metric_samples import BASE_LABELS, SERIES, Sample, samples
from syncpoint.workers.storage import RunStorage

if TYPE_CHECKING:
    from ray.util.metrics import Gauge

POLL_S = 2.0  # Ray exports every 10 s by default (metrics_report_interval_ms); a scrape sees at most that late


class Publisher:
    """The run's gauges, one ``ray.util.metrics.Gauge`` per series (made at the first publish, when
    Ray is connected), set from the whole event log read so far."""

    def __init__(self, storage: RunStorage, *, job_name: str, submission: str, micro_batch_size: int) -> None:
        self.follower = EventFollower(storage)
        self.events: list[Event | UnknownEvent] = []
        self.labels = {"job_name": job_name, "submission": submission}
        self.micro_batch_size = micro_batch_size
        self.gauges: dict[str, Gauge] = {}
        self.failed = False  # the first error was said

    def tick(self) -> list[Sample]:
        """Read the new event files; when there were any, publish every series. Returns what it set."""
        new = self.follower.new_events()
        if not new:
            return []
        self.events += new
        out = samples(
            Journal(self.events),
            job_name=self.labels["job_name"],
            submission=self.labels["submission"],
            micro_batch_size=self.micro_batch_size,
        )
        for s in out:
            self._gauge(s.series).set(s.value, tags=dict(s.labels))
        return out

    def _gauge(self, name: str) -> Gauge:
        if not self.gauges:
            from ray.util.metrics import Gauge

            self.gauges = {
                s.name: Gauge(s.name, description=s.help, tag_keys=BASE_LABELS + ((s.label,) if s.label else ()))
                for s in SERIES
            }
        return self.gauges[name]

    def safe_tick(self) -> None:
        """``tick``, its first error said once on stderr; never raises."""
        try:
            self.tick()
        except Exception as e:  # noqa: BLE001 - metrics are a view: a failed publish never fails the run
            if not self.failed:
                self.failed = True
                print(
                    f"syncpoint: the run's metrics were not published ({type(e).__name__}: {e}); the run goes on",
                    file=sys.stderr,
                    flush=True,
                )


@contextlib.contextmanager
def publishing(
    storage: RunStorage, *, job_name: str, submission: str, micro_batch_size: int, poll_s: float = POLL_S
) -> Iterator[Publisher]:
    """Publish the run's series every ``poll_s`` while the block runs (``trainer.fit()``), once more at its end."""
    publisher = Publisher(storage, job_name=job_name, submission=submission, micro_batch_size=micro_batch_size)
    with polled(publisher.safe_tick, poll_s, "syncpoint-metrics"):
        yield publisher
