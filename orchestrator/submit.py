"""``syncpoint submit``: run a job on a remote Ray cluster through the Job Submission API.

Equivalent to ``ray job submit --working-dir . -- syncpoint run JOB.yaml``: the working directory
is shipped as the job's runtime env (``.gitignore`` is honoured, so ``.venv`` and ``runs`` stay
home), the logs are streamed, and the exit code is the job's. The job's driver finds the cluster
through ``RAY_ADDRESS``, which the job supervisor sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

from syncpoint.policies.contracts.errors import SpecError
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.redact import redact_text, redact_url, secret_name, url_secret_paths

if TYPE_CHECKING:  # Ray is imported when a job is submitted, not when the CLI starts
    from ray.job_submission import JobSubmissionClient

TERMINAL = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 1}


def entrypoint(job_file: str, overrides: list[str]) -> str:
    """The Job API entrypoint that runs the job file with its overrides on the cluster, shell-quoted."""
    parts = ["python", "-m", "syncpoint", "run", job_file]
    for o in overrides:
        parts += ["--set", o]
    return " ".join(shlex.quote(p) for p in parts)


# ---------------------------------------------------------------- token authentication (Ray >= 2.52)
# A cluster started with RAY_AUTH_MODE=token (KubeRay: spec.rayClusterSpec.authOptions.mode: token)
# answers every Job API request without `Authorization: Bearer <token>` with 401, a wrong token with
# 403. Ray's own client sends the header only when this process runs in token mode and its C++ loader
# finds a token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), a mode read once when Ray
# is first imported. syncpoint reads the token itself, in that order after an explicit --token-file,
# and hands the header to the client: no process-wide mode, no dependence on import order. The token
# is never printed, logged or put in the job's entrypoint.

TOKEN_SOURCES = "--token-file, RAY_AUTH_TOKEN, the file named by RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token"


def read_token(token_file: str | None = None) -> str | None:
    """The cluster's auth token from the first configured source, or None when none is configured."""
    if token_file:
        return _token_in(token_file, "--token-file")
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip()
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return _token_in(os.environ["RAY_AUTH_TOKEN_PATH"], "RAY_AUTH_TOKEN_PATH")
    default = os.path.expanduser("~/.ray/auth_token")
    return _token_in(default, default) if os.path.exists(default) else None


def _token_in(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(64 << 10).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(
            what, [f"cannot read the Ray auth token file {path}: {type(e).__name__}"], "no Ray auth token"
        ) from None
    if not token or any(c.isspace() for c in token):
        raise SpecError(
            what,
            [
                f"the Ray auth token file {path} is empty or is not a single token "
                "(it must hold the cluster's token on one line)"
            ],
            "no Ray auth token",
        )
    return token


def auth_headers(address: str, token_file: str | None = None) -> dict[str, str]:
    """HTTP headers for the Job API: ``Authorization: Bearer <token>`` when a token is configured."""
    token = read_token(token_file)
    if token is None:
        return {}
    if address.startswith("http://") and not _is_local(address):
        print(
            "syncpoint: sending the Ray auth token over plain http to a remote address; reach the dashboard "
            "through a tunnel (kubectl port-forward, ssh -L) or https",
            file=sys.stderr,
        )
    return {"Authorization": f"Bearer {token}"}


def _is_local(address: str) -> bool:
    from urllib.parse import urlsplit

    host = urlsplit(address).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _connect(
    client_cls: Callable[..., JobSubmissionClient], address: str, headers: dict[str, str]
) -> JobSubmissionClient:
    """The Job API client; a refused or missing token is one paragraph (exit 2), never a traceback."""
    from ray.exceptions import AuthenticationError

    try:
        return client_cls(address, headers=headers or None)
    except AuthenticationError as e:
        sent = "the configured token was rejected" if headers else "no token was sent"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(
            address,
            [
                f"the Ray cluster requires token authentication and {sent} ({first}); "
                f"give the cluster's token via {TOKEN_SOURCES}"
            ],
            "Ray Job API refused the request",
        ) from None


def refuse_url_credentials(spec: JobSpec) -> None:
    """Refuse a spec whose URLs carry credentials (``s3://KEY:SECRET@bucket``, ``https://u:p@host``).

    Why refuse rather than ship them some other way: everything a submission carries — the
    entrypoint, the runtime_env (env_vars included) and the shipped job file — is stored by the
    cluster and shown to anyone who can read the Ray Job API or dashboard. Credentials belong in the
    workers' environment, where the storage backends read them.
    """
    secret_env = [name for name in spec.scaling.env if secret_name(name)]
    if secret_env:
        raise SpecError(
            "submit",
            [
                f"scaling.env {', '.join(secret_env[:5])}: the name says it holds a credential (a key, token, "
                "secret, password). A submitted job's job file and its workers' runtime_env are readable through "
                "the Ray Job API and dashboard, so syncpoint does not send it: remove it from scaling.env and set it "
                "in the environment of the cluster's nodes (on Kubernetes, from a Secret)"
            ],
            "credentials in the job spec",
        )
    fields = url_secret_paths(spec.model_dump(mode="json"))
    if fields:
        raise SpecError(
            "submit",
            [
                f"{', '.join(fields[:5])}: the URL carries credentials (user:password@ or a token parameter). A "
                "submitted "
                "job's entrypoint, runtime_env and job file are readable through the Ray Job API, so syncpoint does "
                "not "
                "send them. Remove them from the URL and give them to the cluster's pods as environment variables the "
                "storage backend reads (s3fs: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or FSSPEC_S3_KEY and "
                "FSSPEC_S3_SECRET; gcsfs: GOOGLE_APPLICATION_CREDENTIALS), e.g. from a Kubernetes Secret"
            ],
            "credentials in the job spec",
        )


def submit(
    spec: JobSpec,
    job_file: str,
    overrides: list[str],
    address: str,
    working_dir: str = ".",
    follow: bool = True,
    token_file: str | None = None,
) -> int:
    """Submit the job through Ray's Job API, check it started, and follow it (or return, with ``--no-wait``)."""
    refuse_url_credentials(spec)
    # the token is read before anything else and only ever travels in the Authorization header
    headers = auth_headers(address, token_file)
    from ray.job_submission import JobSubmissionClient

    wd = os.path.abspath(working_dir)
    rel = os.path.relpath(os.path.abspath(job_file), wd)
    if rel.startswith(".."):
        raise SpecError(
            job_file,
            [
                f"the job file must live inside the working directory {wd} (it is shipped "
                "with it); move it there or pass --working-dir"
            ],
        )
    if spec.storage.startswith("file://"):
        print(
            f"syncpoint: storage {redact_url(spec.storage)} is a local path: "
            "every Ray node (and a re-submitted job) must "
            "see the same path; use s3:// or gs:// for a real cluster",
            file=sys.stderr,
        )
    # storage is resolved here, on the submitting side: the job's driver runs in a temporary copy of
    # the working directory, where a relative path would vanish with the job
    overrides = [*overrides, f"storage={spec.storage}"]
    client = _connect(JobSubmissionClient, address, headers)
    from syncpoint.orchestrator.import_check import import_paths

    # refuses (exit 2) unless the cluster's python runs syncpoint and finds the task's module
    preflight(client, address, {"working_dir": wd}, import_paths(spec), job_file)
    job_id = submit_job(client, address, entrypoint=entrypoint(rel, overrides), runtime_env={"working_dir": wd})
    print(f"syncpoint: submitted {spec.name!r} as Ray job {job_id} to {redact_url(address)}", flush=True)
    if not follow:
        return 0
    asyncio.run(_stream(client, job_id))
    while (status := str(client.get_job_status(job_id)).rsplit(".", 1)[-1]) not in TERMINAL:
        time.sleep(0.5)
    print(f"syncpoint: Ray job {job_id} {status}", flush=True)
    return TERMINAL[status]


# ---------------------------------------------------------------- a head that has just started
# `ray start --head` returns before the head's job agent has registered; until it has, the Job API
# refuses every submission with HTTP 500 "No available agent to submit job, please try again later."
# (Ray raises it as a RuntimeError). `syncpoint submit` right after `ray start` waits for it, bounded.

NO_AGENT = "No available agent to submit job"
AGENT_WAIT_ENV = "SYNCPOINT_JOB_AGENT_WAIT_S"


def job_agent_wait_s() -> float:
    """How long ``submit`` waits for the cluster's job agent to answer."""
    return float(os.environ.get(AGENT_WAIT_ENV, "60"))


def submit_job(client: Any, address: str, *, wait_s: float | None = None, poll_s: float = 1.0, **job: Any) -> str:
    """``client.submit_job(**job)``, again while the cluster answers that it has no job agent yet, for at
    most ``wait_s`` (``SYNCPOINT_JOB_AGENT_WAIT_S``, 60 s), saying once that it waits; then one paragraph
    (exit 2). Any other error is raised as it is."""
    bound = job_agent_wait_s() if wait_s is None else wait_s
    deadline, said = time.monotonic() + bound, False
    while True:
        try:
            return str(client.submit_job(**job))
        except RuntimeError as e:
            if NO_AGENT not in str(e):
                raise
            if time.monotonic() >= deadline:
                raise SpecError(
                    redact_url(address),
                    [
                        f"the cluster's job agent did not come up within {bound:g} s ({AGENT_WAIT_ENV}): its Job API "
                        f"still answers {NO_AGENT!r}, so nothing was submitted. A head started a moment ago needs a "
                        "few "
                        "seconds more; on a loaded head, raise the bound. `ray status` shows whether the head runs, "
                        "and "
                        "the head's dashboard_agent.log why its agent does not"
                    ],
                    "the cluster cannot take jobs yet",
                ) from None
            if not said:
                print(
                    f"syncpoint: {redact_url(address)}: the cluster's job agent is not up yet (a head that has just "
                    f"started); waiting for it, at most {bound:g} s ({AGENT_WAIT_ENV})",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            time.sleep(poll_s)


# ---------------------------------------------------------------- preflight: can the cluster's Python run syncpoint?
# A job's entrypoint runs with the `python` first on the PATH that `ray start` was run with, on the
# head (entrypoints take no CPU, so the supervisor stays there). A head started outside syncpoint's
# environment fails the job minutes later with `No module named 'fsspec'`. Before submitting,
# a probe job (same runtime env, so the working-dir upload is reused) reports which Python that is,
# its syncpoint version, whether syncpoint's modules and dependencies can be imported, and whether
# the spec's import paths (task.path, ...) can be found there, next to the shipped working dir.

PROBE_MARK = "SYNCPOINT-PROBE "
PROBE_MODULES = (
    "ray",
    "torch",
    "deepspeed",
    "fsspec",
    "pydantic",
    "yaml",
    "numpy",
    "safetensors",
    "xxhash",
    "rich",
    "tensorboard",
)
PROBE = """\
import importlib.metadata as m, importlib.util as u, json, os, sys
r = {"python": sys.executable, "version": sys.version.split()[0], "error": None, "imports": []}
path = sys.path[:]
sys.path[:] = [p for p in path if p not in ("", os.getcwd())]  # the installed version, not a shipped egg-info
try:
    r["syncpoint"] = m.version("syncpoint")
except m.PackageNotFoundError:
    r["syncpoint"] = None
sys.path[:] = path
r["missing"] = [n for n in MODULES if u.find_spec(n) is None]
if not r["missing"]:
    try:
        try:
            from syncpoint.orchestrator.cli_jobs import import_problems
        except ImportError:  # a cluster whose syncpoint predates cli_jobs (2026-12-06)
            from syncpoint.orchestrator.cli import import_problems
        r["imports"] = import_problems(PATHS)
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
print(MARK + json.dumps(r))
"""


class ProbeReport(TypedDict):
    """What the probe prints of the cluster's Python (``PROBE``): its path and version, its syncpoint
    (None: not installed), the modules it lacks, why importing syncpoint failed, the spec's import
    paths' problems there."""

    python: str
    version: str
    syncpoint: str | None
    missing: list[str]
    error: str | None
    imports: list[str]


def probe_script(paths: list[tuple[str, str]]) -> str:
    """The probe's Python source; ``paths`` are the spec's (field, import path) pairs (identifiers only,
    checked by the spec), looked up on the cluster by the same code as ``syncpoint validate``."""
    return f"MODULES = {PROBE_MODULES!r}\nPATHS = {[tuple(p) for p in paths]!r}\nMARK = {PROBE_MARK!r}\n" + PROBE


def preflight_timeout_s() -> float:
    """The bound on ``submit``'s preflight probe (the spec's import paths looked up on the cluster)."""
    return float(os.environ.get("SYNCPOINT_PREFLIGHT_TIMEOUT_S", "180"))


def preflight(
    client: JobSubmissionClient,
    address: str,
    runtime_env: dict[str, Any],
    paths: Sequence[tuple[str, str]] = (),
    source: str = "submit",
    timeout_s: float | None = None,
) -> ProbeReport:
    """Run the probe job and wait for it (bounded); refuse (SpecError, exit 2) unless the cluster's
    ``python`` imports syncpoint at this machine's version and finds the modules of ``paths``.
    Returns the probe's report."""
    import importlib.metadata

    from ray.exceptions import AuthenticationError

    try:
        ours: str | None = importlib.metadata.version("syncpoint")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree: any installed version will do
        ours = None
    timeout_s = preflight_timeout_s() if timeout_s is None else timeout_s
    where = redact_url(address)
    install = (
        f"install syncpoint{' ' + ours if ours else ''} into that Python on the head (`PYTHON -m pip install "
        "/path/to/syncpoint`, or use the image built from k8s/Dockerfile), or restart the head from syncpoint's "
        "environment so that its `python` comes first on PATH (`source .venv/bin/activate && ray start --head "
        "...`; `ray start` alone from another shell picks up that shell's `python`)"
    )
    probe_id = submit_job(
        client,
        address,
        entrypoint="python -c " + shlex.quote(probe_script(list(paths))),
        runtime_env=runtime_env,
        metadata={"syncpoint": "preflight"},
    )
    deadline = time.monotonic() + timeout_s
    while (status := str(client.get_job_status(probe_id)).rsplit(".", 1)[-1]) not in TERMINAL:
        if time.monotonic() > deadline:
            # best effort: the refusal below is the answer. Ray raises RuntimeError for an HTTP error status,
            # AuthenticationError for a rejected token, and requests' errors (OSError) for an unreachable cluster
            with contextlib.suppress(RuntimeError, AuthenticationError, OSError):
                client.stop_job(probe_id)
            raise SpecError(
                where,
                [
                    f"the preflight job {probe_id} (which checks that the cluster's Python can import syncpoint) did "
                    "not "
                    f"finish within {timeout_s:g} s (status {status}), so nothing was submitted. Look at "
                    f"`ray job logs {probe_id} --address {where}`: the cluster may have no room to start a job, or its "
                    "runtime env (the working-dir upload) may be stuck; set SYNCPOINT_PREFLIGHT_TIMEOUT_S to wait "
                    "longer"
                ],
                "the cluster cannot run syncpoint",
            )
        time.sleep(0.5)
    logs = client.get_job_logs(probe_id) or ""  # the probe stays in the job list (metadata syncpoint=preflight)
    line = next((ln for ln in reversed(logs.splitlines()) if ln.startswith(PROBE_MARK)), None)
    if line is None:
        tail = " | ".join(ln.strip() for ln in logs.strip().splitlines()[-3:]) or "no output"
        raise SpecError(
            where,
            [
                f"the cluster could not run `python` for the preflight job {probe_id} ({status}: {tail}), so nothing "
                "was "
                f"submitted. Job entrypoints run with the `python` on the PATH the head was started with: {install}"
            ],
            "the cluster cannot run syncpoint",
        )
    report = cast(ProbeReport, json.loads(line[len(PROBE_MARK) :]))  # the probe's own line: PROBE writes it
    py = f"{report['python']} (Python {report['version']})"
    problems = _probe_problems(report, ours)
    if problems:
        raise SpecError(
            where,
            [
                f"the Python that runs this cluster's jobs, {py} on the head, cannot run syncpoint: "
                f"{'; '.join(problems)}. "
                "Nothing was submitted. The job's `python` is the first on the PATH that `ray start --head` was run "
                "with: "
                f"{install}"
            ],
            "the cluster cannot run syncpoint",
        )
    if report["imports"]:
        raise SpecError(source, [f"on the cluster, {p}" for p in report["imports"]])
    print(
        f"syncpoint: preflight ok: the cluster runs jobs with {report['python']} (syncpoint {report['syncpoint']})",
        flush=True,
    )
    return report


def _probe_problems(report: ProbeReport, ours: str | None) -> list[str]:
    """Why the cluster's Python cannot run syncpoint, as the probe reported it (empty: it can)."""
    problems = []
    if report["syncpoint"] is None:
        problems.append("syncpoint is not installed in it")
    elif ours and report["syncpoint"] != ours:
        problems.append(f"it has syncpoint {report['syncpoint']}, this machine {ours}")
    if report["missing"]:
        problems.append(f"it lacks {', '.join(report['missing'])}")
    elif report["error"]:
        problems.append(f"importing syncpoint fails there: {report['error']}")
    return problems


async def _stream(client: JobSubmissionClient, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(redact_text(lines), end="", flush=True)
