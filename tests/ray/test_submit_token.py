"""``syncpoint submit`` against a real local head started with ``RAY_AUTH_MODE=token``: the Ray tests'
shared head (tests/ray/conftest.py; where the token comes from: tests/integration/orchestrator/test_submit_token.py)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from syncpoint.orchestrator.submit import auth_headers
from tests.helpers import ROOT
from tests.ray_processes import BIN, TOKEN_ENV


def _env(token: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TOKEN_ENV}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    env.update(extra)
    return env


def _status(address: str, authorization: str | None) -> int:
    headers = {"Authorization": authorization} if authorization else {}
    req = urllib.request.Request(f"{address}/api/jobs/", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _jobs(address: str, token: str) -> int:
    from ray.job_submission import JobSubmissionClient

    return len(JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"}).list_jobs())


def _submit(address: str, env: dict[str, str], *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "syncpoint", "submit", "examples/tiny_lm.yaml", "--address", address]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def token_head(shared_head) -> tuple[str, str]:
    """The Ray tests' shared head (tests/ray/conftest.py), started with ``RAY_AUTH_MODE=token`` and a
    token of its own: its Job API address and that token."""
    head, env = shared_head
    return head.address, env["RAY_AUTH_TOKEN"]


def test_the_head_refuses_requests_without_its_token(token_head) -> None:
    """What makes the other tests meaningful: this cluster really enforces the token."""
    address, token = token_head
    assert _status(address, None) == 401
    assert _status(address, "Bearer " + secrets.token_hex(32)) == 403
    assert _status(address, f"Bearer {token}") == 200


def test_the_client_syncpoint_builds_is_accepted(token_head, no_token, monkeypatch) -> None:
    """The Job SDK client built the way `syncpoint submit` builds it (RAY_AUTH_TOKEN, no RAY_AUTH_MODE)."""
    from ray.job_submission import JobSubmissionClient

    from syncpoint.orchestrator.submit import _connect

    address, token = token_head
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    client = _connect(JobSubmissionClient, address, auth_headers(address))
    assert isinstance(client.list_jobs(), list)


def test_syncpoint_submit_sends_the_token_on_every_request(token_head, tmp_path) -> None:
    """Submitted (past the import preflight, itself a job), logs streamed over the authenticated
    websocket, status polled: the job's own refusal on the cluster (its storage lies under a file, so
    the driver's write probe fails before any worker starts) comes back as exit 1 - the token got it
    all the way there. (A submitted job that trains: tests/ray/test_job_submit.py.)"""
    address, token = token_head
    home = tmp_path / "home"
    home.mkdir()
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    (tmp_path / "a-file").write_text("not a directory\n")
    env = _env(None, HOME=str(home), RAY_AUTH_TOKEN_PATH=str(token_file))  # no RAY_AUTH_MODE: syncpoint needs none
    r = _submit(address, env, "name=token-auth", f"storage={tmp_path / 'a-file' / 'runs'}", "scaling.num_workers=1")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "syncpoint: submitted 'token-auth' as Ray job" in r.stdout, out[-3000:]
    assert "is not usable" in r.stdout, out[-3000:]  # the job's own error, through the log websocket
    assert r.stdout.rstrip().endswith("FAILED"), out[-3000:]
    assert token not in out


def test_a_missing_or_wrong_token_is_one_paragraph_and_submits_nothing(token_head, tmp_path) -> None:
    address, token = token_head
    home = tmp_path / "home"
    home.mkdir()
    before = _jobs(address, token)
    wrong = secrets.token_hex(32)
    for env, says in [
        (_env(None, HOME=str(home)), "no token was sent"),
        (_env(wrong, HOME=str(home)), "the configured token was rejected"),
    ]:
        r = _submit(address, env, f"storage={tmp_path / 'runs'}")
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert "requires token authentication" in r.stderr and says in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 3, r.stderr
        assert wrong not in r.stdout + r.stderr and token not in r.stdout + r.stderr
    assert _jobs(address, token) == before
