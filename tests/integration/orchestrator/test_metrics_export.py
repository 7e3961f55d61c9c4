"""The driver's metrics publisher (``syncpoint.orchestrator.metrics_export``) over a real run's event log,
without Ray: a run crashed twice and resumed to its end publishes ``samples`` of the log as read back
(goodput equal to ``goodput(journal)``, two restarts), sets nothing when no event is new, and an
unreachable storage is said once on stderr without raising. Scraped from Ray's endpoint during a run
on Ray: tests/ray/test_metrics_on_ray.py (``make test-all``)."""

from __future__ import annotations

import pytest

from syncpoint.orchestrator.metrics_export import Publisher, publishing
from syncpoint.policies.decisions.goodput import goodput
from syncpoint.policies.decisions.metric_samples import samples
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import interrupted_twice


@pytest.fixture(scope="module")
def twice_crashed(tmp_path_factory):
    """A linear run crashed at micro-steps 7 and 15, then run to its end."""
    return interrupted_twice(tmp_path_factory.mktemp("metrics"))


def test_the_publisher_sets_the_samples_of_the_log_as_read_back(twice_crashed):
    storage = RunStorage(twice_crashed.run_url)
    publisher = Publisher(storage, job_name="linear", submission="s1", micro_batch_size=1)
    published = publisher.tick()
    journal = EventLog(storage).journal()
    assert published == samples(journal, job_name="linear", submission="s1", micro_batch_size=1)
    values = {(s.series, *(v for k, v in s.labels if k in ("cause", "kind"))): s.value for s in published}
    g = goodput(journal)
    assert g is not None and g.finished and len(g.restarts) == 2
    assert values[("syncpoint_goodput_ratio",)] == pytest.approx(g.ratio)
    # ranks launched without a driver: no failure record says in place, so Ray Train's kind of restart
    assert (values[("syncpoint_restarts", "new_worker_group")], values[("syncpoint_restarts", "in_place")]) == (2, 0)
    assert values[("syncpoint_finished",)] == 1.0 and values[("syncpoint_committed_micro_step",)] == 20
    assert set(publisher.gauges) >= {s.series for s in published}  # one Gauge per series
    assert publisher.tick() == []  # nothing new in the log: nothing set again


def test_a_publish_that_fails_is_said_once_and_the_block_goes_on(capsys):
    unreachable = RunStorage("http://127.0.0.1:9/run")
    with publishing(unreachable, job_name="j", submission="s", micro_batch_size=1, poll_s=0.05) as publisher:
        publisher.safe_tick()
        publisher.safe_tick()
    err = capsys.readouterr().err
    assert err.count("the run's metrics were not published") == 1, err
    assert "the run goes on" in err and publisher.failed
