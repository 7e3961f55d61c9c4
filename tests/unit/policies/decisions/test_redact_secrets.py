"""Secrets never leave the process (issue 14 §7).

Credentials in URLs are redacted wherever syncpoint prints or logs them (``validate``, the storage
error of ``run``, ``states``, the Ray launcher, ``submit``); ``submit`` refuses to put them into a
Ray job at all; DeepSpeed config keys that hold secrets are refused at validation, because
DeepSpeed pickles its whole config into every ``mp_rank_*.pt`` in storage.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import types
from pathlib import Path

import pytest

from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
from syncpoint.policies.contracts.errors import SpecError
from syncpoint.policies.decisions.redact import redact_obj, redact_text, redact_url, url_secret_paths
from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[4]
SECRET = "hunter2-S3cr3t"  # long enough that every occurrence is unmistakable

JOB = """\
name: secrets
storage: {storage}
task: {{path: tests.light_tasks:linear, config: {{num_samples: 8}}}}
train: {{micro_batch_size: 1, epochs: 1}}
deepspeed: {{zero_stage: 0}}
"""


# ----------------------------------------------------------------------------- redact_url


@pytest.mark.parametrize(
    "url,expected",
    [
        (f"ftp://alice:{SECRET}@127.0.0.1:21/runs", "ftp://***@127.0.0.1:21/runs"),
        (f"https://alice:{SECRET}@example.com/runs?x=1", "https://***@example.com/runs?x=1"),
        (f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix", "s3://***@bucket/prefix"),
        (
            f"s3://AKIAEXAMPLE:{SECRET}/with+slash@bucket/prefix",
            "s3://***@bucket/prefix",
        ),  # unencoded '/' in a secret key
        (f"https://alice:{SECRET}@p@ss@host/x", "https://***@host/x"),  # unencoded '@' in the password
        (f"gs://token-only-{SECRET}@bucket", "gs://***@bucket"),
        (
            f"https://host/obj?X-Amz-Signature={SECRET}&X-Amz-Credential=AKIA%2F&n=1",
            "https://host/obj?X-Amz-Signature=***&X-Amz-Credential=***&n=1",
        ),
        (f"https://host/x?sig={SECRET}#frag", "https://host/x?sig=***#frag"),
    ],
)
def test_redact_url_hides_user_info_and_credential_parameters(url, expected):
    assert redact_url(url) == expected
    assert SECRET not in redact_url(url)


@pytest.mark.parametrize(
    "harmless",
    [
        "/data/runs",
        "./runs",
        "file:///data/runs",
        "memory://x",
        "s3://bucket/prefix",
        "http://127.0.0.1:8265",
        "http://host:8080/a/b",
        "file:///data/user@example.com/runs",
        "s3://bucket/a@b",
        "https://host/x?n=1&page=2",
        "",
    ],
)
def test_redact_url_leaves_urls_without_credentials_alone(harmless):
    assert redact_url(harmless) == harmless


def test_redact_text_finds_urls_in_messages_and_bare_secrets():
    url = f"s3://AKIAEXAMPLE:{SECRET}/x@bucket/runs"
    msg = (
        f"storage '{url}' is not usable: ValueError: Bucket create failed 'AKIAEXAMPLE:{SECRET}': "
        f"see (https://u:{SECRET}@h/p)"
    )
    out = redact_text(msg, url)
    assert SECRET not in out and "AKIAEXAMPLE" not in out
    assert "'s3://***@bucket/runs'" in out and "(https://***@h/p)" in out
    assert redact_obj({"a": [url, 3, None], "b": "plain"}) == {"a": ["s3://***@bucket/runs", 3, None], "b": "plain"}
    assert url_secret_paths({"storage": url, "task": {"config": {"src": [1, url]}}, "n": "x"}) == [
        "storage",
        "task.config.src.1",
    ]


def test_redact_is_a_leaf_module():
    """policies/ imports nothing else of the project; decisions/redact.py only the standard library."""
    tree = ast.parse((ROOT / "policies" / "decisions" / "redact.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


# ----------------------------------------------------------------------------- the CLI prints no credential


def _job(tmp_path, storage="/tmp/never-written") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(storage=storage))
    return job


def test_validate_prints_the_spec_with_credentials_redacted(tmp_path, capsys):
    rc, out, err = cli(
        capsys,
        "validate",
        str(_job(tmp_path)),
        "--set",
        f"storage=ftp://alice:{SECRET}@127.0.0.1:9/runs",
        "--set",
        f"resume.init_from=s3://AKIAEXAMPLE:{SECRET}@bucket/other/states/000000000008",
        "--set",
        f"task.config.source=https://bob:{SECRET}@data.example.com/set.bin",
    )
    assert rc == 0, err
    assert SECRET not in out + err and "alice" not in out
    spec = json.loads(out)
    assert spec["storage"] == "ftp://***@127.0.0.1:9/runs"
    assert spec["resume"]["init_from"] == "s3://***@bucket/other/states/000000000008"
    assert spec["task"]["config"]["source"] == "https://***@data.example.com/set.bin"


@pytest.mark.parametrize(
    "storage", [f"ftp://alice:{SECRET}@127.0.0.1:9/runs", f"https://alice:{SECRET}@127.0.0.1:9/runs"]
)
def test_run_storage_error_redacts_credentials(tmp_path, capsys, monkeypatch, storage):
    fake = types.ModuleType("syncpoint.orchestrator.ray_runner")
    fake.run_on_ray = lambda spec, address=None, **kwargs: pytest.fail("an unusable storage reached the launcher")
    monkeypatch.setitem(sys.modules, "syncpoint.orchestrator.ray_runner", fake)
    rc, out, err = cli(capsys, "run", str(_job(tmp_path)), "--set", f"storage={storage}")
    assert rc == 2
    assert "is not usable" in err and "://***@127.0.0.1:9/runs" in err, err
    assert SECRET not in out + err and "alice" not in err


def test_storage_arguments_are_redacted_in_errors(capsys):
    rc, _, err = cli(capsys, "states", f"nosuch://alice:{SECRET}@host/run")
    assert rc == 2 and "nosuch" in err and SECRET not in err, err


# ----------------------------------------------------------------------------- submit


class _RecordingClient:
    """Stands in for ray.job_submission.JobSubmissionClient: records what would be sent."""

    submitted: list[dict] = []

    def __init__(self, address, *args, **kwargs):
        self.address = address

    def submit_job(self, **kwargs):
        _RecordingClient.submitted.append(kwargs)
        return "raysubmit_test"


@pytest.fixture
def recording_client(monkeypatch):
    import ray.job_submission

    _RecordingClient.submitted = []
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", _RecordingClient)
    # the cluster check: not under test
    monkeypatch.setattr("syncpoint.orchestrator.submit.preflight", lambda *a, **k: {})
    monkeypatch.setenv("HOME", "/nonexistent-home")  # no ~/.ray/auth_token
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    return _RecordingClient


@pytest.mark.parametrize(
    "override",
    [
        f"storage=s3://AKIAEXAMPLE:{SECRET}@bucket/runs",
        f"storage=https://alice:{SECRET}@store.example.com/runs",
        f"resume.init_from=s3://AKIAEXAMPLE:{SECRET}@bucket/old/states/000000000004",
    ],
)
def test_submit_refuses_credentials_and_sends_nothing(tmp_path, capsys, recording_client, override, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = cli(
        capsys,
        "submit",
        str(_job(tmp_path, "s3://bucket/runs")),
        "--address",
        "http://127.0.0.1:9",
        "--working-dir",
        str(tmp_path),
        "--no-wait",
        "--set",
        override,
    )
    assert rc == 2, (out, err)
    assert recording_client.submitted == [], "a job carrying credentials was submitted"
    assert SECRET not in out + err
    assert re.search(r"(storage|resume\.init_from): the URL carries credentials", err), err
    assert "AWS_ACCESS_KEY_ID" in err and "environment variables" in err


def test_submit_without_credentials_prints_the_address_redacted(tmp_path, capsys, recording_client, monkeypatch):
    from syncpoint.orchestrator.submit import submit

    monkeypatch.chdir(tmp_path)
    job = _job(tmp_path, "s3://bucket/runs")
    spec = resolve_storage(parse_spec(job.read_text(), str(job)))
    assert submit(spec, str(job), [], f"http://admin:{SECRET}@127.0.0.1:8265", str(tmp_path), follow=False) == 0
    sent = json.dumps(recording_client.submitted)
    assert "s3://bucket/runs" in sent and SECRET not in sent
    out, err = capsys.readouterr()
    assert "raysubmit_test" in out and SECRET not in out + err


# ----------------------------------------------------------------------------- DeepSpeed config secrets

SECRET_CONFIGS = [
    pytest.param(
        {"wandb": {"enabled": True, "project": "p", "api_key": SECRET}}, ["wandb.api_key"], id="wandb-api-key"
    ),
    pytest.param({"comet": {"enabled": True, "apiKey": SECRET}}, ["comet.apiKey"], id="comet-camel-case"),
    pytest.param({"comet": {"API-KEY": SECRET}}, ["comet.API-KEY"], id="upper-case-dashed"),
    pytest.param({"csv_monitor": {"enabled": True, "token": SECRET}}, ["csv_monitor.token"], id="csv-monitor-token"),
    pytest.param(
        {"tensorboard": {"output_path": "/tmp/tb", "Password": SECRET}},
        ["tensorboard.Password"],
        id="tensorboard-password",
    ),
    pytest.param({"monitors": [{"wandb": {"secret": SECRET}}]}, ["monitors.0.wandb.secret"], id="inside-a-list"),
    pytest.param({"KEY": SECRET}, ["KEY"], id="top-level-key"),
    pytest.param({"a": {"b": {"c": {"access_token": SECRET}}}}, ["a.b.c.access_token"], id="deeply-nested"),
]


@pytest.mark.parametrize("config,paths", SECRET_CONFIGS)
def test_deepspeed_config_secrets_are_refused_pointing_at_env_vars(tmp_path, capsys, config, paths):
    text = JOB.format(storage="/tmp/x").replace(
        "deepspeed: {zero_stage: 0}", "deepspeed: {zero_stage: 0, config: " + json.dumps(config) + "}"
    )
    with pytest.raises(SpecError) as e:
        parse_spec(text, "job.yaml")
    message = str(e.value)
    for p in paths:
        assert f"deepspeed.config.{p}" in message, message
    assert "mp_rank_*.pt" in message and "environment variable" in message and "WANDB_API_KEY" in message
    assert SECRET not in message and "\n\n" not in message

    job = tmp_path / "job.yaml"
    job.write_text(text)
    rc, out, err = cli(capsys, "validate", str(job))
    assert rc == 2 and out == "" and SECRET not in err
    rc, out, err = cli(capsys, "validate", str(_job(tmp_path)), "--set", "deepspeed.config=" + json.dumps(config))
    assert rc == 2 and SECRET not in err


def test_deepspeed_monitor_configs_without_secrets_still_validate():
    config = {
        "wandb": {"enabled": False, "project": "p", "group": "g", "team": "t"},
        "tensorboard": {"enabled": False, "output_path": "/tmp/tb", "job_name": "j"},
        "csv_monitor": {"enabled": False, "output_path": "/tmp/csv"},
        "steps_per_print": 100,
        "comms_logger": {"enabled": False},
        "wall_clock_breakdown": False,
        "data_efficiency": {"data_sampling": {"max_tokens": 3}},
    }
    text = JOB.format(storage="/tmp/x").replace(
        "deepspeed: {zero_stage: 0}", "deepspeed: {zero_stage: 0, config: " + json.dumps(config) + "}"
    )
    assert parse_spec(text).deepspeed.config == config


# ----------------------------------------------------------------------------- no unredacted URL in output

OUTPUT_CALLS = {"print", "SpecError", "emit", "write", "warn", "info", "warning", "error"}
URL_LIKE = re.compile(r"(storage|run_url|\burl\b|address|init_from)")
REDACTORS = {"redact_url", "redact_text", "redact_obj"}


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


@pytest.mark.parametrize(
    "module",
    [
        "orchestrator/cli.py",
        "orchestrator/cli_inputs.py",
        "orchestrator/cli_jobs.py",
        "orchestrator/cli_inspect.py",
        "orchestrator/submit.py",
        "orchestrator/ray_runner.py",
        "orchestrator/run_outcome.py",
    ],
)
def test_printed_urls_go_through_a_redactor(module):
    """Regression guard: an f-string that puts a storage URL or address into printed output must pass
    it (or the whole text) through redact_url/redact_text. SpecError redacts its own message."""
    tree = ast.parse((ROOT / module).read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    # a module's own helpers that redact what they return (e.g. a path shown to the user) count too
    redactors = REDACTORS | {
        f.name
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        and any(isinstance(c, ast.Call) and _name(c.func) in REDACTORS for c in ast.walk(f))
    }
    leaks = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FormattedValue) and URL_LIKE.search(ast.unparse(node.value))):
            continue
        chain, up = [], node
        while up in parents:
            up = parents[up]
            if isinstance(up, ast.Call):
                chain.append(_name(up.func))
        redacted = (isinstance(node.value, ast.Call) and _name(node.value.func) in redactors) or any(
            c in redactors or c == "SpecError" for c in chain
        )
        if any(c in OUTPUT_CALLS for c in chain) and not redacted:
            leaks.append(f"{module}:{node.lineno}: {ast.unparse(node.value)}")
    assert not leaks, leaks
