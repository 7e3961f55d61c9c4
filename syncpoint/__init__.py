"""syncpoint: DeepSpeed training on Ray whose preemptions are a non-event (boundary-exact resume).

The public surface is what ``__all__`` lists; everything else (``syncpoint.orchestrator``, the
driver; ``syncpoint.workers``, what runs on each rank; ``syncpoint.policies``, the pure decisions)
is internal and may change between releases.

* ``Task``: what your ``build(config)`` function (the spec's ``task.path``) returns.
* ``ShardedCorpus``: a map-style dataset over many shard files, for a ``Task``'s ``dataset``.
* ``TokenWindows``: one token array (nanoGPT's ``.bin``, a ``.npy``) cut into ``seq_len``-token
  inputs and their shifted targets, in random or sequential windows, for a ``Task``'s ``dataset``.
* ``JobSpec``: the job spec (a pydantic model); ``load_spec(path, overrides)`` reads one from a
  YAML file with ``--set``-style overrides, exactly as the CLI does.
* ``run(spec)``: run a job as ``syncpoint run`` does and return a ``RunResult``; bad input raises
  ``SpecError``, a failed run ``RunFailed``.
* ``ResumePolicy``, ``Decision``, ``Candidate``, ``Verdict``: what your own resume policy
  (``resume.policy``) subclasses, returns and reads; ``SaveTrigger`` and ``Tick``: the same for your
  own save trigger (``checkpoint.save_trigger``).
* ``load_model(run_dir)``: a finished run's trained model as the task's own module (its weights from
  ``final/``), built in this process without Ray or DeepSpeed.

Why the names resolve lazily: ``import syncpoint`` stays cheap (no torch, Ray or pydantic) for a
script that only reads ``__version__`` or passes a spec file to ``run``; each name imports its
module on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from syncpoint._api import RunFailed, RunResult, run
    from syncpoint.orchestrator.spec_file import load_spec
    from syncpoint.policies.contracts.errors import SpecError
    from syncpoint.policies.contracts.spec import JobSpec
    from syncpoint.policies.decisions.candidates import Candidate, Verdict
    from syncpoint.policies.decisions.resume import Decision, ResumePolicy
    from syncpoint.policies.decisions.save_triggers import SaveTrigger, Tick
    from syncpoint.workers.data.corpus import ShardedCorpus
    from syncpoint.workers.data.windows import TokenWindows
    from syncpoint.workers.state.final_model import load_model
    from syncpoint.workers.task import Task

__all__ = [
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

# name -> the module that defines it
_LAZY = {
    "Candidate": "syncpoint.policies.decisions.candidates",
    "Decision": "syncpoint.policies.decisions.resume",
    "JobSpec": "syncpoint.policies.contracts.spec",
    "ResumePolicy": "syncpoint.policies.decisions.resume",
    "RunFailed": "syncpoint._api",
    "RunResult": "syncpoint._api",
    "SaveTrigger": "syncpoint.policies.decisions.save_triggers",
    "ShardedCorpus": "syncpoint.workers.data.corpus",
    "SpecError": "syncpoint.policies.contracts.errors",
    "Task": "syncpoint.workers.task",
    "Tick": "syncpoint.policies.decisions.save_triggers",
    "TokenWindows": "syncpoint.workers.data.windows",
    "Verdict": "syncpoint.policies.decisions.candidates",
    "load_model": "syncpoint.workers.state.final_model",
    "load_spec": "syncpoint.orchestrator.spec_file",
    "run": "syncpoint._api",
}


def _version() -> str:
    """The installed distribution's version; in a checkout nobody installed, its pyproject's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("syncpoint")
    except PackageNotFoundError:
        pass
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        found = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text())
    except OSError:
        found = None
    return found.group(1) if found else "0+unknown"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if name == "__version__":  # importlib.metadata alone costs more than the rest of `import syncpoint`
        value: Any = _version()
    elif module is None:
        raise AttributeError(f"module 'syncpoint' has no attribute {name!r}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
