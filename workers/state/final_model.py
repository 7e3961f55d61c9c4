"""``syncpoint.load_model``: a run's trained model back as your own module, without Ray or DeepSpeed.

Why rebuild instead of unpickling a module: ``final/`` holds the weights as safetensors (tensors only)
and, since it carries what rebuilds the model (``spec.json``, the task's path and config in
``info.json``; ``syncpoint.workers.state.export``), the model's *code* is the task's own: the task
function the spec named is imported and called with the spec's config, exactly as every rank did at
the run's start, and the weights are loaded into the module it returns (every parameter and
persistent buffer checked by name and shape first, tied weights once, as ``resume.init_from`` loads
a pretrained directory). A Hugging Face model's ``final/`` is its ``save_pretrained`` directory and
loads the same way (``from_pretrained`` works on it too).

Reads are a state's: bounded, regular files only, never through a link, JSON and safetensors only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator

import numpy as np
import torch

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import ModelLoadError, ResumeRefused, TaskError
from syncpoint.policies.contracts.import_path import is_import_path
from syncpoint.policies.decisions.redact import redact_url
from syncpoint.workers.state.export import FINAL_FORMAT, SPEC_FILE
from syncpoint.workers.state.pretrained import CONFIG_FILE, check_and_load, model_bytes_bound, read_pretrained
from syncpoint.workers.storage import RunStorage

FINAL_DIR = "final"
INFO_FILE = "info.json"
MAX_JSON_BYTES = 16 << 20  # a spec or info.json: kilobytes
FIELD = "load_model"
REBUILT_OTHER = (
    "The task builds another model now than the one the run trained (its code or the config it reads changed "
    "since): restore the task's code as it ran"
)


def load_model(run_or_final: str | os.PathLike[str]) -> torch.nn.Module:
    """The trained model of a finished run: the task's own module with the weights of ``final/``.

    Args:
        run_or_final: the run directory (``<storage>/<name>``, as ``RunResult.run_dir``) or its
            ``final/``; a local path or any fsspec URL (``s3://...``).

    Returns:
        The module ``Task.model`` is, built by the task function the run's spec names
        (``task.path`` with ``task.config``), with the trained parameters and persistent buffers,
        on the CPU, in eval mode. Built and loaded in this process: no Ray, no DeepSpeed.

    Raises:
        ModelLoadError: no ``final/`` (the run has not finished, or ``checkpoint.export_final`` was
            false), one written before ``final/`` carried the task, a task that cannot be imported
            here, or weights that do not fit the model the task builds now (naming the tensors).

    Security: nothing is unpickled (JSON and safetensors, read bounded, regular files only, never
    through a link). Rebuilding the model imports and calls the task function the spec names: that
    executes the task's code, as running the job did on every rank, so load only runs whose code you
    would run. The module must be importable here (run from the directory the job ran from, or
    install the package); credentials in ``task.config`` were redacted (``***``) when it was written.
    """
    shown = redact_url(os.fspath(run_or_final))
    final = _final(os.fspath(run_or_final), shown)
    spec = _read_json(final, SPEC_FILE, shown)
    path, config = _task_of(spec, _read_json(final, INFO_FILE, shown), shown)
    module = _build(path, config, shown)
    try:
        hf = final.exists(CONFIG_FILE)
        found = read_pretrained(final, model_bytes_bound(module), field=FIELD, config=hf)
        check_and_load(module, found, f"{shown} (built by {path})", field=FIELD, hint=REBUILT_OTHER)
    except ResumeRefused as e:
        raise ModelLoadError(str(e)) from None
    except OSError as e:
        raise ModelLoadError(f"{FIELD}: the weights in {shown} could not be read ({e})") from None
    return module.eval()


def _final(url: str, shown: str) -> RunStorage:
    """The ``final/`` directory: ``url`` itself, or ``url/final`` of a run directory."""
    storage = RunStorage(url)
    if storage.exists(FINAL_DIR, INFO_FILE):
        return RunStorage(storage.url_of(FINAL_DIR))
    if storage.exists(INFO_FILE):
        return storage
    raise ModelLoadError(
        f"{FIELD}: {shown} is neither a run directory with a final/ nor a final/ directory (no info.json). A run "
        "writes final/ when it finishes, unless checkpoint.export_final is false; pass the run directory "
        "(RunResult.run_dir, <storage>/<name>) of a finished run"
    )


def _read_json(final: RunStorage, name: str, shown: str) -> JSONObject:
    try:
        data = final.read_bytes(name, limit=MAX_JSON_BYTES)
    except FileNotFoundError:
        raise ModelLoadError(
            f"{FIELD}: {shown} has no final/{name}: its final/ was written by a syncpoint before final/ carried "
            "the task (format " + FINAL_FORMAT + "). Rebuild the model with your task function and load "
            "final/model.safetensors into it with safetensors.torch.load_file, or run the job again"
        ) from None
    except OSError as e:
        raise ModelLoadError(f"{FIELD}: {shown}'s final/{name} could not be read ({e})") from None
    try:
        value = json.loads(data)
    except ValueError as e:
        raise ModelLoadError(f"{FIELD}: {shown}'s final/{name} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{FIELD}: {shown}'s final/{name} is not a JSON object")
    return value


def _task_of(spec: JSONObject, info: JSONObject, shown: str) -> tuple[str, JSONObject]:
    """The task path and config the spec names; ``info.json`` must name the same task (both are
    the writer's: a mismatch is an edited ``final/``, not loaded)."""
    task = spec.get("task")
    path = task.get("path") if isinstance(task, dict) else None
    config = task.get("config") if isinstance(task, dict) else None
    if not isinstance(path, str) or not is_import_path(path) or not isinstance(config, dict):
        raise ModelLoadError(f"{FIELD}: {shown}'s final/{SPEC_FILE} names no task (task.path, task.config)")
    if info.get("task") != path or info.get("task_config", config) != config:
        raise ModelLoadError(
            f"{FIELD}: {shown}'s final/{INFO_FILE} names the task {info.get('task')!r}, its {SPEC_FILE} {path!r} "
            "(or another config): final/ was edited after the run wrote it; not loaded"
        )
    return path, config


@contextlib.contextmanager
def _rngs_kept() -> Iterator[None]:
    """The task function draws its initialisation from the global streams: the caller's stay as they were."""
    py, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(np_state)


def _build(path: str, config: JSONObject, shown: str) -> torch.nn.Module:
    from syncpoint.workers.task import load_task

    try:
        with _rngs_kept():
            return load_task(path, config).model
    except TaskError as e:
        raise ModelLoadError(
            f"{FIELD}: the model of {shown} cannot be rebuilt here: {e}. Its task must be importable in this "
            "process (run from the directory the job ran from, or install its package)"
        ) from None
