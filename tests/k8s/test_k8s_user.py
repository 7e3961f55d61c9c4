"""``syncpoint k8s`` on a user's own job: from a task module and a job file to the RayJob that runs it.

A job of the user's (``mytask.py`` and ``job.yaml`` in a directory of its own: ``my-classifier``, 3
workers of 2 CPUs, an s3:// storage) is rendered through the CLI for the base and for every overlay,
by the real ``kubectl kustomize`` (what ``kubectl apply -k`` runs). Every rendered RayJob is
validated against the carried KubeRay CRD schemas and held to the same hardening rules as the
repository's own flavours (``tests/k8s/test_k8s.py``'s helpers); the job's name, spec, workers and code
must be the user's, not the example's. Both ways in for the code are checked offline: the image
recipe's layout resolves ``task.path`` the way the image will, and a zip made as the docs say
resolves it after Ray's own unpacking of a remote working_dir.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from syncpoint.orchestrator import k8s_render
from syncpoint.orchestrator.cli import main
from syncpoint.orchestrator.cli_jobs import import_problems
from syncpoint.orchestrator.spec_file import load_spec, parse_spec
from tests.k8s.test_k8s import (
    ENTRYPOINT_SPEC,
    K8S,
    OVERLAYS,
    SPOT,
    Doc,
    _cpus,
    _head,
    _workers,
    crd_schema,
    hardening_problems,
    one,
    schema_errors,
    strict,
)

ROOT = K8S.parent
JOB_NAME = "my-classifier"
RAYJOB = "syncpoint-my-classifier"
CONFIGMAP = "syncpoint-my-classifier-job"
CODE_URL = "s3://acme-ml/code/my-classifier.zip"
IMAGE = "ghcr.io/acme/my-classifier@sha256:" + "ab" * 32
SETS = ["--set", "train.epochs=3"]  # an override, to check the ConfigMap carries the spec after it

MYTASK = """\
# torch is imported where it is used: every render checks task.path by importing this module in a fresh
# interpreter, and these tests render it fifteen times (a user's own module may import it at the top)


class Points:
    def __init__(self, n):
        import torch

        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def loss(model, batch):
    import torch

    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def build(config):
    import torch

    from syncpoint.workers.task import Task

    return Task(model=torch.nn.Linear(4, 2), dataset=Points(int(config.get("num_samples", 64))), loss=loss)
"""

JOB = f"""\
name: {JOB_NAME}
storage: s3://acme-ml/runs
scaling:
  num_workers: 3
  cpus_per_worker: 2
task:
  path: mytask:build
  config: {{num_samples: 96}}
train:
  micro_batch_size: 4
  epochs: 2
  lr: 1.0e-2
checkpoint:
  save_every: {{value: 4, unit: optimizer_steps}}
"""


@pytest.fixture(scope="module")
def kubectl() -> str:
    """The real kubectl (Debian's kubernetes-client), with kustomize v5: never a stand-in."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed (apt-get install kubernetes-client)")
    out = subprocess.run([path, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    assert re.search(r"Kustomize Version: v5\.", out), out
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The user's project: a task module and a job file, nothing of syncpoint's; importable while tested
    (the hardening rules size the scratch space from the task's model)."""
    d = tmp_path_factory.mktemp("my-classifier")
    (d / "mytask.py").write_text(MYTASK)
    (d / "job.yaml").write_text(JOB)
    sys.path.insert(0, str(d))
    try:
        yield d
    finally:
        sys.path.remove(str(d))
        sys.modules.pop("mytask", None)


def k8s(project: Path, *args: str) -> tuple[int, str, str]:
    """``syncpoint k8s job.yaml ARGS`` through the CLI's main, in the project's directory (as a user runs it)."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(project)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["k8s", "job.yaml", *args])
    finally:
        os.chdir(cwd)
    return rc, out.getvalue(), err.getvalue()


def docs_of(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


FLAVOURS = [None, *OVERLAYS]


def _flavour_args(flavour: str | None) -> list[str]:
    if flavour is None:
        return []
    return ["--overlay", flavour] + (["--set", "scaling.use_gpu=true"] if flavour == "gpu" else [])


@pytest.fixture(scope="module")
def rendered(project: Path, kubectl: str) -> dict[str | None, tuple[list[str], list[Doc]]]:
    out = {}
    for flavour in FLAVOURS:
        args = [*SETS, *_flavour_args(flavour), "--image", IMAGE, "--code-from", CODE_URL]
        rc, stdout, stderr = k8s(project, *args)
        assert rc == 0, stderr
        out[flavour] = (args, docs_of(stdout))
    return out


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(copy.deepcopy(crd_schema("rayjobs"))))


@pytest.fixture(scope="module")
def cluster_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(copy.deepcopy(crd_schema("rayclusters"))["properties"]["spec"]))


@pytest.mark.parametrize("flavour", FLAVOURS, ids=lambda f: f or "base")
def test_the_rendered_rayjob_is_the_users_job(
    project: Path, rendered: dict, validator: Any, cluster_validator: Any, flavour: str | None
) -> None:
    args, docs = rendered[flavour]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", CONFIGMAP),
        ("NetworkPolicy", "syncpoint-deny-ingress"),
        ("RayJob", RAYJOB),
        ("ServiceAccount", "syncpoint"),
    ]
    job, cm = one(docs, "RayJob"), one(docs, "ConfigMap")
    # valid as kubectl --validate=strict would see it, and as hardened as the repository's flavours
    assert schema_errors(validator, job) == []
    assert schema_errors(cluster_validator, job["spec"]["rayClusterSpec"]) == []
    assert hardening_problems(docs) == []
    # the job's spec, after the same overrides, is what the entrypoint reads
    sets = [a for prev, a in zip(args, args[1:], strict=False) if prev == "--set"]
    expected = load_spec(project / "job.yaml", sets)
    carried = parse_spec(cm["data"]["job.yaml"], "ConfigMap")
    assert carried == expected and carried.name == JOB_NAME and carried.train.epochs == 3
    assert job["spec"]["entrypoint"].split() == ["syncpoint", "run", ENTRYPOINT_SPEC]
    volumes = {v["name"]: v for v in _head(job)["volumes"]}
    assert volumes["job-spec"]["configMap"]["name"] == CONFIGMAP
    # the workers are the job's scaling: one Ray Train worker per pod
    (group,) = _workers(job)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 3
    res = group["template"]["spec"]["containers"][0]["resources"]
    assert _cpus(res["requests"]["cpu"]) == _cpus(res["limits"]["cpu"]) == 2
    assert int(res["limits"].get("nvidia.com/gpu", 0)) == (1 if expected.scaling.use_gpu else 0)
    assert expected.scaling.use_gpu == (flavour == "gpu")
    # the code from the bucket, the image by its digest in every pod, the flavour's placement kept
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"]) == {"working_dir": CODE_URL}
    images = set(re.findall(r"'image': '([^']+)'", str(job)))
    assert images == {IMAGE}
    if flavour in SPOT:
        key, value = SPOT[flavour]
        assert group["template"]["spec"]["nodeSelector"][key] == value
    assert "tiny" not in str(docs), "the example's job leaked into the user's manifests"


def test_gpu_workers_on_a_spot_flavour(project: Path, kubectl: str, validator: Any) -> None:
    """scaling.use_gpu on a spot overlay stacks the gpu component; the ConfigMap stays the user's spec."""
    rc, out, err = k8s(project, "--overlay", "gke-spot", "--set", "scaling.use_gpu=true", "--image-has-code")
    assert rc == 0, err
    docs = docs_of(out)
    job = one(docs, "RayJob")
    pod = _workers(job)[0]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    assert {t["key"] for t in pod["tolerations"]} == {"cloud.google.com/gke-spot", "nvidia.com/gpu"}
    spec = parse_spec(one(docs, "ConfigMap")["data"]["job.yaml"])
    assert spec == load_spec(project / "job.yaml", ["scaling.use_gpu=true"])
    assert "runtimeEnvYAML" not in job["spec"], "--image-has-code: nothing to fetch"
    assert schema_errors(validator, job) == []
    assert "placeholder" in err and "--image" in err, "an unpullable image is said, not silent"


@pytest.mark.parametrize("flavour", [None, "gpu"], ids=lambda f: f or "base")
def test_the_jobs_env_is_in_the_head_and_every_worker(project: Path, kubectl: str, validator: Any, flavour) -> None:
    """scaling.env reaches the driver's pod and every worker's, a variable the base sets replaced (one
    entry, the job's value); the manifests stay valid and hardened."""
    env = "scaling.env={DATA_DIR: /data/owt, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: '90'}"
    rc, out, err = k8s(project, "--set", env, *_flavour_args(flavour), "--image-has-code")
    assert rc == 0, err
    docs = docs_of(out)
    job = one(docs, "RayJob")
    assert schema_errors(validator, job) == [] and hardening_problems(docs) == []
    head = _head(job)["containers"][0]["env"]
    worker = _workers(job)[0]["template"]["spec"]["containers"][0]["env"]
    for pod in (head, worker):
        assert [e for e in pod if e["name"] == "DATA_DIR"] == [{"name": "DATA_DIR", "value": "/data/owt"}]
    drain = [e for e in worker if e["name"] == "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]
    assert drain == [{"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": "90"}]
    assert {e["name"] for e in head} > {"DATA_DIR", "SYNCPOINT_SIGNING_KEY"}  # the base's entries kept


def test_the_overlay_directory_renders_the_same(project: Path, kubectl: str, tmp_path: Path) -> None:
    """-o DIR writes the kustomization (and a copy of k8s/) that `kubectl apply -k DIR` applies."""
    args = ["--overlay", "eks-spot", "--image", IMAGE, "--code-from", CODE_URL]
    rc, printed, err = k8s(project, *args)
    assert rc == 0, err
    out = tmp_path / "deploy"
    for _ in range(2):  # a directory it wrote before is rewritten
        rc, stdout, err = k8s(project, *args, "-o", str(out))
        assert rc == 0 and stdout == "" and f"kubectl apply -k {out}" in err, err
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kust["resources"] == ["syncpoint-k8s/overlays/eks-spot"]
    assert (out / "syncpoint-k8s" / "base" / "rayjob.yaml").read_bytes() == (K8S / "base" / "rayjob.yaml").read_bytes()
    built = subprocess.run([kubectl, "kustomize", str(out)], capture_output=True, text=True, timeout=120, check=True)
    assert docs_of(built.stdout) == docs_of(printed)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    rc, _, err = k8s(project, *args, "-o", str(tmp_path / "mine"))
    assert rc == 2 and "did not write" in err and (tmp_path / "mine" / "notes.txt").exists()


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "syncpoint", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_bad_job_file_is_the_validate_error(project: Path, tmp_path: Path) -> None:
    """The same loader as `syncpoint validate`: the same one paragraph, exit 2, through `python -m syncpoint`."""
    (tmp_path / "mytask.py").write_text(MYTASK)
    (tmp_path / "job.yaml").write_text(JOB.replace("num_workers: 3", "num_workers: 3\n  cpu_per_worker: 2"))
    k, v = _cli(tmp_path, "k8s", "job.yaml", "--image-has-code"), _cli(tmp_path, "validate", "job.yaml")
    assert k.returncode == v.returncode == 2 and k.stdout == ""
    assert k.stderr == v.stderr and k.stderr.startswith("syncpoint: job.yaml: invalid job spec")
    assert "scaling.cpu_per_worker" in k.stderr and "Traceback" not in k.stderr
    assert "\n\n" not in k.stderr.strip(), "one paragraph"


REFUSED = {
    "local storage": (["--set", "storage=/data/runs", "--image-has-code"], "storage 'file:///data/runs' is local"),
    "signing key under another name": (
        ["--set", "checkpoint.signing_key_env=MY_KEY", "--set", "checkpoint.checksum=sha256", "--image-has-code"],
        "set checkpoint.signing_key_env: SYNCPOINT_SIGNING_KEY",
    ),
    "gpu flavour for a CPU job": (["--overlay", "gpu", "--image-has-code"], "scaling.use_gpu is false"),
    "image by tag": (["--image", "ghcr.io/acme/my-classifier:1", "--image-has-code"], "give the image by digest"),
    "image by tag and digest": (
        ["--image", "ghcr.io/acme/x:1@sha256:" + "0" * 64, "--image-has-code"],
        "without a tag",
    ),
    "no way in for the code": ([], "say how your task's code reaches the pods"),
    "code not a zip": (["--code-from", "s3://acme-ml/code/"], "does not name a .zip file"),
    "code from a presigned URL": (["--code-from", "https://x.example/c.zip?X-Amz-Signature=abc"], "in the clear"),
    "code from a local file": (["--code-from", "/tmp/code.zip"], "is not a s3://, gs://, https:// URL"),
    "task not importable": (["--set", "task.path=mytask:buidl", "--image-has-code"], "task.path"),
    "a credential in scaling.env": (
        ["--set", "scaling.env={DATA_DIR: /d, WANDB_API_KEY: k-3f9a}", "--image-has-code"],
        "scaling.env WANDB_API_KEY: the name says it holds a credential",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_with_one_paragraph(project: Path, case: str) -> None:
    args, needle = REFUSED[case]
    rc, out, err = k8s(project, *args)
    assert rc == 2 and out == "", err
    assert needle in err and err.startswith("syncpoint: ") and "Traceback" not in err, err


def test_without_kubectl_it_says_how_to_go_on(project: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    rc, out, err = k8s(project, "--image-has-code")
    assert rc == 2 and out == "" and "kubectl is not on PATH" in err and "-o DIR" in err


def test_rayjob_names_are_dns_labels_kuberay_accepts() -> None:
    label = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # DNS-1035, as KubeRay validates a RayJob's name
    assert k8s_render.rayjob_name("my-classifier") == "syncpoint-my-classifier"
    names = ["My_Classifier", "my.classifier", "my--classifier", "9lives", "x" * 200, "A" * 60 + "b", "A" * 60 + "c"]
    derived = [k8s_render.rayjob_name(n) for n in names]
    for n, d in zip(names, derived, strict=True):
        assert label.match(d) and len(d) <= k8s_render.MAX_RAYJOB_NAME, (n, d)
    assert derived[0].startswith("syncpoint-my-classifier-") and len(set(derived)) == len(derived)
    assert k8s_render.rayjob_name("My_Classifier") == derived[0], "the same name, the same RayJob, every time"


@pytest.mark.parametrize(("cpus", "quantity"), [(2, "2"), (2.0, "2"), (1.5, "1500m"), (0.3, "300m"), (0.0001, "1m")])
def test_cpu_quantity_rounds_up_to_millicores(cpus: float, quantity: str) -> None:
    assert k8s_render.cpu_quantity(cpus) == quantity


def test_code_from_a_bucket_resolves_the_task_after_rays_unpacking(project: Path, tmp_path: Path) -> None:
    """The zip the docs say to make (the project's contents at its root), unpacked by Ray's own code for a
    remote working_dir (which unwraps a lone top-level directory), is a directory where task.path resolves."""
    from ray._private.runtime_env.packaging import unzip_package

    archive = tmp_path / "code.zip"
    with zipfile.ZipFile(archive, "w") as z:  # cd project && zip -r ../code.zip .
        for f in sorted(project.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                z.write(f, f.relative_to(project))
    unpacked = tmp_path / "working_dir"
    unzip_package(str(archive), str(unpacked), remove_top_level_directory=True, unlink_zip=False)
    assert (unpacked / "mytask.py").is_file()
    assert import_problems([("task.path", "mytask:build")], str(unpacked)) == []


def test_the_image_recipe_puts_the_code_where_task_path_resolves(project: Path, tmp_path: Path) -> None:
    """k8s/Dockerfile.user copies the project onto the syncpoint image's PYTHONPATH, as the same non-root
    user; the same layout here resolves task.path from any working directory, as it will in the pods."""
    recipe, base = (K8S / "Dockerfile.user").read_text(), (K8S / "Dockerfile").read_text()
    pythonpath = re.search(r"^ENV PYTHONPATH=(\S+)$", base, re.M)
    assert pythonpath
    assert re.search(r"^ARG SYNCPOINT_IMAGE=\S+@sha256:[0-9a-f]{64}$", recipe, re.M), "the base image by digest"
    assert re.search(r"^FROM \$\{SYNCPOINT_IMAGE\}$", recipe, re.M)
    copied = re.search(r"^COPY --chown=1000:100 \. (\S+)$", recipe, re.M)
    assert copied and copied.group(1).rstrip("/") == pythonpath.group(1)
    assert re.findall(r"^USER\s+(\S+)", recipe, re.M)[-1] == "1000:100"
    assert "smart_open[s3]" in base, "Ray fetches an s3:// working_dir with smart_open and boto3"
    tasks = tmp_path / "home-ray-tasks"  # the image's /home/ray/tasks
    shutil.copytree(project, tasks, ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tasks), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "syncpoint", "validate", str(tasks / "job.yaml")],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
