"""Importing user code named in the spec (``package.module:Name``): tasks, resume policies, save triggers.

Why its own leaf: the spec validates the *shape* of an import path, the workers import tasks and
triggers, decisions import custom policies; all three must say the same thing about a bad path,
and none of them should import the others to get it.
"""

from __future__ import annotations

import importlib
from typing import Any


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
        raise ValueError(f"cannot import module {module_name!r} from {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from e
