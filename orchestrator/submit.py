"""``syncpoint submit``: run a job on a remote Ray cluster through the Job Submission API.

Equivalent to ``ray job submit --working-dir . -- syncpoint run JOB.yaml``: the working directory
is shipped as the job's runtime env (``.gitignore`` is honoured, so ``.venv`` and ``runs`` stay
home), the logs are streamed, and the exit code is the job's. The job's driver finds the cluster
through ``RAY_ADDRESS``, which the job supervisor sets.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time

from orchestrator.spec import JobSpec, SpecError

TERMINAL = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 1}


def entrypoint(job_file: str, overrides: list[str]) -> str:
    parts = ["python", "-m", "orchestrator", "run", job_file]
    for o in overrides:
        parts += ["--set", o]
    return " ".join(shlex.quote(p) for p in parts)


def submit(spec: JobSpec, job_file: str, overrides: list[str], address: str, working_dir: str = ".",
           follow: bool = True) -> int:
    if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        # Ray 2.60 gotcha: with a token on disk the cluster requires it, but a client given an explicit
        # address only sends it with RAY_AUTH_MODE=token (read when Ray is first imported).
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from ray.job_submission import JobSubmissionClient

    wd = os.path.abspath(working_dir)
    rel = os.path.relpath(os.path.abspath(job_file), wd)
    if rel.startswith(".."):
        raise SpecError(job_file, [f"the job file must live inside the working directory {wd} (it is shipped "
                                   "with it); move it there or pass --working-dir"])
    if spec.storage.startswith("file://"):
        print(f"syncpoint: storage {spec.storage} is a local path: every Ray node (and a re-submitted job) must "
              "see the same path; use s3:// or gs:// for a real cluster", file=sys.stderr)
    # storage is resolved here, on the submitting side: the job's driver runs in a temporary copy of
    # the working directory, where a relative path would vanish with the job
    overrides = [*overrides, f"storage={spec.storage}"]
    client = JobSubmissionClient(address)
    job_id = client.submit_job(entrypoint=entrypoint(rel, overrides), runtime_env={"working_dir": wd})
    print(f"syncpoint: submitted {spec.name!r} as Ray job {job_id} to {address}", flush=True)
    if not follow:
        return 0
    asyncio.run(_stream(client, job_id))
    while (status := str(client.get_job_status(job_id)).rsplit(".", 1)[-1]) not in TERMINAL:
        time.sleep(0.5)
    print(f"syncpoint: Ray job {job_id} {status}", flush=True)
    return TERMINAL[status]


async def _stream(client, job_id: str) -> None:  # noqa: ANN001
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)
