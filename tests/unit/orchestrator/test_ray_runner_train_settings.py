"""What syncpoint asks of Ray Train for a job: the trainer (a supervisor never imports torch, so its
workers get no torch backend) and the controller's health-check interval (shorter for supervisors,
never over a value the user set; reports keep their 2 s floor)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from syncpoint.orchestrator import ray_runner
from tests.helpers import linear_spec

# the CLI's options on their way to the launcher, with a task whose import check imports no torch
LIGHT_TASK = "task.path=tests.light_tasks:linear"


@pytest.mark.parametrize("in_place", [True, False])
def test_supervisors_get_a_plain_trainer_and_training_workers_a_torch_one(tmp_path, in_place):
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    spec = linear_spec(tmp_path, f"failure.in_place={str(in_place).lower()}", "scaling.collective_timeout_s=7")
    trainer, backend = ray_runner._trainer(spec), ray_runner._backend(spec)
    if in_place:
        assert issubclass(trainer, DataParallelTrainer) and not issubclass(trainer, TorchTrainer)
        assert list(backend) == ["backend_config"]
        assert type(backend["backend_config"]).__name__ == "BackendConfig"  # nothing set up in the workers
    else:
        assert issubclass(trainer, TorchTrainer)
        config = backend["torch_config"]
        assert (config.backend, config.timeout_s) == ("gloo", 7)


def test_the_controller_polls_supervisors_every_half_second_for_the_job_unless_told_otherwise(tmp_path, monkeypatch):
    env = ray_runner.HEALTH_CHECK_ENV
    monkeypatch.delenv(env, raising=False)
    with ray_runner.ray_train_defaults(linear_spec(tmp_path, "failure.in_place=false")):
        assert env not in os.environ  # Ray's own default for workers that train
    with ray_runner.ray_train_defaults(linear_spec(tmp_path)):
        assert os.environ[env] == "0.5"
    assert env not in os.environ  # only for the job: a later job in this process starts from the caller's
    monkeypatch.setenv(env, "3")
    with ray_runner.ray_train_defaults(linear_spec(tmp_path)):
        assert os.environ[env] == "3"  # the user's value wins
    assert os.environ[env] == "3"


def test_an_embedded_run_leaves_out_ray_trains_preemption_watcher_unless_told_otherwise(tmp_path, monkeypatch):
    """Ray Train's own switch (its constant, so a rename in Ray fails here): off for an embedded Ray,
    whose one node no autoscaler drains; a cluster's run keeps Ray Train's default; a user's value wins."""
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR as env

    from syncpoint.orchestrator.embedded_ray import EMBEDDED_TRAIN_ENV

    assert EMBEDDED_TRAIN_ENV == {env: "0"}
    monkeypatch.delenv(env, raising=False)
    with ray_runner.ray_train_defaults(linear_spec(tmp_path)):
        assert env not in os.environ
    with ray_runner.ray_train_defaults(linear_spec(tmp_path), embedded=True):
        assert os.environ[env] == "0"
    assert env not in os.environ
    monkeypatch.setenv(env, "1")
    with ray_runner.ray_train_defaults(linear_spec(tmp_path), embedded=True):
        assert os.environ[env] == "1"


@pytest.mark.parametrize("interval,every", [("0.5", 2.0), ("2.0", 2.0), ("5", 5.0)])
def test_reports_reach_ray_no_more_often_than_every_two_seconds(interval, every):
    code = "import syncpoint.workers.observation.metric_sinks as m; print(m.REPORT_EVERY_S)"
    env = {**os.environ, ray_runner.HEALTH_CHECK_ENV: interval}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert float(out) == every


def test_an_embedded_ray_starts_without_the_helpers_of_a_long_lived_cluster(tmp_path):
    """Embedded: no dashboard unless asked, no workers Ray would start ahead (none could serve a job
    with a runtime env), and a controller without the placement-group cleaner (unless the dashboard it
    polls runs), the autoscaling coordinator, or a dataset manager for a trainer without datasets; on
    a cluster, Ray Train's own helpers but the dataset manager (syncpoint's trainers have no datasets)."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
    from ray.train.v2.api.config import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from syncpoint.orchestrator import embedded_ray

    assert embedded_ray.init_options(False) == {
        "include_dashboard": False,
        "_system_config": {"prestart_worker_first_driver": False},
    }
    assert embedded_ray.init_options(True)["include_dashboard"] is True
    assert embedded_ray.init_options(False, 9090)["_metrics_export_port"] == 9090  # --metrics-port
    spec = linear_spec(tmp_path)
    assert issubclass(ray_runner._trainer(spec, embedded=False), DataParallelTrainer)

    class Recorded(DataParallelTrainer):  # what the controller would be given
        def _initialize_and_run_controller(self, **kwargs):
            return kwargs

    cleaner, data, other = PlacementGroupCleanerCallback(), DatasetsCallback.__new__(DatasetsCallback), object()
    fixed = FixedScalingPolicy(scaling_config=ScalingConfig(num_workers=2))
    for embedded, keep_cleaner, datasets in [
        (True, False, {}),
        (True, True, {}),
        (True, False, {"train": [1]}),
        (False, True, {}),
        (False, True, {"train": [1]}),
    ]:
        cls = embedded_ray.lean_trainer(Recorded, embedded, keep_cleaner)
        trainer = cls.__new__(cls)  # only its datasets are read on the way to the controller
        trainer.datasets = datasets
        given = trainer._initialize_and_run_controller(callbacks=[cleaner, data, other], scaling_policy=fixed)
        kept = [cleaner] * keep_cleaner + [data] * bool(datasets) + [other]
        assert given["callbacks"] == kept
        policy = given["scaling_policy"]
        if not embedded:  # a cluster's autoscaler reads the coordinator's requests
            assert policy is fixed
            continue
        assert type(policy) is embedded_ray.LocalFixedScalingPolicy
        assert policy.scaling_config is fixed.scaling_config
        policy.after_controller_start(None)  # no coordinator: nothing to start, nothing to wait for
        assert policy._coordinator_client is None
        assert policy.make_decision_for_non_running_worker_group().num_workers == 2
    elastic = ElasticScalingPolicy(scaling_config=ScalingConfig(num_workers=(1, 2)))
    assert embedded_ray.without_autoscaler(elastic) is elastic  # it reads what the coordinator granted
    assert issubclass(ray_runner._trainer(spec, embedded=True), DataParallelTrainer)


@pytest.mark.parametrize("address", [None, "ray://elsewhere:10001"])
def test_run_dashboard_reaches_the_launcher_and_says_when_it_has_no_effect(tmp_path, monkeypatch, capsys, address):
    import types

    from syncpoint.orchestrator.cli import main
    from tests.helpers import write_job

    given: dict = {}
    fake = types.ModuleType("syncpoint.orchestrator.ray_runner")

    def run_on_ray(spec, address=None, **kwargs):  # the launcher's arguments, recorded; no Ray starts
        given.update(address=address, **kwargs)
        return 0

    fake.run_on_ray = run_on_ray
    monkeypatch.setitem(sys.modules, "syncpoint.orchestrator.ray_runner", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    job = write_job(linear_spec(tmp_path / "runs", LIGHT_TASK), tmp_path / "job.yaml")
    assert main(["run", str(job), "--dashboard", *(["--address", address] if address else [])]) == 0
    assert given["dashboard"] is True and given["address"] == address
    note = "--dashboard applies to an embedded Ray" in capsys.readouterr().err
    assert note == bool(address)


@pytest.mark.parametrize("address", [None, "ray://elsewhere:10001"])
def test_run_metrics_port_reaches_the_launcher_and_says_where_a_cluster_serves_them(
    tmp_path, monkeypatch, capsys, address
):
    import socket
    import types

    from syncpoint.orchestrator.cli import main
    from tests.helpers import write_job

    given: dict = {}
    fake = types.ModuleType("syncpoint.orchestrator.ray_runner")

    def run_on_ray(spec, address=None, **kwargs):  # the launcher's arguments, recorded; no Ray starts
        given.update(address=address, **kwargs)
        return 0

    fake.run_on_ray = run_on_ray
    monkeypatch.setitem(sys.modules, "syncpoint.orchestrator.ray_runner", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as s:  # a port free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = write_job(linear_spec(tmp_path / "runs", LIGHT_TASK), tmp_path / "job.yaml")
    assert main(["run", str(job), "--metrics-port", str(port), *(["--address", address] if address else [])]) == 0
    assert given["metrics_port"] == port and given["address"] == address
    note = "--metrics-port applies to an embedded Ray; on a cluster" in capsys.readouterr().err
    assert note == bool(address)
