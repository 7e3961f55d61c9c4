"""The details a state must share with the live job: tensors, param groups, schedule, generators, identities.

Why apart from ``compatibility``: each is one kind of state's own comparison, with its own wording of
what differs and how to go on; ``compatibility`` asks them in turn once the job, data and sizes agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.state_format import (
    TrainState,
)
from syncpoint.policies.decisions.live_job import LiveJob

# Identity parts newer than some states: a state without one was written before syncpoint recorded
# it, and is compared on the rest (what it never recorded cannot be told apart).
LATER_IDENTITY_KEYS = frozenset({"functions", "shuffle"})


def identity_difference(have: JSONObject, want: JSONObject) -> str | None:
    """The first part of two streams' identities that differs, in one phrase (a file by its place,
    a ``.map``/``.filter`` function by its pipeline step)."""
    # the shuffle first: another seed also lists the data files in another order
    for key in sorted(set(have) | set(want), key=lambda k: (k != "shuffle", k)):
        a, b = have.get(key), want.get(key)
        if a == b or (key in LATER_IDENTITY_KEYS and key not in have):
            continue
        if key == "functions" and isinstance(a, list) and isinstance(b, list):
            return _function_difference(a, b)
        if key == "shuffle":
            return (
                "its .shuffle(seed=...) differs (another seed reads the shards and draws the buffer in another "
                f"order: generator {short(a)} in the state, {short(b)} in this run)"
            )
        if key == "files" and isinstance(a, list) and isinstance(b, list):
            for i in range(max(len(a), len(b))):
                x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
                if x != y:
                    return f"data file {i}: {_file_text(x)} in the state, {_file_text(y)} in this run"
        return f"its {key} is {short(a)} in the state, {short(b)} in this run"
    return None


def _function_difference(have: list[Any], want: list[Any]) -> str:
    """Which ``.map``/``.filter`` step computes something else now (``syncpoint.workers.data.function_identity``)."""
    for i in range(max(len(have), len(want))):
        x, y = (have[i] if i < len(have) else None), (want[i] if i < len(want) else None)
        if x != y:
            kind = (y or x or {}).get("kind", "a step") if isinstance(y or x, dict) else "a step"
            return (
                f"its .map/.filter function {i} (pipeline step {kind}) computes something else: its code, its "
                "arguments, or the module-level values it reads changed (digest "
                f"{_digest_text(x)} in the state, {_digest_text(y)} in this run); to keep the weights with the new "
                "function, start a new run with resume.init_from: <this run> (and resume.init_optimizer: true)"
            )
    return "its .map/.filter functions differ"


def _digest_text(entry: Any) -> str:
    return str(entry.get("digest")) if isinstance(entry, dict) else "none"


def _file_text(entry: Any) -> str:
    if not isinstance(entry, dict):
        return "none"
    size = entry.get("size")
    return f"{entry.get('name')!r}" + (f" ({size} bytes)" if size is not None else "")


def short(value: Any) -> str:
    """A value as a reason quotes it: its repr, cut at 120 characters."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _shape(shape: Iterable[int]) -> str:
    dims = tuple(shape)
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def buffer_difference(s: TrainState, live: LiveJob, *, dtypes: bool) -> str | None:
    """The first buffer that differs between the state and this run (name, shape, dtype), in one
    phrase; None when both record the same (or either records none: states before the field)."""
    live_buffers = live.identity.model_buffers
    if s.model_buffers is None or live_buffers is None:
        return None
    have = {b.name: (tuple(b.shape), b.dtype) for b in s.model_buffers}
    want = {b.name: (tuple(b.shape), b.dtype) for b in live_buffers}
    for name in [*want, *(n for n in have if n not in want)]:
        if name not in have:
            return f"buffer {name}: not in the state, shape {_shape(want[name][0])} {want[name][1]} in this run"
        if name not in want:
            return f"buffer {name}: shape {_shape(have[name][0])} {have[name][1]} in the state, not in this run"
        if have[name][0] != want[name][0]:
            return f"buffer {name}: shape {_shape(have[name][0])} in the state, {_shape(want[name][0])} in this run"
        if dtypes and have[name][1] != want[name][1]:
            return f"buffer {name}: dtype {have[name][1]} in the state, {want[name][1]} in this run"
    return None


def dtype_difference(s: TrainState, live: LiveJob) -> str | None:
    """The first parameter whose dtype differs (both record dtypes), in one phrase, or None."""
    live_dtypes = live.identity.parameter_dtypes
    if s.parameter_dtypes is None or live_dtypes is None:
        return None
    have_common, have_others = s.parameter_dtypes.common, s.parameter_dtypes.others
    want_common, want_others = live_dtypes.common, live_dtypes.others
    for name in [*want_others, *(n for n in have_others if n not in want_others)]:
        have, want = have_others.get(name, have_common), want_others.get(name, want_common)
        if have != want:
            return f"parameter {name}: dtype {have} in the state, {want} in this run"
    if have_common != want_common:
        return f"parameters: dtype {have_common} in the state, {want_common} in this run"
    return None


def tensor_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """Buffers and dtypes the parameter fingerprint does not cover: another buffer name or shape
    fails DeepSpeed's load (strict), another dtype loads cast, so not exactly. Refused here, from
    the metadata, naming the tensor, before any tensor is read."""
    buffers = buffer_difference(s, live, dtypes=True)
    if buffers:
        return (
            f"model buffers differ (task): {buffers}. The state's buffers do not load into this model exactly: "
            "restore the previous model (task / task.config), or start a new run (another name, or "
            "resume.policy: fresh)"
            + ("; resume.init_from takes the weights cast to the new dtype." if "dtype" in buffers else ".")
        )
    dtypes = dtype_difference(s, live)
    if dtypes:
        return (
            f"model parameter dtypes differ (task): {dtypes}. The state's weights would load cast, not "
            "exactly: restore the previous dtype (task / task.config), or take the weights into a new run "
            "with resume.init_from (cast to the new dtype)."
        )
    return None


def generator_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """The RNG files hold the states of the task's own train-side generators, by path: a task whose
    generators are others would continue some of them from a fresh state, silently. A state
    written before they were recorded is not compared (its resume says which start fresh)."""
    if live.identity.task_generators is None or s.task_generators is None:
        return None
    have, want = s.task_generators, live.identity.task_generators
    if have == want:
        return None
    fix = (
        "Restore the task's generators as they were (the same attribute or closure, the same kind), or start a "
        "new run (another name, or resume.policy: fresh; resume.init_from takes the weights)."
    )
    for path in sorted(set(have) | set(want)):
        if path not in want:
            return (
                f"the task's own random generators differ: the state saved {path} ({have[path]}), this run's "
                f"task has no generator there (it has {sorted(want) or 'none'}). {fix}"
            )
        if path not in have:
            return (
                f"the task's own random generators differ: this run's task has {path} ({want[path]}), the state "
                f"saved no state for it (it saved {sorted(have) or 'none'}). {fix}"
            )
        if have[path] != want[path]:
            return (
                f"the task's own random generators differ: {path} is a {want[path]} in this run's task, the "
                f"state saved a {have[path]}. {fix}"
            )
    return None


def _groups_text(groups: Sequence[tuple[int, int, str | None]]) -> str:
    return (
        "["
        + ", ".join(f"{n} params / {numel} elements" for n, numel, _ in groups[:8])
        + (f", ... ({len(groups) - 8} more)" if len(groups) > 8 else "")
        + "]"
    )


def group_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """The optimizer's moments are flattened and partitioned per param group: another number or
    split of groups cannot load them (same counts with other members: the names hash differs).
    A state written before the layout was recorded had one group."""
    live_groups = live.identity.optimizer.param_groups
    if live.reset_optimizer or live_groups is None:
        return None
    want = tuple((g.params, g.numel, g.names) for g in live_groups)
    fix = (
        "Set resume.reset_optimizer: true to keep weights and position and start the optimizer state fresh, "
        "or restore the previous groups (train.optimizer.no_decay, or the task's Task.optimizer)."
    )
    recorded = s.optimizer.param_groups
    if recorded is None:
        if len(want) == 1:
            return None
        return (
            f"parameter groups differ: the state records none (it was written before syncpoint recorded them, "
            f"with one group of every parameter), this run has {len(want)} "
            f"{_groups_text(want)} (train.optimizer.no_decay / Task.optimizer). Set "
            "train.optimizer.no_decay: [] for one group, or resume.reset_optimizer: true to keep "
            "weights and position and start the optimizer state fresh."
        )
    have = tuple((g.params, g.numel, g.names) for g in recorded)
    if have == want:
        return None
    same_sizes = [g[:2] for g in have] == [g[:2] for g in want]
    return (
        f"parameter groups differ (train.optimizer.no_decay / Task.optimizer): the state has {len(have)} "
        f"{_groups_text(have)}, this run has {len(want)} {_groups_text(want)}"
        f"{' (same sizes, other parameters)' if same_sizes else ''}; the optimizer moments are stored per group. " + fix
    )


def schedule_incompatibility(s: TrainState, live: LiveJob) -> str | None:
    """Only the schedule's position is kept; another type or phase order cannot be continued."""
    sched, live_sched = s.scheduler, live.identity.scheduler
    if live.reset_schedule or live_sched is None or sched is None or sched.position is None:
        return None
    have = (sched.type, sched.phases)
    if have != (live_sched.type, live_sched.phases):
        return (
            f"train.scheduler changed from {have[0]} {have[1]} to {live_sched.type} {live_sched.phases}: a "
            "schedule of another type or phase order cannot be continued. "
            "Set resume.reset_schedule: true to restart the schedule from step 0 on these weights, or restore "
            "the previous train.scheduler."
        )
    return None
