"""Offline checks of the KubeRay manifests under ``k8s/`` (no kubectl, no cluster, no network).

Why: a RayJob that the API server rejects, a head that lands on a spot node, or a grace period
shorter than Ray's drain timeout all fail only on a real cluster, after a preemption, when it
is too late. So every overlay is rendered here (a tiny stand-in for ``kustomize build``), each
RayJob is validated against the KubeRay v1.7.0 CRD schema the way ``kubectl --validate=strict``
would, and the operator rules that the schema cannot express are asserted directly.

The deploy is also checked as a platform team would review it (issue #14 section 9): Ray token
authentication and KubeRay's network policy on, a dedicated ServiceAccount without an API token,
non-root pods without privileges on a read-only root filesystem with size-limited scratch space,
ephemeral storage sized for a fetched state, secrets only from Secrets, images by digest. Each rule
is a function returning the problems it finds, and a table of broken manifests proves that every
rule catches what it is there to catch.

The KubeRay v1.7.0 CRD schemas are carried in ``k8s/crds/`` (Apache-2.0 data from the KubeRay
project, see its README), so nothing here reads outside the repository or skips on a fresh clone.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from syncpoint.orchestrator.spec_file import parse_spec

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBERAY_VERSION = "v1.7.0"
CRD_DIR = K8S / "crds" / KUBERAY_VERSION  # carried in the repository (Apache-2.0, see its README)

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
CREDENTIAL_VARS = {
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_KEY",
    "RAY_AUTH_TOKEN",
    "SYNCPOINT_SIGNING_KEY",
}
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
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        strict(sub)
    for key in ("items", "additionalProperties", "not"):
        strict(schema.get(key))
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key, []):
            strict(sub)
    return schema


def crd_schema(name: str) -> Doc:
    """The v1 openAPIV3Schema of a KubeRay CRD carried in k8s/crds/ (never skipped: it is in the repo)."""
    path = CRD_DIR / f"ray.io_{name}.v1.json"
    assert path.is_file(), f"{path} is missing: the CRD schemas are part of the repository (k8s/crds/README.md)"
    version = json.loads(path.read_text())["spec"]["versions"][0]
    assert version["name"] == "v1" and version["served"]
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(copy.deepcopy(crd_schema("rayjobs"))))


@pytest.fixture(scope="module")
def cluster_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(copy.deepcopy(crd_schema("rayclusters"))["properties"]["spec"]))


def test_crd_schemas_are_carried_in_the_repository() -> None:
    """A fresh clone validates offline: the schemas live under k8s/crds/, tracked, with their licence."""
    assert CRD_DIR.resolve().is_relative_to(ROOT), CRD_DIR
    notice = (CRD_DIR.parent / "README.md").read_text()
    assert "Apache" in notice and "KubeRay" in notice and KUBERAY_VERSION in notice
    files = sorted(p.name for p in CRD_DIR.iterdir())
    assert files == ["ray.io_rayclusters.v1.json", "ray.io_rayjobs.v1.json"], files
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", *map(str, CRD_DIR.iterdir())],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert ignored.returncode == 1 and not ignored.stdout, f"git ignores {ignored.stdout}"
    # a RayJob's rayClusterSpec is a RayCluster's spec: one schema, so authOptions/networkPolicy mean the same
    assert (
        crd_schema("rayjobs")["properties"]["spec"]["properties"]["rayClusterSpec"]
        == crd_schema("rayclusters")["properties"]["spec"]
    )


def schema_errors(validator: Any, doc: Doc) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc))


def test_every_rayjob_matches_the_crd_schema(
    overlay: tuple[str, list[Doc]], validator: Any, cluster_validator: Any
) -> None:
    name, docs = overlay
    job = one(docs, "RayJob")
    assert job["apiVersion"] == "ray.io/v1"
    assert schema_errors(validator, job) == [], name
    assert schema_errors(cluster_validator, job["spec"]["rayClusterSpec"]) == [], name


BROKEN: dict[str, Callable[[Doc], None]] = {
    "unknown top-level spec field": lambda j: j["spec"].update(backofLimit=3),
    "unknown container field": lambda j: _head(j)["containers"][0].update(imagePullPolicyy="Always"),
    "rayStartParams value not a string": lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"][
        "rayStartParams"
    ].update({"num-cpus": 0}),
    "worker group without groupName": lambda j: _workers(j)[0].pop("groupName"),
    "bad resource quantity": lambda j: _head(j)["containers"][0]["resources"]["limits"].update(cpu="two"),
    "unknown auth mode": lambda j: j["spec"]["rayClusterSpec"]["authOptions"].update(mode="tokens"),
    "unknown network policy mode": lambda j: j["spec"]["rayClusterSpec"]["networkPolicy"].update(mode="DenyNone"),
    "misspelt securityContext field": lambda j: _head(j)["containers"][0]["securityContext"].update(
        readOnlyRootFileSystem=True
    ),
    "bad ephemeral-storage quantity": lambda j: _workers(j)[0]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ].update({"ephemeral-storage": "lots"}),
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
    assert spec["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", (
        f"{name}: no training worker may be scheduled on the head"
    )
    pinned = re.search(r'"ray\[[^]]*\]==(\d+\.\d+)', (ROOT / "pyproject.toml").read_text())
    assert pinned and spec["rayClusterSpec"]["rayVersion"].startswith(pinned.group(1) + ".")
    images = {
        c["image"]
        for pod in [_head(one(docs, "RayJob")), spec["submitterPodTemplate"]["spec"]]
        + [g["template"]["spec"] for g in spec["rayClusterSpec"]["workerGroupSpecs"]]
        for c in pod["containers"]
    }
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


def _rules_out(e: Doc, key: str, value: str | None) -> bool:
    """Whether one node-affinity expression keeps the pod off nodes labelled key=value."""
    return e["key"] == key and (
        e["operator"] == "DoesNotExist" or (e["operator"] == "NotIn" and value in e.get("values", []))
    )


def _excludes_spot(pod: Doc) -> list[str]:
    """Spot labels the pod's required node affinity does *not* rule out."""
    terms = (
        pod.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )
    missing = []
    for key, value in SPOT_LABELS.items():
        # nodeSelectorTerms are ORed: every term must rule the label out
        if not terms or not all(any(_rules_out(e, key, value) for e in t.get("matchExpressions", [])) for t in terms):
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
            assert any(
                t["key"] == key
                and t.get("effect", "NoSchedule") == "NoSchedule"
                and (t["operator"] == "Exists" or (t["operator"] == "Equal" and t["value"] == value))
                for t in pod["tolerations"]
            ), f"{name}: no toleration matching {key}={value}"


def test_worker_grace_period_outlasts_ray_drain(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    for group in _workers(one(docs, "RayJob")):
        pod = group["template"]["spec"]
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
            assert drain > 0, "0 disables the drain: SIGTERM would kill the node without a notice"
            assert pod["terminationGracePeriodSeconds"] > drain, name


def test_every_ray_container_preloads_ray_trains_worker_module(overlay: tuple[str, list[Doc]]) -> None:
    """A restart's spare Ray workers (``syncpoint.orchestrator.spare_workers``) are warm only when the
    raylet starts every worker process with Ray Train's worker module imported: the module the code
    names, in the head's and every worker group's Ray container."""
    from syncpoint.orchestrator.spare_workers import PRELOAD_ENV, TRAIN_WORKER_MODULE

    name, docs = overlay
    job = one(docs, "RayJob")
    pods = [_head(job), *(group["template"]["spec"] for group in _workers(job))]
    for pod in pods:
        ray_container = pod["containers"][0]
        assert _env(ray_container)[PRELOAD_ENV].get("value") == TRAIN_WORKER_MODULE, (name, ray_container["name"])


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


def _example_secrets() -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in _load_all(K8S / "base" / "secret.example.yaml") if d["kind"] == "Secret"}


def test_no_inline_credentials() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    for path in files:
        text = path.read_text()
        assert not re.search(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b", text), f"{path}: looks like an AWS key id"
        for doc in _load_all(path):
            assert _credential_values(doc) == [], f"{path}: credential given inline as env value"
            if doc.get("kind") == "Secret":
                assert path.name.endswith(".example.yaml"), f"{path}: real Secrets stay out of the repo"
                assert not any(doc.get("stringData", {}).values()) and not doc.get("data"), (
                    f"{path}: example Secret {doc['metadata']['name']} must hold no values"
                )
    examples = _example_secrets()
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(examples[STORAGE_SECRET]["stringData"])
    assert set(examples[TOKEN_SECRET]["stringData"]) == {TOKEN_KEY}, "KubeRay reads the token from key auth_token"
    assert set(examples[SIGNING_SECRET]["stringData"]) == {SIGNING_KEY}
    for name in OVERLAYS:
        docs = render(K8S / "overlays" / name)
        assert not [d for d in docs if d["kind"] == "Secret"], f"{name}: renders a Secret"
        job = one(docs, "RayJob")
        for pod in [_head(job)] + [g["template"]["spec"] for g in _workers(job)]:
            refs = [e["secretRef"]["name"] for e in pod["containers"][0].get("envFrom", []) if "secretRef" in e]
            assert refs == [STORAGE_SECRET], f"{name}: storage credentials must come from Secret {STORAGE_SECRET}"
        used = set(re.findall(r"syncpoint-[a-z-]+", json.dumps(job)))
        assert set(examples) <= used, f"{name}: example Secrets nothing refers to: {set(examples) - used}"


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
    """The "GPU workers on spot" recipe of docs/deploy/kubernetes.md: a spot overlay plus the gpu component."""
    rel = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [str(rel / "overlays" / "gke-spot")],
                "components": [str(rel / "components" / "gpu")],
            }
        )
    )
    docs = render(tmp_path)
    job = one(docs, "RayJob")
    pod = _workers(job)[0]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {t["key"] for t in pod["tolerations"]} == {"cloud.google.com/gke-spot", "nvidia.com/gpu"}
    assert _job_spec(docs).scaling.use_gpu
    assert schema_errors(validator, job) == []


# ---------------------------------------------------------------- hardening (issue #14 section 9)
#
# Each rule returns the problems it finds in one rendered flavour; every flavour must have none, and
# BROKEN_HARDENING below shows each rule failing on the manifest it exists to reject.

STORAGE_SECRET = "syncpoint-storage"
TOKEN_SECRET, TOKEN_KEY = "syncpoint-ray-token", "auth_token"  # KubeRay's key (RAY_AUTH_TOKEN_SECRET_KEY)
SIGNING_SECRET, SIGNING_KEY, SIGNING_ENV = "syncpoint-signing-key", "signing_key", "SYNCPOINT_SIGNING_KEY"
TOKEN_AUTH_SINCE = (2, 52, 0)  # KubeRay refuses authOptions.mode: token for older Ray
RAY_UID = 1000  # the Ray image's `ray` user
IMAGE_BY_DIGEST = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
# where libraries write when the root filesystem is read-only; each must point into a writable volume.
# TORCH_EXTENSIONS_DIR: on CPU, DeepSpeed builds its shm_comm op into ~/.cache/torch_extensions at
# start-up, which fails with EROFS on a read-only root (found running Ray + syncpoint that way).
SCRATCH_ENV = ("SYNCPOINT_STAGING_DIR", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR")
RAY_SCRATCH_ENV = ("TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME")
# state bytes per parameter, an upper bound: weights + fp32 master copy + two Adam moments (16 B)
# and room for bf16/fp16 copies and serialization
BYTES_PER_PARAM = 20
GiB = 1 << 30
HEADROOM = GiB // 2  # container logs and writable-layer bytes on top of the emptyDirs
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _pods(job: Doc) -> list[tuple[str, Doc]]:
    """(role, pod spec) for the head, each worker group and the submitter."""
    return (
        [("head", _head(job))]
        + [(f"workers[{g['groupName']}]", g["template"]["spec"]) for g in _workers(job)]
        + [("submitter", job["spec"]["submitterPodTemplate"]["spec"])]
    )


def _pod_labels(job: Doc) -> list[tuple[str, dict[str, str]]]:
    spec = job["spec"]
    return (
        [("head", spec["rayClusterSpec"]["headGroupSpec"]["template"].get("metadata", {}).get("labels", {}))]
        + [(g["groupName"], g["template"].get("metadata", {}).get("labels", {})) for g in _workers(job)]
        + [("submitter", spec["submitterPodTemplate"].get("metadata", {}).get("labels", {}))]
    )


def _env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def _bytes(q: str | int) -> int:
    """A Kubernetes quantity in bytes (the forms these manifests use)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTPE]i?)?", str(q))
    assert m, f"unsupported quantity {q!r}"
    unit = m.group(2) or ""
    scale = (1024 if unit.endswith("i") else 1000) ** ("KMGTPE".index(unit[0]) + 1) if unit else 1
    return int(float(m.group(1)) * scale)


def _mount_of(path: str, mounts: list[Doc]) -> Doc | None:
    """The mount a path lies in (the deepest one), or None: the path is on the root filesystem."""
    inside = [m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    return max(inside, key=lambda m: len(m["mountPath"]), default=None)


def token_auth_problems(docs: list[Doc]) -> list[str]:
    job = one(docs, "RayJob")
    rcs, out = job["spec"]["rayClusterSpec"], []
    auth = rcs.get("authOptions") or {}
    if auth.get("mode") != "token":
        out.append("authOptions.mode is not token: Ray's dashboard/Job API, GCS and client server accept anyone")
    if auth.get("enableK8sTokenAuth") and auth.get("secretName"):
        out.append("authOptions: enableK8sTokenAuth and secretName together are refused by the operator")
    secret = auth.get("secretName")
    if secret != TOKEN_SECRET:
        out.append(
            f"authOptions.secretName is {secret!r}, not the pre-created Secret {TOKEN_SECRET} every retry shares"
        )
    version = tuple(int(x) for x in re.findall(r"\d+", rcs["rayVersion"])[:3])
    if version < TOKEN_AUTH_SINCE:
        out.append(f"rayVersion {rcs['rayVersion']} predates Ray token authentication")
    submitter = job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]
    env = _env(submitter)
    if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
        out.append("submitter: RAY_AUTH_MODE is not token, so `ray job submit` sends no token")
    ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef", {})
    if (ref.get("name"), ref.get("key")) != (secret, TOKEN_KEY) or ref.get("optional"):
        out.append(f"submitter: RAY_AUTH_TOKEN must come from Secret {secret} key {TOKEN_KEY} (required): {ref}")
    for role, pod in _pods(job):
        for c in pod["containers"] + pod.get("initContainers", []):
            e = _env(c)
            if "RAY_AUTH_MODE" in e and e["RAY_AUTH_MODE"].get("value") != "token":
                out.append(f"{role}/{c['name']}: RAY_AUTH_MODE={e['RAY_AUTH_MODE'].get('value')!r} turns auth off")
            if "RAY_AUTH_TOKEN" in e:
                r = e["RAY_AUTH_TOKEN"].get("valueFrom", {}).get("secretKeyRef", {})
                if "value" in e["RAY_AUTH_TOKEN"] or (r.get("name"), r.get("key")) != (secret, TOKEN_KEY):
                    out.append(f"{role}/{c['name']}: RAY_AUTH_TOKEN is not the cluster's Secret")
    return out


def network_problems(docs: list[Doc]) -> list[str]:
    job = one(docs, "RayJob")
    np_ = job["spec"]["rayClusterSpec"].get("networkPolicy")
    if not np_:
        return ["no spec.rayClusterSpec.networkPolicy: Ray's ports 6379/8265/10001 are open to every pod"]
    out = _policy_section_problems(np_)
    for g in _workers(job):
        if not DNS1123_LABEL.fullmatch(g["groupName"]):
            out.append(f"worker group {g['groupName']!r}: not a DNS-1123 label, refused with networkPolicy")
    return out + _deny_ingress_problems(docs, job)


def _policy_section_problems(np_: dict) -> list[str]:
    """The RayJob's networkPolicy: a deny mode, and no ingress rule that admits every source."""
    out = []
    mode = np_.get("mode", "DenyAll")
    if mode not in ("DenyAll", "DenyAllIngress"):
        out.append(f"networkPolicy.mode {mode} leaves ingress open")
    sections = [("head", np_.get("head") or {}), ("worker", np_.get("worker") or {})] + [
        (f"workerGroups[{g['groupName']}]", g) for g in np_.get("workerGroups", [])
    ]
    for where, sec in sections:
        if mode == "DenyAllIngress" and sec.get("egressRules"):
            out.append(f"networkPolicy.{where}.egressRules under DenyAllIngress: the operator refuses the cluster")
        for rule in sec.get("ingressRules", []):
            if _admits_everyone(rule.get("from") or []):
                out.append(f"networkPolicy.{where}.ingressRules admits every source: {rule}")
    return out


def _admits_everyone(peers: list[dict]) -> bool:
    return not peers or any(
        p.get("ipBlock", {}).get("cidr") in ("0.0.0.0/0", "::/0")
        or (p.get("namespaceSelector") == {} and not p.get("podSelector"))
        for p in peers
    )


def _deny_ingress_problems(docs: list[Doc], job: Doc) -> list[str]:
    """KubeRay creates its policies after the pods may have started: a deny-ingress policy applied with the
    flavour must already select every syncpoint pod, and no policy of the flavour admits every source."""
    out = []
    denies = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", [])
        and not d["spec"].get("ingress")
        and not d["spec"]["podSelector"].get("matchExpressions")
    ]
    for role, labels in _pod_labels(job):
        if not any(d["spec"]["podSelector"].get("matchLabels", {}).items() <= labels.items() for d in denies):
            out.append(f"{role}: no deny-ingress NetworkPolicy selects this pod before KubeRay's policies exist")
    for d in docs:
        if d["kind"] == "NetworkPolicy" and any(not r.get("from") for r in d["spec"].get("ingress", [])):
            out.append(f"NetworkPolicy {d['metadata']['name']} admits ingress from every source")
    return out


def identity_problems(docs: list[Doc]) -> list[str]:
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    out = []
    for role, pod in _pods(one(docs, "RayJob")):
        sa = pod.get("serviceAccountName")
        if sa in (None, "", "default"):
            out.append(f"{role}: runs as the namespace's default ServiceAccount")
        elif sa not in accounts:
            out.append(f"{role}: ServiceAccount {sa} is not part of the flavour")
        elif accounts[sa].get("automountServiceAccountToken") is not False:
            out.append(f"ServiceAccount {sa}: automountServiceAccountToken is not false")
        if pod.get("automountServiceAccountToken") is not False:
            out.append(f"{role}: the Kubernetes API token is mounted into the pod")
    return out


def security_context_problems(docs: list[Doc]) -> list[str]:
    out = []
    for role, pod in _pods(one(docs, "RayJob")):
        psc = pod.get("securityContext", {})
        # pod-level too: it covers the init containers KubeRay injects (wait-gcs-ready)
        if psc.get("runAsNonRoot") is not True or psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            out.append(f"{role}: pod securityContext lacks runAsNonRoot: true / seccompProfile RuntimeDefault")
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(host):
                out.append(f"{role}: {host}")
        out += [f"{role}: hostPath volume {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
        for c in pod["containers"] + pod.get("initContainers", []):
            csc, who = c.get("securityContext", {}), f"{role}/{c['name']}"
            uid = csc.get("runAsUser", psc.get("runAsUser"))
            if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True or uid != RAY_UID:
                out.append(f"{who}: must run as non-root uid {RAY_UID} (runAsUser {uid})")
            if csc.get("allowPrivilegeEscalation") is not False or csc.get("privileged"):
                out.append(f"{who}: privilege escalation not disabled")
            if csc.get("readOnlyRootFilesystem") is not True:
                out.append(f"{who}: root filesystem is writable")
            caps = csc.get("capabilities", {})
            if "ALL" not in caps.get("drop", []) or caps.get("add"):
                out.append(f"{who}: capabilities not all dropped ({caps})")
            if csc.get("seccompProfile", psc.get("seccompProfile", {})).get("type") != "RuntimeDefault":
                out.append(f"{who}: seccompProfile is not RuntimeDefault")
    return out


def scratch_problems(docs: list[Doc]) -> list[str]:
    out = []
    for role, pod in _pods(one(docs, "RayJob")):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for name, v in volumes.items():
            if "emptyDir" in v and "sizeLimit" not in (v["emptyDir"] or {}):
                out.append(f"{role}: emptyDir {name} has no sizeLimit")
        for c in pod["containers"]:
            who, mounts, env = f"{role}/{c['name']}", c.get("volumeMounts", []), _env(c)
            writable = [m for m in mounts if not m.get("readOnly") and "emptyDir" in volumes.get(m["name"], {})]
            for m in mounts:
                kind = volumes.get(m["name"], {})
                if ("configMap" in kind or "secret" in kind) and not m.get("readOnly"):
                    out.append(f"{who}: {m['mountPath']} ({m['name']}) is mounted writable")
            needed = ["/tmp"] + (["/tmp/ray"] if role != "submitter" else [])
            out += [
                f"{who}: {p} is not a writable emptyDir"
                for p in needed
                if (m := _mount_of(p, writable)) is None or m["mountPath"] != p
            ]
            required = [
                *(RAY_SCRATCH_ENV if role != "submitter" else ()),
                *(["SYNCPOINT_STAGING_DIR"] if role.startswith("workers") else []),
            ]
            out += [
                f"{who}: {var} is not set (its default lies on the read-only root)"
                for var in required
                if var not in env
            ]
            for var in SCRATCH_ENV:
                if var not in env:
                    continue
                path = env[var].get("value", "")
                m = _mount_of(path, writable)
                if not path.startswith("/") or m is None:
                    out.append(f"{who}: {var}={path!r} is not inside a writable volume")
                elif (
                    var == "SYNCPOINT_STAGING_DIR" and (volumes[m["name"]]["emptyDir"] or {}).get("medium") == "Memory"
                ):
                    out.append(f"{who}: staging in a memory-backed volume counts against the memory limit")
    return out


def _state_bytes(docs: list[Doc]) -> int:
    """An upper bound on one state of the ConfigMap's job: its model built on the meta device."""
    task = yaml.safe_load(one(docs, "ConfigMap")["data"]["job.yaml"])["task"]
    return _model_params(task["path"], json.dumps(task.get("config") or {}, sort_keys=True)) * BYTES_PER_PARAM


@functools.lru_cache(maxsize=8)
def _model_params(path: str, config: str) -> int:
    import torch

    from syncpoint.workers.task import load_task

    with torch.device("meta"):  # shapes only, no memory, whatever the model's size
        task = load_task(path, json.loads(config))
    return sum(p.numel() for p in task.model.parameters())


def ephemeral_storage_problems(docs: list[Doc]) -> list[str]:
    out, state = [], _state_bytes(docs)
    for role, pod in _pods(one(docs, "RayJob")):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        disk = sum(
            _bytes((v["emptyDir"] or {}).get("sizeLimit", 0))
            for v in volumes.values()
            if "emptyDir" in v and (v["emptyDir"] or {}).get("medium") != "Memory"
        )
        for c in pod["containers"]:
            who, res = f"{role}/{c['name']}", c.get("resources", {})
            req, lim = res.get("requests", {}).get("ephemeral-storage"), res.get("limits", {}).get("ephemeral-storage")
            if req is None or lim is None:
                out.append(f"{who}: no ephemeral-storage request and limit")
                continue
            if _bytes(req) > _bytes(lim):
                out.append(f"{who}: ephemeral-storage request {req} above its limit {lim}")
            if _bytes(lim) < disk + HEADROOM:
                out.append(f"{who}: ephemeral-storage limit {lim} below its emptyDirs ({disk} B) + logs: evicted")
            if role.startswith("workers"):
                # every rank fetches a whole state into /tmp before loading, and rank 0 exports the final one
                mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in c.get("volumeMounts", [])}
                tmp = _bytes((mounts.get("/tmp", {}).get("emptyDir") or {}).get("sizeLimit", 0))
                staging = _mount_of(
                    _env(c).get("SYNCPOINT_STAGING_DIR", {}).get("value", "/"), c.get("volumeMounts", [])
                )
                staged = (
                    _bytes((volumes.get(staging["name"], {}).get("emptyDir") or {}).get("sizeLimit", 0))
                    if staging
                    else 0
                )
                if tmp < 2 * state + GiB:
                    out.append(
                        f"{who}: /tmp ({tmp} B) cannot hold a fetched state and the export (2 x {state} B + 1 GiB)"
                    )
                if staged < state:
                    out.append(f"{who}: staging ({staged} B) smaller than one state ({state} B)")
    return out


def image_problems(docs: list[Doc]) -> list[str]:
    return [
        f"{role}/{c['name']}: image {c['image']!r} is not referenced by digest (name@sha256:...)"
        for role, pod in _pods(one(docs, "RayJob"))
        for c in pod["containers"] + pod.get("initContainers", [])
        if not IMAGE_BY_DIGEST.match(c["image"])
    ]


def signing_problems(docs: list[Doc]) -> list[str]:
    out = []
    for role, pod in _pods(one(docs, "RayJob")):
        if role == "submitter":
            continue
        for c in pod["containers"]:
            e = _env(c).get(SIGNING_ENV, {})
            ref = e.get("valueFrom", {}).get("secretKeyRef", {})
            if "value" in e or (ref.get("name"), ref.get("key")) != (SIGNING_SECRET, SIGNING_KEY):
                out.append(
                    f"{role}/{c['name']}: {SIGNING_ENV} must come from Secret {SIGNING_SECRET} key {SIGNING_KEY}"
                )
            elif ref.get("optional") is not True:
                out.append(f"{role}/{c['name']}: {SIGNING_ENV} must be optional (signing is opt-in)")
    raw = yaml.safe_load(one(docs, "ConfigMap")["data"]["job.yaml"])
    named = (raw.get("checkpoint") or {}).get("signing_key_env")
    if named not in (None, SIGNING_ENV):
        out.append(f"job spec signs with ${named}, which no container receives (the Secret gives ${SIGNING_ENV})")
    return out


HARDENING: list[Callable[[list[Doc]], list[str]]] = [
    token_auth_problems,
    network_problems,
    identity_problems,
    security_context_problems,
    scratch_problems,
    ephemeral_storage_problems,
    image_problems,
    signing_problems,
]


def hardening_problems(docs: list[Doc]) -> list[str]:
    return [p for rule in HARDENING for p in rule(docs)]


def test_every_flavour_is_hardened(overlay: tuple[str, list[Doc]]) -> None:
    name, docs = overlay
    assert hardening_problems(docs) == [], name


def _c(pod: Doc) -> Doc:
    return pod["containers"][0]


def _w(docs: list[Doc]) -> Doc:
    return _workers(one(docs, "RayJob"))[0]["template"]["spec"]


def _h(docs: list[Doc]) -> Doc:
    return _head(one(docs, "RayJob"))


def _s(docs: list[Doc]) -> Doc:
    return one(docs, "RayJob")["spec"]["submitterPodTemplate"]["spec"]


def _rcs(docs: list[Doc]) -> Doc:
    return one(docs, "RayJob")["spec"]["rayClusterSpec"]


def _set_env(c: Doc, name: str, entry: Doc | None) -> None:
    c["env"] = [e for e in c.get("env", []) if e["name"] != name] + ([{"name": name, **entry}] if entry else [])


def _spec_edit(docs: list[Doc], edit: Callable[[Doc], None]) -> None:
    cm = one(docs, "ConfigMap")
    raw = yaml.safe_load(cm["data"]["job.yaml"])
    edit(raw)
    cm["data"]["job.yaml"] = yaml.safe_dump(raw)


def _drop(docs: list[Doc], kind: str) -> None:
    docs[:] = [d for d in docs if d["kind"] != kind]


BROKEN_HARDENING: dict[str, Callable[[list[Doc]], None]] = {
    "token auth off": lambda d: _rcs(d).pop("authOptions"),
    "auth mode disabled": lambda d: _rcs(d)["authOptions"].update(mode="disabled"),
    "token Secret generated per cluster": lambda d: _rcs(d)["authOptions"].pop("secretName"),
    "ray too old for token auth": lambda d: _rcs(d).update(rayVersion="2.51.0"),
    "submitter sends no token": lambda d: _c(_s(d)).pop("env"),
    "submitter token from another Secret": lambda d: _set_env(
        _c(_s(d)), "RAY_AUTH_TOKEN", {"valueFrom": {"secretKeyRef": {"name": "other", "key": TOKEN_KEY}}}
    ),
    "token inline": lambda d: _set_env(_c(_s(d)), "RAY_AUTH_TOKEN", {"value": "0123456789abcdef"}),
    "worker turns auth off": lambda d: _set_env(_c(_w(d)), "RAY_AUTH_MODE", {"value": "disabled"}),
    "no network policy": lambda d: _rcs(d).pop("networkPolicy"),
    "ingress left open": lambda d: _rcs(d)["networkPolicy"].update(mode="DenyAllEgress"),
    "egress rules under DenyAllIngress": lambda d: _rcs(d)["networkPolicy"].update(
        head={"egressRules": [{"ports": [{"port": 443}]}]}
    ),
    "dashboard open to every source": lambda d: _rcs(d)["networkPolicy"].update(
        head={"ingressRules": [{"ports": [{"port": 8265, "protocol": "TCP"}]}]}
    ),
    "no deny-ingress before KubeRay's policies": lambda d: _drop(d, "NetworkPolicy"),
    "submitter not selected by the deny-ingress": lambda d: one(d, "RayJob")["spec"]["submitterPodTemplate"].pop(
        "metadata"
    ),
    "default ServiceAccount": lambda d: _h(d).pop("serviceAccountName"),
    "ServiceAccount not rendered": lambda d: _drop(d, "ServiceAccount"),
    "API token mounted in workers": lambda d: _w(d).update(automountServiceAccountToken=True),
    "ServiceAccount automounts its token": lambda d: one(d, "ServiceAccount").pop("automountServiceAccountToken"),
    "worker runs as root": lambda d: _c(_w(d))["securityContext"].update(runAsUser=0),
    "pod may run as root": lambda d: _s(d)["securityContext"].pop("runAsNonRoot"),
    "privilege escalation": lambda d: _c(_h(d))["securityContext"].update(allowPrivilegeEscalation=True),
    "privileged": lambda d: _c(_w(d))["securityContext"].update(privileged=True),
    "capability added": lambda d: _c(_w(d))["securityContext"]["capabilities"].update(add=["NET_ADMIN"]),
    "capabilities kept": lambda d: _c(_s(d))["securityContext"].update(capabilities={"drop": ["NET_RAW"]}),
    "writable root filesystem": lambda d: _c(_h(d))["securityContext"].update(readOnlyRootFilesystem=False),
    "no seccomp profile": lambda d: [
        _c(_w(d))["securityContext"].pop("seccompProfile"),
        _w(d)["securityContext"].pop("seccompProfile"),
    ],
    "unconfined seccomp": lambda d: _c(_h(d))["securityContext"].update(seccompProfile={"type": "Unconfined"}),
    "hostPath volume": lambda d: _w(d)["volumes"].append({"name": "host", "hostPath": {"path": "/var"}}),
    "host network": lambda d: _w(d).update(hostNetwork=True),
    "no writable /tmp": lambda d: _c(_w(d)).update(
        volumeMounts=[m for m in _c(_w(d))["volumeMounts"] if m["mountPath"] != "/tmp"]
    ),
    "no writable /tmp/ray": lambda d: _c(_h(d)).update(
        volumeMounts=[m for m in _c(_h(d))["volumeMounts"] if m["mountPath"] != "/tmp/ray"]
    ),
    "job spec mounted writable": lambda d: _c(_h(d))["volumeMounts"][0].pop("readOnly"),
    "staging unset": lambda d: _set_env(_c(_w(d)), "SYNCPOINT_STAGING_DIR", None),
    "staging on the read-only root": lambda d: _set_env(
        _c(_w(d)), "SYNCPOINT_STAGING_DIR", {"value": "/home/ray/staging"}
    ),
    "staging in memory": lambda d: next(v for v in _w(d)["volumes"] if v["name"] == "staging")["emptyDir"].update(
        medium="Memory"
    ),
    "torch extensions on the read-only root": lambda d: _set_env(_c(_w(d)), "TORCH_EXTENSIONS_DIR", None),
    "cache dir relative": lambda d: _set_env(_c(_h(d)), "XDG_CACHE_HOME", {"value": "tmp/.cache"}),
    "emptyDir without sizeLimit": lambda d: next(v for v in _h(d)["volumes"] if v["name"] == "tmp").update(emptyDir={}),
    "no ephemeral-storage limit": lambda d: _c(_w(d))["resources"]["limits"].pop("ephemeral-storage"),
    "ephemeral-storage request above limit": lambda d: _c(_s(d))["resources"]["requests"].update(
        {"ephemeral-storage": "2Gi"}
    ),
    "ephemeral-storage limit below the emptyDirs": lambda d: _c(_w(d))["resources"]["limits"].update(
        {"ephemeral-storage": "6Gi"}
    ),
    "/tmp too small for a fetched state": lambda d: _spec_edit(
        d, lambda s: s["task"]["config"].update(d_model=2048, n_layers=4)
    ),
    "image by tag": lambda d: _c(_w(d)).update(image="ghcr.io/acme/syncpoint:0.1.0"),
    "image by tag and digest's prefix": lambda d: _c(_s(d)).update(image="ghcr.io/acme/syncpoint@sha256:abc"),
    "signing key inline": lambda d: _set_env(_c(_w(d)), SIGNING_ENV, {"value": "k"}),
    "signing key from another Secret": lambda d: _set_env(
        _c(_h(d)), SIGNING_ENV, {"valueFrom": {"secretKeyRef": {"name": "x", "key": SIGNING_KEY, "optional": True}}}
    ),
    "signing key Secret required": lambda d: _set_env(
        _c(_w(d)), SIGNING_ENV, {"valueFrom": {"secretKeyRef": {"name": SIGNING_SECRET, "key": SIGNING_KEY}}}
    ),
    "spec signs with a variable no pod gets": lambda d: _spec_edit(
        d, lambda s: s.setdefault("checkpoint", {}).update(signing_key_env="OTHER_KEY")
    ),
}


# what each breakage must be reported as: the rule meant to catch it did, not some other rule
REPORTED_AS = {
    "/tmp too small for a fetched state": "cannot hold a fetched state",
    "API token mounted in workers": "API token is mounted",
    "ServiceAccount automounts its token": "automountServiceAccountToken is not false",
    "ServiceAccount not rendered": "is not part of the flavour",
    "auth mode disabled": "authOptions.mode is not token",
    "cache dir relative": "XDG_CACHE_HOME='tmp/.cache' is not inside a writable volume",
    "capabilities kept": "capabilities not all dropped",
    "capability added": "capabilities not all dropped",
    "dashboard open to every source": "admits every source",
    "default ServiceAccount": "default ServiceAccount",
    "egress rules under DenyAllIngress": "egressRules under DenyAllIngress",
    "emptyDir without sizeLimit": "has no sizeLimit",
    "ephemeral-storage limit below the emptyDirs": "below its emptyDirs",
    "ephemeral-storage request above limit": "above its limit",
    "host network": "hostNetwork",
    "hostPath volume": "hostPath volume",
    "image by tag": "not referenced by digest",
    "image by tag and digest's prefix": "not referenced by digest",
    "ingress left open": "leaves ingress open",
    "job spec mounted writable": "is mounted writable",
    "no deny-ingress before KubeRay's policies": "no deny-ingress NetworkPolicy selects",
    "no ephemeral-storage limit": "no ephemeral-storage request and limit",
    "no network policy": "no spec.rayClusterSpec.networkPolicy",
    "no seccomp profile": "seccompProfile",
    "no writable /tmp": "/tmp is not a writable emptyDir",
    "no writable /tmp/ray": "/tmp/ray is not a writable emptyDir",
    "pod may run as root": "runAsNonRoot",
    "privilege escalation": "privilege escalation not disabled",
    "privileged": "privilege escalation not disabled",
    "ray too old for token auth": "predates Ray token authentication",
    "signing key Secret required": "must be optional",
    "signing key from another Secret": f"must come from Secret {SIGNING_SECRET}",
    "signing key inline": f"must come from Secret {SIGNING_SECRET}",
    "spec signs with a variable no pod gets": "which no container receives",
    "staging in memory": "memory-backed",
    "staging on the read-only root": "SYNCPOINT_STAGING_DIR='/home/ray/staging' is not inside a writable volume",
    "staging unset": "SYNCPOINT_STAGING_DIR is not set",
    "submitter not selected by the deny-ingress": "submitter: no deny-ingress NetworkPolicy",
    "submitter sends no token": "submitter: RAY_AUTH_MODE is not token",
    "submitter token from another Secret": f"submitter: RAY_AUTH_TOKEN must come from Secret {TOKEN_SECRET}",
    "token Secret generated per cluster": "authOptions.secretName is None",
    "token auth off": "authOptions.mode is not token",
    "token inline": f"submitter: RAY_AUTH_TOKEN must come from Secret {TOKEN_SECRET}",
    "torch extensions on the read-only root": "TORCH_EXTENSIONS_DIR is not set",
    "unconfined seccomp": "seccompProfile is not RuntimeDefault",
    "worker runs as root": "must run as non-root uid",
    "worker turns auth off": "turns auth off",
    "writable root filesystem": "root filesystem is writable",
}


@pytest.fixture(scope="module")
def base_docs() -> list[Doc]:
    return render(K8S / "base")


@pytest.mark.parametrize("breakage", sorted(BROKEN_HARDENING))
def test_hardening_rules_reject(base_docs: list[Doc], breakage: str) -> None:
    docs = copy.deepcopy(base_docs)
    assert hardening_problems(docs) == []
    BROKEN_HARDENING[breakage](docs)
    problems = hardening_problems(docs)
    assert any(REPORTED_AS[breakage] in p for p in problems), f"{breakage}: reported as {problems}"


def test_image_runs_as_the_uid_the_pods_require() -> None:
    """runAsNonRoot is only verifiable with a numeric user: the image's USER is uid 1000, not root."""
    users = re.findall(r"^USER\s+(\S+)", (K8S / "Dockerfile").read_text(), re.M)
    assert users, "k8s/Dockerfile sets no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) == RAY_UID, users[-1]
    assert re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)-py311", (K8S / "Dockerfile").read_text(), re.M)


def test_rendered_objects_are_the_expected_set(overlay: tuple[str, list[Doc]]) -> None:
    """A flavour deploys the job, its spec, its identity and its deny-ingress policy - and no Secret."""
    name, docs = overlay
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "syncpoint-job"),
        ("NetworkPolicy", "syncpoint-deny-ingress"),
        ("RayJob", "syncpoint-tiny-lm"),
        ("ServiceAccount", "syncpoint"),
    ], name
