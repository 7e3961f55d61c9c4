"""The monitoring component (``k8s/components/monitoring``), offline: stacked on the base, it renders a
PodMonitor that scrapes Ray's metrics port on the job's pods, a NetworkPolicy that opens that port to
the monitoring namespace alone, and a RayJob that still matches KubeRay's schema and every hardening
rule; and its Grafana dashboard is well-formed JSON whose every query names only series the driver
publishes (``syncpoint.policies.decisions.metric_samples.SERIES``, as Ray exports them: ``ray_``
first) and only their labels. A real scrape of those series: tests/ray/test_metrics_on_ray.py."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from syncpoint.policies.decisions.goodput import BADPUT
from syncpoint.policies.decisions.metric_samples import BASE_LABELS, RESTART_KINDS, SERIES, SERIES_NAMES
from tests.k8s.test_k8s import (
    K8S,
    _pod_labels,
    _workers,
    crd_schema,
    hardening_problems,
    one,
    render,
    schema_errors,
    strict,
)

COMPONENT = K8S / "components" / "monitoring"
DASHBOARD = COMPONENT / "syncpoint-dashboard.json"
RAY_PREFIX = "ray_"  # Ray's exporter's namespace, before every ray.util.metrics name
METRICS_PORT = 8080  # KubeRay's default metrics-export-port, set explicitly by the component
LABELS = {*BASE_LABELS, *(s.label for s in SERIES if s.label)}


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[dict[str, Any]]:
    """The base with the component, as a user stacks it (docs/metrics.md)."""
    here = tmp_path_factory.mktemp("monitoring")
    rel = Path(os.path.relpath(K8S, here))
    (here / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [str(rel / "base")],
                "components": [str(rel / "components" / "monitoring")],
            }
        )
    )
    return render(here)


def test_the_component_adds_a_podmonitor_and_a_scrape_allowance_and_stays_valid_and_hardened(docs):
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "syncpoint-job"),
        ("NetworkPolicy", "syncpoint-allow-metrics-scrape"),
        ("NetworkPolicy", "syncpoint-deny-ingress"),
        ("PodMonitor", "syncpoint-ray"),
        ("RayJob", "syncpoint-tiny-lm"),
        ("ServiceAccount", "syncpoint"),
    ]
    job = one(docs, "RayJob")
    validator = jsonschema.Draft7Validator(strict(copy.deepcopy(crd_schema("rayjobs"))))
    assert schema_errors(validator, job) == []
    assert hardening_problems(docs) == []


def test_the_podmonitor_scrapes_rays_metrics_port_on_every_ray_pod(docs):
    job = one(docs, "RayJob")
    monitor = one(docs, "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    roles = dict(_pod_labels(job))
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    groups = [("head", head), *((g["groupName"], g) for g in _workers(job))]
    for role, group in groups:
        assert selector.items() <= roles[role].items(), role
        assert group["rayStartParams"]["metrics-export-port"] == str(METRICS_PORT), role
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports[endpoint["port"]] == METRICS_PORT, role


def test_the_scrape_allowance_opens_the_metrics_port_to_one_namespace_only(docs):
    allow = next(d for d in docs if d["metadata"]["name"] == "syncpoint-allow-metrics-scrape")
    [rule] = allow["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": METRICS_PORT}]
    [peer] = rule["from"]
    assert set(peer) == {"namespaceSelector"} and peer["namespaceSelector"]["matchLabels"]  # never {}: everyone
    assert allow["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "syncpoint"}


# ---------------------------------------------------------------- the dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel's every target, and of the template variables' queries."""
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["definition"]))
    return out


# PromQL's words that are not series: functions, aggregations, modifiers
_PROMQL_WORDS = {"max", "min", "sum", "avg", "by", "without", "label_values", "rate", "increase", "on", "ignoring"}


def test_every_query_names_only_published_series_and_their_labels(dashboard):
    queries = _queries(dashboard)
    assert queries
    used: set[str] = set()
    for title, expr in queries:
        no_strings = re.sub(r'"[^"]*"', '""', expr)
        names = {w for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", no_strings) if w not in _PROMQL_WORDS}
        series = {n for n in names if n.startswith(RAY_PREFIX)}
        assert series, f"{title}: {expr} names no series"
        for name in series:
            assert name[len(RAY_PREFIX) :] in SERIES_NAMES, f"{title}: {name} is not a published series"
        labels = (names - series) | set(re.findall(r"([A-Za-z_]\w*)\s*=~?", expr))
        assert labels <= LABELS, f"{title}: labels {sorted(labels - LABELS)} are not the series' labels"
        for value in re.findall(r'cause="([^"]*)"', expr):
            assert value in {k for k, _ in BADPUT}, f"{title}: cause {value!r}"
        for value in re.findall(r'kind="([^"]*)"', expr):
            assert value in RESTART_KINDS, f"{title}: kind {value!r}"
        used |= {n[len(RAY_PREFIX) :] for n in series}
    # the panels the issue asks for: goodput, the badput stack, restarts and recovery, save stall, throughput
    for needed in (
        "syncpoint_goodput_ratio",
        "syncpoint_badput_seconds",
        "syncpoint_restarts",
        "syncpoint_last_recovery_seconds",
        "syncpoint_last_save_blocked_seconds",
        "syncpoint_samples_per_second",
    ):
        assert needed in used, needed


def test_the_dashboard_is_well_formed(dashboard):
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job_name"} <= names
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and all(t["refId"] for t in p["targets"]), p["title"]
            assert p["description"], p["title"]
    stacked = [p for p in panels if p.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("stacking")]
    assert any(p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal" for p in stacked)
