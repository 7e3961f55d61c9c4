"""Experiment tracking (issue 31.3): MLflow and W&B as sinks, one tracker run per syncpoint run.

Real parts: in-process runs of the example job log to MLflow's file store (``<run>/mlruns``, read back
with ``MlflowClient.get_metric_history``) and to W&B's offline files (``WANDB_MODE=offline``; read back
from the ``.wandb`` transaction logs with W&B's own protobuf ``Record``, through
``syncpoint.workers.observation.trackers.offline_history``). Nothing reaches the network.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from syncpoint.workers.observation.trackers import (
    KEY_TAG,
    TRACKING,
    TRACKING_FORMAT,
    offline_files,
    offline_history,
    read_record,
    tracker_problems,
)
from syncpoint.workers.storage import RunStorage
from tests.helpers import EXAMPLE, cli, digest, lm_spec, run, run_until_crash, step_history

# As tests/integration/workers/observation/test_metric_sinks.py: optimizer steps 1..6, a state every 2 steps, every
# step logged.
SETS = (
    "task.config.num_samples=20",
    "train.grad_accum=4",
    "train.epochs=2",
    "deepspeed.zero_stage=0",
    "checkpoint.save_every={value: 2, unit: optimizer_steps}",
    "train.log_every=1",
)
TRACKERS = "train.report_to=[tensorboard, mlflow, wandb]"
# A crash after micro-step 13: step 3 was logged to every tracker after the last commit (step 2); the
# resumed attempt recomputes it, and must not log it again.
CRASH = "faults=[{at_micro_step: 13, mode: raise}]"
REFERENCE: dict = {}


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)


# the trackers' checks before anything starts, with a task whose import check imports no torch
# (tests/light_tasks.py): the example's own is checked in tests/integration/orchestrator/test_cli_first_hour.py
LIGHT_TASK = ("--set", "task.path=tests.light_tasks:linear")


def _reference(tmp_path_factory):
    """The uninterrupted run without trackers (TensorBoard only, the default)."""
    if not REFERENCE:
        spec = lm_spec(tmp_path_factory.mktemp("ref"), *SETS)
        REFERENCE["spec"], REFERENCE["final"] = spec, run(spec).final_state
    return REFERENCE["spec"], REFERENCE["final"]


def _mlflow_run(spec):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file://" + str(RunStorage(spec.run_url).local_path("mlruns")))
    experiment = client.get_experiment_by_name(spec.name)
    runs = client.search_runs([experiment.experiment_id])
    return client, runs


def _wandb_rows(spec, run_id):
    """Every history row of the run's offline files, in the order they were written (attempts in order)."""
    files = offline_files(RunStorage(spec.run_url).local_path(), run_id)
    return files, [row for f in files for row in offline_history(f).rows]


def _wandb_held(files) -> str:
    """What the offline files held when read, for a failure's message (docs/testing.md, *Flakes*: twice
    a file lacked rows a run logged): each file's size, its rows' steps and losses, the tail of W&B's
    own log of that run."""
    out = []
    for f in files:
        rows = [(step, v.get("loss")) for step, v in offline_history(f).rows]
        log = os.path.join(os.path.dirname(f), "logs", "debug-internal.log")
        tail = open(log, errors="replace").read()[-1500:] if os.path.isfile(log) else "(no debug-internal.log)"
        out.append(f"{f} ({os.path.getsize(f)} bytes): rows {rows}\n{tail}")
    return "\n".join(out)


def test_trackers_across_a_crash_and_a_resubmission(tmp_path, tmp_path_factory):
    """A crash after logging past the last commit, then a new submission that resumes: one MLflow run and
    one W&B run id across both, each step logged once and in order, with the uninterrupted run's values;
    the spec as params/config, the last state as a tag/summary, the restart as a tag/summary."""
    ref, ref_final = _reference(tmp_path_factory)
    spec = lm_spec(tmp_path / "run", *SETS, TRACKERS, CRASH)
    assert run_until_crash(spec)
    storage = RunStorage(spec.run_url)
    first = json.loads(storage.read_bytes(TRACKING, limit=1 << 16))
    _, runs = _mlflow_run(spec)
    assert [r.info.status for r in runs] == ["FAILED"]
    held = runs[0].info.run_id
    steps_before = [m.step for m in _mlflow_run(spec)[0].get_metric_history(held, "loss")]
    assert steps_before == [1, 2, 3]  # step 3 logged, but the last commit is step 2

    result = run(spec)
    assert result.resumed_from == f"{8:012d}" and digest(spec, result.final_state) == digest(ref, ref_final)
    record = json.loads(storage.read_bytes(TRACKING, limit=1 << 16))
    assert record["format"] == TRACKING_FORMAT and record["key"] == first["key"]
    assert record["mlflow"]["run_id"] == held and record["wandb"]["id"] == first["wandb"]["id"] == first["key"]

    history = step_history(ref)
    client, runs = _mlflow_run(spec)
    assert [r.info.run_id for r in runs] == [held]  # one MLflow run for the syncpoint run
    mrun = runs[0]
    assert mrun.info.status == "FINISHED" and mrun.data.tags[KEY_TAG] == first["key"]
    loss = [(m.step, m.value) for m in client.get_metric_history(held, "loss")]
    assert loss == [(s, history[s].loss) for s in range(1, 7)]  # each step once, monotonic, the reference's values
    assert [m.step for m in client.get_metric_history(held, "lr")] == list(range(1, 7))
    for group in ("lr_group_0", "lr_group_1"):  # the example's two param groups, each its own metric
        assert [m.step for m in client.get_metric_history(held, group)] == list(range(1, 7)), group
    assert [m.step for m in client.get_metric_history(held, "save/seconds")] == [2, 4, 6]
    assert mrun.data.params["train.grad_accum"] == "4" and mrun.data.params["name"] == spec.name
    assert mrun.data.params["train.report_to"] == '["tensorboard", "mlflow", "wandb"]'
    assert mrun.data.tags["syncpoint.last_state"] == result.final_state
    assert mrun.data.tags["syncpoint.last_state_step"] == "6"
    assert "resumed from state 000000000008 at optimizer step 2" in mrun.data.tags["restarts.attempt-000002"]
    assert "restarts.attempt-000001" not in mrun.data.tags

    files, rows = _wandb_rows(spec, record["wandb"]["id"])
    assert len(files) == 2, _wandb_held(files)  # one offline run per attempt, one run id
    losses = [(s, v["loss"]) for s, v in rows if "loss" in v]
    assert losses == [(s, history[s].loss) for s in range(1, 7)], _wandb_held(files)
    steps = [s for s, _ in rows]
    assert steps == sorted(steps)  # never backwards, across the attempts
    saves = [v["save/optimizer_step"] for _, v in rows if "save/seconds" in v]
    assert saves == [2, 4, 6]


def test_trackers_leave_the_run_bitwise(tmp_path, tmp_path_factory):
    """Nothing a tracker does reaches an RNG or the model: the final state with ``report_to: [mlflow,
    wandb]`` is bitwise the one without (TensorBoard only)."""
    ref, ref_final = _reference(tmp_path_factory)
    spec = lm_spec(tmp_path / "run", *SETS, "train.report_to=[mlflow, wandb]")
    result = run(spec)
    assert digest(spec, result.final_state) == digest(ref, ref_final)
    storage = RunStorage(spec.run_url)
    assert not storage.exists("tensorboard")  # not listed: not written
    assert [r.info.status for r in _mlflow_run(spec)[1]] == ["FINISHED"]
    record = read_record(storage, pytest.fail)
    assert record is not None
    files, rows = _wandb_rows(spec, record["wandb"]["id"])
    logged = [s for s, v in rows if "loss" in v]
    assert logged == list(range(1, 7)), _wandb_held(files)


@pytest.mark.parametrize(
    "content",
    [b"not json", b'{"format": "syncpoint-tracking/1", "key": "../x"}', b"[]", b" " * (1 << 17)],
    ids=["garbage", "bad-key", "not-an-object", "oversized"],
)
def test_a_malformed_tracking_record_is_reported_and_not_trusted(content):
    storage = RunStorage("memory://tracking-" + str(len(content)) + content[:4].hex())
    storage.write_bytes(content, TRACKING)
    warnings: list[str] = []
    assert read_record(storage, warnings.append) is None
    assert len(warnings) == 1 and TRACKING in warnings[0]


def test_a_tracker_that_is_not_installed_is_refused_at_validate(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    job = tmp_path / "job.yaml"
    job.write_text(EXAMPLE)
    rc, _, err = cli(capsys, "validate", str(job), "--set", f"storage={tmp_path}", "--set", TRACKERS, *LIGHT_TASK)
    assert rc == 2
    assert "train.report_to lists wandb" in err and "pip install 'syncpoint[wandb]'" in err
    assert "mlflow" not in err.split("train.report_to lists wandb")[0]  # mlflow is installed: not named


def test_mlflow_on_object_storage_needs_a_tracking_uri(monkeypatch):
    spec = lm_spec("memory://tracking-uri", "train.report_to=[mlflow]")
    (problem,) = tracker_problems(spec, {})
    assert "MLFLOW_TRACKING_URI" in problem and "train.report_to" in problem
    assert tracker_problems(spec, {"MLFLOW_TRACKING_URI": "http://mlflow.example:5000"}) == []
    assert tracker_problems(lm_spec("/tmp/somewhere", "train.report_to=[mlflow]"), {}) == []


def test_mlflow_in_this_environment_refuses_a_file_store_unless_allowed(tmp_path, monkeypatch):
    """The premise of the checks below, read from the installed MLflow itself: a file store (a
    ``file:`` URI or a path) is refused unless MLFLOW_ALLOW_FILE_STORE is true, and a database needs
    SQLAlchemy. Should an MLflow release change this, this test says so."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for uri in (f"file://{tmp_path}/a", str(tmp_path / "b")):
        with pytest.raises(MlflowException, match="MLFLOW_ALLOW_FILE_STORE=true"):
            MlflowClient(tracking_uri=uri).search_experiments()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "True")
    assert MlflowClient(tracking_uri=f"file://{tmp_path}/a").search_experiments() != []  # its Default
    if importlib.util.find_spec("sqlalchemy") is None:
        with pytest.raises(MlflowException, match="unsupported URI 'sqlite:"):
            MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db").search_experiments()


def _mlflow_problems(storage: str, **environ: str) -> list[str]:
    return tracker_problems(lm_spec(storage, "train.report_to=[mlflow]"), environ)


def test_mlflow_stores_that_fail_in_the_workers_are_named_before_anything_starts(tmp_path):
    local, on_s3 = str(tmp_path), "memory://tracking-stores"
    fixes = ("MLFLOW_ALLOW_FILE_STORE=true", "http://host:5000")
    for uri in (f"file://{tmp_path}/mlruns", str(tmp_path / "mlruns"), "./mlruns", "file:relative"):
        for allow in ({}, {"MLFLOW_ALLOW_FILE_STORE": "false"}, {"MLFLOW_ALLOW_FILE_STORE": "0"}):
            (problem,) = _mlflow_problems(on_s3, MLFLOW_TRACKING_URI=uri, **allow)
            assert f"MLFLOW_TRACKING_URI={uri!r} is a file store" in problem and all(f in problem for f in fixes)
        for allow in ("true", "TRUE", "1"):
            assert _mlflow_problems(on_s3, MLFLOW_TRACKING_URI=uri, MLFLOW_ALLOW_FILE_STORE=allow) == []
    (problem,) = _mlflow_problems(local, MLFLOW_ALLOW_FILE_STORE="false")  # the run's own mlruns, forbidden
    assert "MLFLOW_ALLOW_FILE_STORE=false forbids file stores: unset MLFLOW_ALLOW_FILE_STORE" in problem
    (problem,) = _mlflow_problems(local, MLFLOW_ALLOW_FILE_STORE="yes")
    assert "MLFLOW_ALLOW_FILE_STORE='yes' and fails on it" in problem
    assert _mlflow_problems(local) == []  # syncpoint allows the run's own store itself
    for server in ("http://mlflow.example:5000", "https://mlflow.example", "databricks"):
        assert _mlflow_problems(on_s3, MLFLOW_TRACKING_URI=server, MLFLOW_ALLOW_FILE_STORE="yes") == []
    for database in (f"sqlite:///{tmp_path}/m.db", "postgresql+psycopg2://u@db/mlflow"):
        found = _mlflow_problems(on_s3, MLFLOW_TRACKING_URI=database)
        if importlib.util.find_spec("sqlalchemy") is None:
            assert len(found) == 1 and "needs SQLAlchemy" in found[0] and "pip install mlflow" in found[0]
        else:
            assert found == []


def test_an_mlflow_file_store_uri_is_refused_by_validate_and_run_in_one_paragraph(tmp_path, capsys, monkeypatch):
    """``MLFLOW_TRACKING_URI=file://...`` without MLFLOW_ALLOW_FILE_STORE: MLflow 3 would refuse it in the
    workers after the job started; validate and run refuse it first (exit 2, one paragraph naming both
    fixes), and run starts nothing."""
    import sys
    import time
    import types

    fake = types.ModuleType("syncpoint.orchestrator.ray_runner")
    fake.run_on_ray = lambda *a, **k: pytest.fail("an MLflow store that cannot work reached the launcher")
    monkeypatch.setitem(sys.modules, "syncpoint.orchestrator.ray_runner", fake)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    job = tmp_path / "job.yaml"
    job.write_text(EXAMPLE)
    sets = ("--set", f"storage={tmp_path}/runs", "--set", "train.report_to=[mlflow]", *LIGHT_TASK)
    for command in ("validate", "run"):
        began = time.monotonic()
        rc, out, err = cli(capsys, command, str(job), *sets)
        assert rc == 2 and out == "", err
        assert f"MLFLOW_TRACKING_URI='file://{tmp_path}/mlruns' is a file store" in err, err
        assert "set MLFLOW_ALLOW_FILE_STORE=true" in err and "tracking server (http://host:5000" in err, err
        assert "\n\n" not in err.strip(), err
        assert time.monotonic() - began < 60
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert cli(capsys, "validate", str(job), *sets)[0] == 0


def test_report_to_names_each_tracker_once():
    from syncpoint.policies.contracts.errors import SpecError

    with pytest.raises(SpecError, match="once"):
        lm_spec("/tmp/x", "train.report_to=[mlflow, mlflow]")
    with pytest.raises(SpecError):
        lm_spec("/tmp/x", "train.report_to=[comet]")
    assert lm_spec("/tmp/x").train.report_to == ["tensorboard"]  # the default, as before


def test_offline_runs_of_one_id_started_within_a_second_are_all_found_in_order(tmp_path, monkeypatch):
    """W&B names a second offline run of the same id started within the same second ``...-<id>-1``
    (an attempt right after a failure: in-place, or a retry in the same process). Every attempt's file
    counts, oldest first: missed, the steps an attempt logged would be logged again by the next. A real
    offline run's directory stands in, under the names W&B gives (the same second twice, a later one)."""
    import shutil

    import wandb

    monkeypatch.chdir(tmp_path)
    from syncpoint.workers.observation.wandb_offline import wait_until_written

    run = wandb.init(id="abc123", project="p", dir=str(tmp_path), settings=wandb.Settings(console="off"))
    for step in (1, 2):
        run.log({"loss": float(step)}, step=step)
    run.finish()
    assert wait_until_written(run.settings.sync_file)  # finish() may return before the log is (the test below)
    [made] = (tmp_path / "wandb").glob("offline-run-*-abc123")
    base = tmp_path / "wandb"
    for name in ("offline-run-20990101_000000-abc123", "offline-run-20990101_000000-abc123-1"):
        shutil.copytree(made, base / name)
    shutil.copytree(made, base / "offline-run-20990101_000001-abc1234")  # another id: not this run's
    files = offline_files(str(tmp_path), "abc123")
    assert [f.split("/")[-2] for f in files] == [
        made.name,
        "offline-run-20990101_000000-abc123",
        "offline-run-20990101_000000-abc123-1",
    ]
    assert all(offline_history(f).steps == [1, 2] for f in files)


def test_a_runs_end_waits_until_its_log_is_written_to_its_end(tmp_path, monkeypatch):
    """``wandb.finish()`` can return before W&B's service has written the run's last records (3 of 40
    files held none of their rows right after it, here, under load): a W&B sink's end waits, bounded,
    for the log's ``exit`` record, which W&B writes last. A real offline run's log, cut before that record,
    stands for one being written: not written within a short bound, and written once the rest lands."""
    import threading

    import wandb

    from syncpoint.workers.observation.wandb_offline import wait_until_written

    monkeypatch.chdir(tmp_path)
    run = wandb.init(id="end123", project="p", dir=str(tmp_path), settings=wandb.Settings(console="off"))
    run.log({"loss": 1.0}, step=1)
    run.finish()
    assert wait_until_written(run.settings.sync_file)  # the whole log, once W&B's service has written it
    whole = open(run.settings.sync_file, "rb").read()
    path = str(tmp_path / "being-written.wandb")  # a copy: W&B's service may still hold the log open
    with open(path, "wb") as f:
        f.write(whole[:-8])  # the exit record torn
    assert not wait_until_written(path, timeout_s=0.2)
    assert offline_history(path).steps == [1]  # what was written reads as before
    rest = threading.Timer(0.3, lambda: open(path, "wb").write(whole))
    rest.start()
    try:
        assert wait_until_written(path)
    finally:
        rest.join()
