"""The first hour, round 2 (issue 29): a user's mistakes end fast, with their reason on the last line.

* ``validate`` (and ``run``/``drill`` before Ray starts) resolves every import path to its object in
  a child Python, bounded in time, naming the attribute, the module's own error or the missing
  dependency;
* a bug that repeats (the same exception at the same micro-step, no new state in between) is not
  retried; ``Task.loss`` returning the wrong kind of value is refused at once;
* a diverging run fails after ``train.max_nonfinite_steps`` non-finite steps, naming the first, and
  never commits a non-finite state;
* the last line names the place (the user's file:line and function, rank, micro-step).
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from tests.helpers import EXAMPLE, cli

# ---------------------------------------------------------------- 1. import paths resolve to their objects


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A directory with a job file and the user's own modules, as the working directory."""
    tag = uuid.uuid4().hex[:8]
    (tmp_path / "job.yaml").write_text(EXAMPLE)
    modules = {
        f"task_{tag}": "def build(config):\n    return None\n\ndef schedule(position, total):\n    return 1.0\n\n"
                       "class Trigger:\n    def wants_save(self, tick):\n        return False\n",
        f"broken_{tag}": "x = 1\nraise ValueError('my module is broken')\n",
        f"needsdep_{tag}": "import json\nimport not_installed_pkg_" + tag + "\n\ndef build(config): ...\n",
        f"hangs_{tag}": "import time\ntime.sleep(600)\n\ndef build(config): ...\n",
    }
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    yield tmp_path, tag
    for name in [m for m in sys.modules if tag in m]:
        del sys.modules[name]


def test_validate_names_a_missing_attribute_with_its_close_match(user_dir, capsys):
    _, tag = user_dir
    rc, out, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=task_{tag}:buidl",
                       "--set", f"train.scheduler={{type: custom, path: task_{tag}:schedul}}")
    assert rc == 2 and not out
    assert f"task.path: 'task_{tag}:buidl': module 'task_{tag}' has no attribute 'buidl'; did you mean 'build'?" in err
    assert (f"train.scheduler.path: 'task_{tag}:schedul': module 'task_{tag}' has no attribute 'schedul'; did you "
            "mean 'schedule'?") in err
    assert f"task_{tag}" not in sys.modules  # the CLI's process never imports the user's module


def test_validate_names_the_error_of_a_module_whose_own_import_fails(user_dir, capsys):
    _, tag = user_dir
    rc, _, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=broken_{tag}:build")
    assert rc == 2
    assert (f"task.path: 'broken_{tag}:build' cannot be imported: importing 'broken_{tag}' raised ValueError: my "
            f"module is broken (at broken_{tag}.py:2)") in err


def test_a_missing_dependency_says_install_it_not_ship_the_code(user_dir, capsys):
    _, tag = user_dir
    rc, _, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=needsdep_{tag}:build")
    assert rc == 2
    assert f"importing 'needsdep_{tag}' raised ModuleNotFoundError: No module named 'not_installed_pkg_{tag}' " \
           f"(at needsdep_{tag}.py:2)" in err
    assert f"install it (e.g. `pip install not_installed_pkg_{tag}`" in err
    assert "working dir" not in err.split("task.path:", 1)[1]


def test_an_import_that_hangs_is_bounded_and_the_other_paths_still_checked(user_dir, capsys, monkeypatch):
    _, tag = user_dir
    monkeypatch.setenv("SYNCPOINT_IMPORT_CHECK_TIMEOUT_S", "2")
    began = time.monotonic()
    rc, _, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=hangs_{tag}:build",
                     "--set", f"checkpoint.save_trigger=task_{tag}:build")
    assert rc == 2 and time.monotonic() - began < 30
    assert (f"task.path: importing 'hangs_{tag}' (for 'hangs_{tag}:build') did not finish within 2 s "
            "(SYNCPOINT_IMPORT_CHECK_TIMEOUT_S)") in err
    # the next path, checked in a fresh child after the hang: a function where a trigger class belongs
    assert f"checkpoint.save_trigger: 'task_{tag}:build' is a function, not a class with a wants_save() method" in err


def test_validate_accepts_what_resolves_and_marks_what_a_task_optimizer_replaces(user_dir, capsys):
    _, tag = user_dir
    rc, out, err = cli(capsys, "validate", "job.yaml", "--set", f"task.path=task_{tag}:build",
                       "--set", f"checkpoint.save_trigger=task_{tag}:Trigger", "--set", "checkpoint.async=true")
    assert rc == 0, err
    assert '"async": true' in out and "async_save" not in out  # the spec field as the docs spell it
    assert "train.lr and train.optimizer build the optimizer only for a task without Task.optimizer" in err


def test_run_refuses_a_misspelt_attribute_before_ray_starts(user_dir, capsys):
    tmp_path, tag = user_dir
    runs = tmp_path / "runs"
    for command in (["run"], ["drill", "--preempt-at", "3"]):
        rc, _, err = cli(capsys, *command[:1], "job.yaml", *command[1:], "--set", f"task.path=task_{tag}:buidl",
                         "--set", f"storage={runs}")
        assert rc == 2 and "has no attribute 'buidl'" in err
    assert not runs.exists()
