"""Offline checks of the KubeRay manifests under ``k8s/`` (no kubectl, no cluster, no network).

Why: a RayJob that the API server rejects, a head that lands on a spot node, or a grace period
shorter than Ray's drain timeout all fail only on a real cluster, after a preemption, when it
is too late. So every overlay is rendered here (a tiny stand-in for ``kustomize build``), each
RayJob is validated against the KubeRay v1.7.0 CRD schema the way ``kubectl --validate=strict``
would, and the operator rules that the schema cannot express are asserted directly.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
import yaml

from orchestrator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
CRD_DIR = ROOT.parent / "shared" / "kuberay-crds" / "v1.7.0"  # shared data beside the repo

Doc = dict[str, Any]

OVERLAYS = ["gke-spot", "eks-spot", "karpenter-spot", "gpu"]
# overlay -> (worker nodeSelector key, value) that puts the workers on spot capacity
SPOT = {
    "gke-spot": ("cloud.google.com/gke-spot", "true"),
    "eks-spot": ("eks.amazonaws.com/capacityType", "SPOT"),
    "karpenter-spot": ("karpenter.sh/capacity-type", "spot"),
}
# every label a spot/preemptible node may carry, with its spot value (None: presence is enough)
SPOT_LABELS: dict[str, str | None] = {
    "cloud.google.com/gke-spot": None,
    "cloud.google.com/gke-preemptible": None,
    "eks.amazonaws.com/capacityType": "SPOT",
    "karpenter.sh/capacity-type": "spot",
    "kubernetes.azure.com/scalesetpriority": "spot",
}
SUBMISSION_MODES = {"K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"}
CREDENTIAL_VARS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                   "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_KEY"}
ENTRYPOINT_SPEC = "/etc/syncpoint/job.yaml"


# ---------------------------------------------------------------- a minimal `kustomize build`


def _load_all(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _matches(doc: Doc, target: dict[str, str]) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    have = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    unknown = set(target) - set(have)
    assert not unknown, f"patch target fields {unknown} are not supported by this renderer"
    return all(have[k] == v for k, v in target.items())


def _apply_op(doc: Doc, op: dict[str, Any]) -> None:
    """One RFC 6902 add/replace/remove; a missing parent raises, as kustomize fails the build."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent: Any = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last, kind, value = parts[-1], op["op"], copy.deepcopy(op.get("value"))
    if isinstance(parent, list):
        if kind == "add":
            parent.insert(len(parent) if last == "-" else int(last), value)
        elif kind == "replace":
            parent[int(last)] = value
        elif kind == "remove":
            del parent[int(last)]
        else:
            raise ValueError(f"unsupported JSON6902 op {kind!r}")
    elif kind == "add" or (kind == "replace" and last in parent):
        parent[last] = value
    elif kind == "remove" or kind == "replace":
        raise KeyError(f"{op['path']}: no such member to {kind}")
    else:
        raise ValueError(f"unsupported JSON6902 op {kind!r}")


def render(path: Path, docs: list[Doc] | None = None) -> list[Doc]:
    """Render a kustomization: resources, components and inline JSON6902 patches.

    That is everything k8s/ uses. Any other kustomization field is an error rather than ignored,
    so this can never quietly render something different from what kustomize would.
    """
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "components", "patches"}
    assert not unknown, f"{path}: renderer does not implement {sorted(unknown)}"
    is_component = docs is not None
    assert k["kind"] == ("Component" if is_component else "Kustomization"), path
    out: list[Doc] = list(docs or [])
    for r in k.get("resources", []):
        p = path / r
        out += render(p) if p.is_dir() else _load_all(p)
    for c in k.get("components", []):
        out = render(path / c, out)
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"])
        assert isinstance(ops, list), f"{path}: only JSON6902 patches are rendered here"
        hits = [d for d in out if _matches(d, patch["target"])]
        assert hits, f"{path}: patch target {patch['target']} matches no resource"
        for d in hits:
            for op in ops:
                _apply_op(d, op)
    ids = [(d["kind"], d["metadata"]["name"]) for d in out]
    assert len(ids) == len(set(ids)), f"{path}: duplicate resources {ids}"
    return out


def one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(K8S / "overlays" / request.param)


# ---------------------------------------------------------------- CRD schema, strict like kubectl


def strict(schema: Any) -> Any:
    """Close every object schema that lists ``properties``: unknown fields become errors.

    Structural walk (properties / items / additionalProperties / *Of), so a field that happens
    to be named ``properties`` is never mistaken for a schema keyword.
    """
    if not isinstance(schema, dict):
        return schema
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        strict(sub)
    for key in ("items", "additionalProperties", "not"):
        strict(schema.get(key))
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key, []):
            strict(sub)
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    if not CRD_DIR.is_dir():
        pytest.skip(f"KubeRay v1.7.0 CRD schemas not found at {CRD_DIR} (see shared/kuberay-crds/README.md)")
    crd = json.loads((CRD_DIR / "ray.io_rayjobs.v1.json").read_text())
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1" and version["served"]
    schema = strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def schema_errors(validator: Any, doc: Doc) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(doc))


def test_every_rayjob_matches_the_crd_schema(overlay: tuple[str, list[Doc]], validator: Any) -> None:
    name, docs = overlay
    job = one(docs, "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    assert schema_errors(validator, job) == [], name


BROKEN: dict[str, Callable[[Doc], None]] = {
    "unknown top-level spec field": lambda j: j["spec"].update(backofLimit=3),
    "unknown container field": lambda j: _head(j)["containers"][0].update(imagePullPolicyy="Always"),
    "rayStartParams value not a string": lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]
    ["rayStartParams"].update({"num-cpus": 0}),
    "worker group without groupName": lambda j: _workers(j)[0].pop("groupName"),
    "bad resource quantity": lambda j: _head(j)["containers"][0]["resources"]["limits"].update(cpu="two"),
}


@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_validator_rejects_a_broken_rayjob(validator: Any, breakage: str) -> None:
    job = copy.deepcopy(one(render(K8S / "base"), "RayJob"))
    assert schema_errors(validator, job) == []
    BROKEN[breakage](job)
    assert schema_errors(validator, job), f"{breakage} was accepted"


# ---------------------------------------------------------------- rules the schema does not carry


def _head(job: Doc) -> Doc:
    return job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]


def _workers(job: Doc) -> list[Doc]:
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"]


def _cpus(q: str | int | float) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def _job_spec(docs: list[Doc]) -> Any:
    cm = one(docs, "ConfigMap")
    return parse_spec(cm["data"]["job.yaml"], f"ConfigMap {cm['metadata']['name']}")


def test_operator_rules(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    spec = one(docs, "RayJob")["spec"]
    assert spec["submissionMode"] in SUBMISSION_MODES, f"{name}: unknown submissionMode"
    if spec.get("suspend"):
        assert spec.get("shutdownAfterJobFinishes"), "suspend needs shutdownAfterJobFinishes"
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    assert spec["backoffLimit"] >= 1, "whole-cluster retries are how a lost head is survived"
    assert spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", \
        f"{name}: no training worker may be scheduled on the head"
    pinned = re.search(r'"ray\[[^]]*\]==(\d+\.\d+)', (ROOT / "pyproject.toml").read_text())
    assert pinned and spec["rayClusterSpec"]["rayVersion"].startswith(pinned.group(1) + ".")
    images = {c["image"] for pod in [_head(one(docs, "RayJob")), spec["submitterPodTemplate"]["spec"]]
              + [g["template"]["spec"] for g in spec["rayClusterSpec"]["workerGroupSpecs"]]
              for c in pod["containers"]}
    assert len(images) == 1, f"{name}: head, workers and submitter must run one image: {images}"


def test_entrypoint_reads_the_mounted_job_spec(overlay: tuple[str, list[Doc]]) -> None:
    _, docs = overlay
    job, cm = one(docs, "RayJob"), one(docs, "ConfigMap")
    assert shlex.split(job["spec"]["entrypoint"]) == ["syncpoint", "run", ENTRYPOINT_SPEC]
    head = _head(job)
    volume = next(v["name"] for v in head["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"])
    mounts = {m["mountPath"] for m in head["containers"][0]["volumeMounts"] if m["name"] == volume}
    assert os.path.dirname(ENTRYPOINT_SPEC) in mounts
    assert os.path.basename(ENTRYPOINT_SPEC) in cm["data"]


def _excludes_spot(pod: Doc) -> list[str]:
    """Spot labels the pod's required node affinity does *not* rule out."""
    terms = pod.get("affinity", {}).get("nodeAffinity", {}) \
        .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
    missing = []
    for key, value in SPOT_LABELS.items():
        def rules_out(e: Doc) -> bool:
            return e["key"] == key and (e["operator"] == "DoesNotExist"
                                        or (e["operator"] == "NotIn" and value in e.get("values", [])))
        # nodeSelectorTerms are ORed: every term must rule the label out
        if not terms or not all(any(rules_out(e) for e in t.get("matchExpressions", [])) for t in terms):
            missing.append(key)
    return missing


def test_head_and_submitter_never_on_spot(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    job = one(docs, "RayJob")
    for role, pod in [("head", _head(job)), ("submitter", job["spec"]["submitterPodTemplate"]["spec"])]:
        selector = pod.get("nodeSelector", {})
        for key, value in SPOT_LABELS.items():
            assert key not in selector or (value is not None and selector[key] != value), (name, role, key)
        assert not [t for t in pod.get("tolerations", []) if t.get("key") in SPOT_LABELS], (name, role)
        assert _excludes_spot(pod) == [], f"{name}: {role} affinity does not exclude these spot labels"


def test_spot_overlays_put_workers_on_spot() -> None:
    for name, (key, value) in SPOT.items():
        for group in _workers(one(render(K8S / "overlays" / name), "RayJob")):
            pod = group["template"]["spec"]
            assert pod["nodeSelector"][key] == value, name
            assert any(t["key"] == key and t.get("effect", "NoSchedule") == "NoSchedule"
                       and (t["operator"] == "Exists" or (t["operator"] == "Equal" and t["value"] == value))
                       for t in pod["tolerations"]), f"{name}: no toleration matching {key}={value}"


def test_worker_grace_period_outlasts_ray_drain(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    for group in _workers(one(docs, "RayJob")):
        pod = group["template"]["spec"]
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
            assert drain > 0, "0 disables the drain: SIGTERM would kill the node without a notice"
            assert pod["terminationGracePeriodSeconds"] > drain, name


def _credential_values(node: Any) -> list[str]:
    found = []
    if isinstance(node, dict):
        if node.get("name") in CREDENTIAL_VARS and "value" in node:
            found.append(node["name"])
        for v in node.values():
            found += _credential_values(v)
    elif isinstance(node, list):
        for v in node:
            found += _credential_values(v)
    return found


def test_no_inline_credentials() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    for path in files:
        text = path.read_text()
        assert not re.search(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b", text), f"{path}: looks like an AWS key id"
        for doc in _load_all(path):
            assert _credential_values(doc) == [], f"{path}: credential given inline as env value"
            if doc.get("kind") == "Secret":
                assert path.name.endswith(".example.yaml"), f"{path}: real Secrets stay out of the repo"
                assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(doc["stringData"])
                assert not any(doc["stringData"].values()), f"{path}: example Secret must hold no values"
    secret = one(_load_all(K8S / "base" / "secret.example.yaml"), "Secret")["metadata"]["name"]
    for name in OVERLAYS:
        docs = render(K8S / "overlays" / name)
        assert not [d for d in docs if d["kind"] == "Secret"], f"{name}: renders a Secret"
        job = one(docs, "RayJob")
        for pod in [_head(job)] + [g["template"]["spec"] for g in _workers(job)]:
            refs = [e["secretRef"]["name"] for e in pod["containers"][0].get("envFrom", []) if "secretRef" in e]
            assert refs == [secret], f"{name}: storage credentials must come from Secret {secret}"


def test_job_spec_in_the_configmap_is_valid(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    spec = _job_spec(docs)
    assert spec.storage == "s3://YOUR-BUCKET/syncpoint" and spec.scaling.num_workers == 2
    groups = _workers(one(docs, "RayJob"))
    assert sum(g["replicas"] for g in groups) == spec.scaling.num_workers, "one Ray Train worker per pod"
    for g in groups:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert _cpus(limits["cpu"]) >= spec.scaling.cpus_per_worker, name
        assert spec.scaling.use_gpu == (int(limits.get("nvidia.com/gpu", 0)) >= 1), name


def test_gpu_overlay_requests_gpus_and_changes_nothing_else_in_the_spec() -> None:
    docs = render(K8S / "overlays" / "gpu")
    job = one(docs, "RayJob")
    assert "nvidia.com/gpu" not in str(_head(job)), "the head needs no GPU"
    for g in _workers(job):
        pod = g["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    gpu = _job_spec(docs).model_dump()
    base = _job_spec(render(K8S / "base")).model_dump()
    assert gpu["scaling"].pop("use_gpu") is True and base["scaling"].pop("use_gpu") is False
    assert gpu == base, "the gpu component's copy of the job spec drifted from base/configmap.yaml"


def test_gpu_component_stacks_on_a_spot_overlay(tmp_path: Path, validator: Any) -> None:
    """The README's "GPU workers on spot" recipe: a spot overlay plus the gpu component."""
    rel = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(rel / "overlays" / "gke-spot")], "components": [str(rel / "components" / "gpu")]}))
    docs = render(tmp_path)
    job = one(docs, "RayJob")
    pod = _workers(job)[0]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {t["key"] for t in pod["tolerations"]} == {"cloud.google.com/gke-spot", "nvidia.com/gpu"}
    assert _job_spec(docs).scaling.use_gpu
    assert schema_errors(validator, job) == []
