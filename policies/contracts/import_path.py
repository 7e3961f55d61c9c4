"""Importing user code named in the spec (``package.module:Name``): tasks, resume policies, save triggers.

Why its own leaf: the spec validates the *shape* of an import path, the workers import tasks and
triggers, decisions import custom policies; all three must say the same thing about a bad path,
and none of them should import the others to get it.

Why the kind of object is checked before it is called: every path is called with arguments someone
else chose (``--policy-args``, ``resume.policy_args``, the task's config, the schedule's counters),
and any importable callable fits an import path: ``os:system`` called with ``{"command": ...}``
runs a shell command, ``subprocess:run`` called with a dict runs its keys. ``load_class`` accepts
only a class defining the method its role needs, ``load_function`` only a function written in
Python; nothing else is ever called.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

# The checkout's top-level directories, importable only under ``syncpoint.`` (``syncpoint.workers``):
# generic names a user's own package may hold, so a path naming them is only looked up, never
# rewritten; when the lookup fails, the message names the path under ``syncpoint.``.
LAYER_NAMES = ("orchestrator", "workers", "policies")
# The sub-packages a layer's modules moved into when the layers were grouped by concern: a path
# written before (``syncpoint.policies.save_triggers:EveryN``) is answered with where it lives now.
SUB_PACKAGES = {"workers": ("training", "supervision", "observation"), "policies": ("contracts", "decisions")}


def moved_hint(name: str) -> str:
    """A hint for ``name`` (a module or an import path that failed to import) when it names one of
    syncpoint's modules the way a file browser shows it (``workers.task``: "syncpoint's own modules
    are under syncpoint.") or where it lived before its layer was grouped by concern
    (``syncpoint.policies.resume``: "moved"), with the path that imports now; else empty."""
    module, colon, attr = name.partition(":")
    parts = module.split(".")
    bare = parts[0] in LAYER_NAMES
    if bare:
        parts = ["syncpoint", *parts]
    if len(parts) < 2 or parts[0] != "syncpoint" or parts[1] not in LAYER_NAMES:
        return ""
    now = _current_module(".".join(parts))
    if now is None and not bare:
        return ""
    suggestion = f"{now or '.'.join(parts)}{colon}{attr}"
    if bare:
        return f"; syncpoint's own modules are under syncpoint. (did you mean '{suggestion}'?)"
    return f"; that module moved when syncpoint grouped its modules by concern (did you mean '{suggestion}'?)"


def _current_module(module: str) -> str | None:
    """``module`` if it imports, else the module of that name in one of its layer's sub-packages."""
    parts = module.split(".")
    candidates = [module] + [".".join([*parts[:2], sub, *parts[2:]]) for sub in SUB_PACKAGES.get(parts[1], ())]
    for candidate in candidates:
        try:
            if importlib.util.find_spec(candidate) is not None:
                return candidate
        except (ImportError, ValueError):
            continue
    return None


def is_import_path(value: str) -> bool:
    """``package.module:Name`` with identifiers only (no file paths, no call syntax)."""
    module, _, attr = value.partition(":")
    return bool(module and attr) and all(p.isidentifier() for p in module.split(".")) and attr.isidentifier()


def load_object(path: str) -> Any:
    """Import ``package.module:Name``; the error names the path and what to fix."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = moved_hint(path) if moved_hint(e.name or "") else ""
        raise ValueError(f"cannot import module {module_name!r} from {path!r}: {e}{hint}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from e


def load_class(path: str, method: str) -> type:
    """Import ``package.module:Class`` and check, before anything calls it, that it is a class whose
    ``method`` is a function written in Python (a policy's ``choose``, a trigger's ``wants_save``)."""
    obj = load_object(path)
    if not isinstance(obj, type) or not inspect.isfunction(getattr(obj, method, None)):
        raise ValueError(f"{path!r} is {_kind(obj)}, not a class with a {method}() method; it is not called")
    return obj


def load_function(path: str) -> Callable[..., Any]:
    """Import ``package.module:function`` and check, before anything calls it, that it is a function
    written in Python (not a builtin such as ``os.system``, not a class)."""
    obj = load_object(path)
    if not inspect.isfunction(obj):
        raise ValueError(f"{path!r} is {_kind(obj)}, not a function written in Python; it is not called")
    return obj


def _kind(obj: Any) -> str:
    if inspect.isbuiltin(obj):
        return "a builtin function"
    if isinstance(obj, type):
        return f"the class {obj.__qualname__[:80]}"
    if inspect.isfunction(obj):
        return "a function"
    return f"a value of type {type(obj).__name__[:80]}"
