"""``Task.stateful``: the task's own stateful objects, saved with every state and restored exactly.

An EMA of the weights, a curriculum, a teacher's schedule, a data mixture's weights: objects with
``state_dict()`` / ``load_state_dict()`` that the engine does not own. Each rank saves its own (they
may differ per rank) at every state, in ``user/rank_<r:05d>.safetensors``
(``syncpoint.policies.contracts.state_format.user_file``), through the stream state's codec: tensors as
safetensors, everything else as JSON, never pickled (``syncpoint.workers.data.stream_state``), so
storage cannot make a resume run code. Captured at the boundary itself (an asynchronous save then
holds a copy: the objects may change while the upload runs), restored before the first fetch,
after the engine's load, and covered by the state's digest. Which names a state holds is in its
``trainer.json`` (``user_state``), so selection refuses a task whose names differ before anything
is read (``resume.allow_user_state_change`` is the opt-out).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from syncpoint.policies.contracts.errors import StateRefused, TaskError
from syncpoint.policies.contracts.state_format import MAX_USER_STATE_OBJECTS, USER_STATE_NAME
from syncpoint.workers.data.stream_state import TreeLabel, encode_tree, parse_tree

__all__ = ["UserStateError", "capture", "check", "names", "parse", "restore"]

META_KEY = "user_state"


class UserStateError(TaskError):
    """A ``Task.stateful`` object cannot be saved or restored exactly (the object is named)."""


LABEL = TreeLabel(
    "Task.stateful's state",
    "Make each object's state_dict() return only those (tensors for arrays, lists for sequences)",
    UserStateError,
)


def check(path: str, stateful: Any) -> None:
    """``Task.stateful`` as the loop needs it, or ``TaskError`` naming the entry and the fix: a dict of
    plain names (letters, digits, ``_.-``; at most 64 of them) to objects with callable
    ``state_dict()`` and ``load_state_dict()``."""
    if not isinstance(stateful, Mapping):
        raise TaskError(
            f"task.path: {path!r} returned Task.stateful of type {type(stateful).__name__}: it must be a dict of "
            "name -> object with state_dict()/load_state_dict()"
        )
    if len(stateful) > MAX_USER_STATE_OBJECTS:
        raise TaskError(
            f"task.path: {path!r} returned {len(stateful)} Task.stateful objects; at most {MAX_USER_STATE_OBJECTS} "
            "(group related ones into one object)"
        )
    for name, obj in stateful.items():
        if not isinstance(name, str) or not re.match(USER_STATE_NAME, name):
            raise TaskError(
                f"task.path: {path!r}: Task.stateful name {name!r} is not a plain name: use 1-64 letters, digits, "
                "'_', '.' or '-'"
            )
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TaskError(
                f"task.path: {path!r}: Task.stateful[{name!r}] is a {type(obj).__name__}, which has no "
                "state_dict()/load_state_dict(): give it both (a torch.nn.Module, an optimizer and a "
                "torch.optim.swa_utils.AveragedModel have them), or keep it out of Task.stateful"
            )


def names(stateful: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The sorted names a state records, or None when the task has no user state."""
    return tuple(sorted(stateful)) if stateful else None


def capture(stateful: Mapping[str, Any]) -> bytes | None:
    """This rank's user file, or None when the task has no user state (``UserStateError`` naming
    the object and the value the file cannot hold)."""
    if not stateful:
        return None
    objects = {}
    for name in sorted(stateful):
        try:
            objects[name] = stateful[name].state_dict()
        except Exception as e:
            raise UserStateError(f"Task.stateful[{name!r}].state_dict() raised {type(e).__name__}: {e}") from e
    return encode_tree({"objects": objects}, META_KEY, LABEL)


def parse(data: bytes, rel: str, expected: tuple[str, ...]) -> dict[str, object]:
    """A user file read back whole: exactly the ``expected`` names (those the state's record lists);
    ``StateRefused`` (corrupt) otherwise."""
    objects = parse_tree(data, rel, META_KEY, ("objects",), "user state")["objects"]
    if not isinstance(objects, dict) or sorted(objects) != sorted(expected):
        found = sorted(objects) if isinstance(objects, dict) else type(objects).__name__
        raise StateRefused(f"{rel}: holds {found}, the state records {list(expected)}: refused (corrupt)")
    return objects


def restore(stateful: Mapping[str, Any], saved: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Load each saved object into the task's one of the same name; returns (the names the task has
    and the state did not save, which keep their own state; the names the state saved and the task
    lacks, dropped): both empty unless ``resume.allow_user_state_change`` let them through.
    ``StateRefused`` naming the object when its ``load_state_dict`` raises: the candidate is refused
    like one whose files do not load."""
    for name in sorted(saved):
        if name not in stateful:
            continue  # dropped by the task (allowed at selection)
        try:
            stateful[name].load_state_dict(saved[name])
        except Exception as e:  # noqa: BLE001 - any failure to load it refuses this candidate, which falls back
            raise StateRefused(
                f"Task.stateful[{name!r}].load_state_dict() raised {type(e).__name__}: {str(e)[:300]}: refused"
            ) from None
    return sorted(set(stateful) - set(saved)), sorted(set(saved) - set(stateful))
