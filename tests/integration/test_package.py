"""The installed shape: one import name, ``syncpoint``, with a small documented public surface.

The layers live at the repository's top level (``orchestrator/``, ``workers/``, ``policies/``) and
install as ``syncpoint.<layer>`` (``[tool.setuptools] package-dir``); ``syncpoint/`` holds the public
API and links to the three layers, so a checkout (``PYTHONPATH``, mypy) sees the installed names.
Building, installing and running the wheel is ``tests/ray/test_wheel.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("orchestrator", "workers", "policies")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_public_names_exist_and_are_documented():
    import syncpoint

    assert sorted(syncpoint.__all__) == [
        "Candidate",
        "Decision",
        "JobSpec",
        "ResumePolicy",
        "RunFailed",
        "RunResult",
        "SaveTrigger",
        "ShardedCorpus",
        "SpecError",
        "Task",
        "Tick",
        "TokenWindows",
        "Verdict",
        "__version__",
        "load_model",
        "load_spec",
        "run",
    ]
    for name in syncpoint.__all__:
        value = getattr(syncpoint, name)
        assert name == "__version__" or value.__doc__, f"syncpoint.{name} has no docstring"
    assert set(syncpoint.__all__) <= set(dir(syncpoint))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        syncpoint.nope  # noqa: B018


def test_the_names_are_the_layers_own_objects():
    """One object per name (no copies under another module name): isinstance checks hold across both."""
    import syncpoint
    from syncpoint.orchestrator.spec_file import load_spec
    from syncpoint.policies.contracts.errors import SpecError
    from syncpoint.policies.contracts.spec import JobSpec
    from syncpoint.workers.task import Task

    assert (syncpoint.Task, syncpoint.JobSpec, syncpoint.load_spec, syncpoint.SpecError) == (
        Task,
        JobSpec,
        load_spec,
        SpecError,
    )


def test_version_is_the_projects():
    import syncpoint

    assert syncpoint.__version__ == PYPROJECT["project"]["version"]


def test_import_syncpoint_is_cheap():
    """``import syncpoint`` imports neither torch, Ray, DeepSpeed nor pydantic: each name loads on first use."""
    code = (
        "import sys, time; t = time.perf_counter(); import syncpoint; dt = time.perf_counter() - t; "
        "import json; print(json.dumps({'s': dt, 'heavy': [m for m in ('torch', 'ray', 'deepspeed', 'pydantic', "
        "'yaml', 'numpy') if m in sys.modules]}))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["s"] < 1.0, result  # milliseconds here; a generous bound for a loaded machine


def test_python_dash_m_syncpoint_is_the_cli():
    r = subprocess.run(
        [sys.executable, "-m", "syncpoint", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert "validate" in r.stdout and "run" in r.stdout


def _sub_packages(layer: str) -> list[str]:
    return sorted(
        ".".join(("syncpoint", layer, *p.parent.relative_to(ROOT / layer).parts))
        for p in (ROOT / layer).rglob("__init__.py")
    )


def test_every_sub_package_is_installed():
    """``packages`` lists each layer's sub-packages by hand (package-dir maps only the layers): a new
    directory with an ``__init__.py`` missing from it would be missing from the wheel."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"syncpoint": "syncpoint", **{f"syncpoint.{x}": x for x in LAYERS}}
    assert sorted(setuptools["packages"]) == sorted(["syncpoint", *(p for x in LAYERS for p in _sub_packages(x))])
    assert PYPROJECT["project"]["scripts"] == {"syncpoint": "syncpoint.orchestrator.cli:main"}


def test_the_checkout_links_the_layers_under_their_installed_names():
    """In a checkout ``syncpoint/<layer>`` is a link to ``../<layer>``: ``PYTHONPATH=.`` (the GPU
    check) and mypy then resolve ``syncpoint.workers.x`` to the same files the wheel installs."""
    for layer in LAYERS:
        link = ROOT / "syncpoint" / layer
        assert link.is_symlink() and os.readlink(link) == f"../{layer}", link
    assert (ROOT / "syncpoint" / "py.typed").exists()


def test_run_refuses_bad_input_before_ray_starts(tmp_path, monkeypatch):
    """``syncpoint.run`` raises the CLI's SpecError (exit 2 there) for a missing file, a bad override or
    overrides given with a JobSpec; Ray is never started."""
    import syncpoint
    from tests.helpers import linear_spec

    monkeypatch.chdir(tmp_path)
    with pytest.raises(syncpoint.SpecError, match="nope.yaml"):
        syncpoint.run("nope.yaml")
    (tmp_path / "job.yaml").write_text((ROOT / "examples" / "tiny_lm.yaml").read_text())
    with pytest.raises(syncpoint.SpecError, match="train.epochs"):
        syncpoint.run(tmp_path / "job.yaml", ["train.epochs=-1"])
    with pytest.raises(syncpoint.SpecError, match="overrides apply to a job file"):
        syncpoint.run(linear_spec(tmp_path), ["train.epochs=2"])
    with pytest.raises(syncpoint.SpecError, match="--metrics-port"):  # the CLI's flag and its check
        syncpoint.run(linear_spec(tmp_path), metrics_port=70000)
    # the examples are not installed: from another directory examples.tiny_lm is not found
    with pytest.raises(syncpoint.SpecError, match="examples.tiny_lm"):
        syncpoint.run("job.yaml", [f"storage={tmp_path / 'runs'}"])
    assert not (tmp_path / "runs" / "tiny-lm" / "events").exists()


def test_a_layer_directorys_bare_name_is_refused_with_its_name_under_syncpoint(tmp_path, monkeypatch):
    """A path or a task module spelling a checkout directory's bare name (``workers.task``) is
    refused, naming the path under ``syncpoint.``: no alias is installed, so a user's own
    ``workers`` package keeps its name."""
    from syncpoint.orchestrator.cli_jobs import import_problems
    from syncpoint.policies.contracts.import_path import load_class, moved_hint

    (tmp_path / "oldtask.py").write_text("from workers.task import Task\n\ndef build(config):\n    return None\n")
    problems = import_problems(
        [("resume.policy", "policies.resume:NewestResumable"), ("task.path", "oldtask:build")], str(tmp_path)
    )
    assert len(problems) == 2, problems
    assert "did you mean 'syncpoint.policies.decisions.resume:NewestResumable'?" in problems[0]
    assert "No module named 'workers'" in problems[1] and "from syncpoint import Task" in problems[1]
    # in this process the checkout is on sys.path, where the bare names would import (as second copies)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(ROOT))])
    with pytest.raises(ValueError, match=r"did you mean 'syncpoint\.policies\.decisions\.save_triggers:EveryN'"):
        load_class("policies.save_triggers:EveryN", "wants_save")
    assert moved_hint("mypkg.workers:build") == ""


def test_a_path_written_before_the_modules_moved_names_where_they_are_now():
    """``syncpoint.policies.save_triggers:EveryN`` (before the layers were grouped by concern) fails with
    the path that imports now; a module that never existed gets no guess."""
    from syncpoint.policies.contracts.import_path import load_class, moved_hint

    with pytest.raises(
        ValueError, match=r"moved .*did you mean 'syncpoint\.policies\.decisions\.save_triggers:EveryN'"
    ):
        load_class("syncpoint.policies.save_triggers:EveryN", "wants_save")
    assert "'syncpoint.workers.training.loop'" in moved_hint("syncpoint.workers.loop")
    assert "'syncpoint.workers.task:Task'" in moved_hint("workers.task:Task")
    assert moved_hint("syncpoint.workers.nope:x") == "" and moved_hint("syncpoint.nope") == ""


def test_run_returns_the_drivers_outcome(tmp_path, monkeypatch):
    """``run`` maps the driver's outcome (``run_job``, what ``syncpoint run`` prints) to a RunResult, or
    raises RunFailed with the reason its last line states; here without Ray (the driver stubbed)."""
    import syncpoint
    import syncpoint.orchestrator.cli_jobs as cli_jobs
    import syncpoint.orchestrator.ray_runner as ray_runner
    from syncpoint.orchestrator.timeline import RunSummary
    from tests.helpers import linear_spec

    spec = linear_spec(tmp_path)
    monkeypatch.setattr(cli_jobs, "prepare_run", lambda spec, source: spec)
    summary = RunSummary(
        state="000000000016",
        optimizer_step=4,
        micro_step=16,
        wall_seconds=2.5,
        restarts=1,
        lost_micro_steps=3,
        lost_seconds=0.5,
    )
    outcomes = [
        ray_runner.JobOutcome(line="syncpoint: job 'linear' finished: ...", failed=False, summary=summary),
        ray_runner.JobOutcome(
            line="syncpoint: job 'linear' failed: ValueError: bad batch",
            failed=True,
            reason="ValueError: bad batch",
            details="a table",
        ),
    ]
    from syncpoint.workers.supervision.free_ports import free_port

    given: list[dict] = []

    def run_job(spec, address, **options):
        given.append(options)
        return outcomes.pop(0)

    monkeypatch.setattr(ray_runner, "run_job", run_job)
    result = syncpoint.run(spec)
    assert result == syncpoint.RunResult(
        name="linear",
        state="000000000016",
        optimizer_steps=4,
        micro_steps=16,
        restarts=1,
        lost_micro_steps=3,
        wall_seconds=2.5,
        run_dir=spec.run_url,
        line="syncpoint: job 'linear' finished: ...",
    )
    with pytest.raises(syncpoint.RunFailed, match="^ValueError: bad batch$") as e:
        syncpoint.run(spec, progress_bar=True, dashboard=True, metrics_port=free_port())
    assert given == [
        {"progress_bar": False, "dashboard": False, "metrics_port": None},
        {"progress_bar": True, "dashboard": True, "metrics_port": given[1]["metrics_port"]},
    ] and isinstance(given[1]["metrics_port"], int)
    assert (e.value.details, e.value.line, e.value.run_dir) == (
        "a table",
        "syncpoint: job 'linear' failed: ValueError: bad batch",
        spec.run_url,
    )
