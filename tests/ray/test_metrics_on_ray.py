"""The run's ``syncpoint_*`` series on Ray's Prometheus endpoint, scraped over HTTP: ``syncpoint run
--metrics-port`` on an embedded Ray, two workers, a rank's training process killed twice (two in-place
recoveries). While it trains the endpoint serves the series (Ray's exporter names them ``ray_syncpoint_*``),
labelled with the job's name and the driver's submission; once a scrape shows both restarts, its
values are checked against the run's journal as of the newest event they cover
(``syncpoint_journal_time_seconds``): goodput within a percentage point of ``goodput(journal)``,
restarts, lost micro-steps and the newest committed state exact.

``long`` (about 40 s of CPU: an embedded Ray and a 40-micro-step run): ``make test`` covers the
publisher over a real run's log without Ray (tests/integration/orchestrator/test_metrics_export.py),
the samples over hand-built journals (tests/unit/policies/decisions/test_metric_samples.py) and the
dashboard's queries against the series (tests/k8s/test_monitoring.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from syncpoint.policies.contracts.journal import Failure
from syncpoint.policies.decisions.goodput import goodput
from syncpoint.policies.decisions.metric_samples import SERIES_NAMES, samples
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import ROOT, lm_spec, write_job
from tests.ray_processes import free_ports

pytestmark = pytest.mark.long

_LINE = re.compile(r"^ray_(syncpoint_\w+)\{(.*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(port: int, job_name: str) -> dict[tuple[str, ...], tuple[float, dict[str, str]]]:
    """The endpoint's ``ray_syncpoint_*`` samples of this job: (series, cause or kind) -> (value, labels);
    empty while nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in body.splitlines():
        m = _LINE.match(line)
        if m:
            labels = dict(_LABEL.findall(m[2]))
            if labels.get("job_name") == job_name:
                key = (m[1], *(labels[k] for k in ("cause", "kind") if k in labels))
                out[key] = (float(m[3]), labels)
    return out


def test_two_interruptions_are_scraped_from_the_endpoint_as_the_journal_counts_them(tmp_path):
    (port,) = free_ports(1)
    spec = lm_spec(
        tmp_path / "runs",
        "task.path=tests.tasks:paced_lm",
        "task.config.pace_s=0.25",  # a pause costs no CPU: the run lasts while the test scrapes
        "task.config.num_samples=160",
        "train.epochs=1",
        "checkpoint.save_every={value: 4, unit: micro_steps}",
        "failure.max_failures=2",
        "train.log_every=1",  # every step's progress: step time and throughput are known when scraped
        "faults=[{rank: 1, at_micro_step: 6, mode: exit}, {rank: 0, at_micro_step: 14, mode: exit}]",
        workers=2,
    )
    job = write_job(spec, tmp_path / "job.yaml")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_metrics_report_interval_ms"] = "1000"  # Ray's export every second (10 s by default)
    out = tmp_path / "out.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncpoint", "run", str(job), "--metrics-port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )
    seen: dict = {}
    try:
        deadline = time.monotonic() + 600
        # until a scrape shows both restarts and every series (the third attempt's step time and
        # throughput need two of its steps logged)
        while proc.poll() is None and time.monotonic() < deadline:
            got = scrape(port, spec.name)
            if got.get(("syncpoint_restarts", "in_place"), (0.0,))[0] == 2:
                seen = got
                if {k[0] for k in got} == SERIES_NAMES:
                    break
            time.sleep(0.5)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert rc == 0, text[-4000:]
    assert f"http://127.0.0.1:{port}/metrics" in text, text[-4000:]
    assert seen, f"no scrape showed two restarts before the run ended\n{text[-3000:]}"

    journal = EventLog(RunStorage(spec.run_url)).journal()
    assert [f.in_place for f in journal.of_kind(Failure)] == [True, True]
    as_of = seen[("syncpoint_journal_time_seconds",)][0]
    then = journal.until(as_of)
    g = goodput(then)
    assert g is not None
    value = {k: v for k, (v, _) in seen.items()}
    print(
        f"scraped as of {as_of - journal.events[0].time:.2f} s into the run: goodput "
        f"{100 * value[('syncpoint_goodput_ratio',)]:.2f}% (journal {100 * g.ratio:.2f}%), "
        + ", ".join(f"{'/'.join(k)}={v:g}" for k, v in sorted(value.items()))
    )
    assert abs(value[("syncpoint_goodput_ratio",)] - g.ratio) <= 0.01
    labels = seen[("syncpoint_goodput_ratio",)][1]
    assert labels["submission"] == journal.attempts[-1].submission
    expected = {
        (s.series, *(v for k, v in s.labels if k in ("cause", "kind"))): s.value
        for s in samples(then, job_name=spec.name, submission=labels["submission"], micro_batch_size=2)
    }
    for key in [
        ("syncpoint_restarts", "in_place"),
        ("syncpoint_restarts", "new_worker_group"),
        ("syncpoint_lost_micro_steps",),
        ("syncpoint_committed_micro_step",),
        ("syncpoint_attempt",),
    ]:
        assert value[key] == expected[key], key
    assert value[("syncpoint_attempt",)] == 3
    # every series the driver publishes (and the dashboard queries) is in a real scrape
    assert {k[0] for k in value} == SERIES_NAMES
