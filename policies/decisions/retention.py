"""Retention: which state directories may be deleted after a new state commits.

Rules (the contract): keep the ``keep_last`` newest *resumable* states (0 keeps all); never
delete the newest resumable state; unsafe candidates never count toward ``keep_last`` and never
displace a resumable one. Torn directories older than the newest resumable state are debris of
crashed saves and go; torn ones newer than it may be a save in flight and stay. Mid-cycle,
corrupt and incompatible states are reported and only removed with ``prune_unsafe``.

Only what syncpoint wrote is ever a candidate for deletion: a directory (never a file, never a
symbolic link) whose name is a state name (12 ASCII digits, ``syncpoint.policies.contracts.state_format.state_name``).
Anything else under ``states/`` (a ``notes/`` folder, a ``README.txt``) is someone else's and is
ignored; a symbolic link is reported as corrupt and left alone, because deleting through it would
delete its target, outside the run. Deletion itself stays manifest-first
(``syncpoint.workers.state.writer.delete_state``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from syncpoint.policies.contracts.state_format import is_state_name
from syncpoint.policies.decisions.candidates import Candidate, Verdict, newest_first


@dataclass
class RetentionPlan:
    """What one retention pass does with each entry of ``states/`` (every name lands in one list)."""

    delete: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    reported: list[str] = field(default_factory=list)  # unsafe states left in place, with reasons
    ignored: list[str] = field(default_factory=list)  # not syncpoint's: never considered


def _not_ours(c: Candidate, kinds: Mapping[str, str] | None) -> str | None:
    """Why retention must leave ``c`` alone whatever its verdict (``None``: it is a state of ours).

    ``kinds`` is the storage's word on each entry (``dir``/``file``/``link``/``other``, from a
    listing that does not follow links); without it only the name and the candidate's own
    ``symlink`` flag decide.
    """
    kind = kinds.get(c.name, "missing") if kinds is not None else "dir"
    if c.symlink or kind == "link":
        return "corrupt (a symbolic link, not a directory syncpoint wrote: never followed, left alone)"
    if kind != "dir":
        return f"not a directory ({kind}): left alone"
    return None


def plan_retention(
    candidates: list[Candidate], keep_last: int, prune_unsafe: bool = False, kinds: Mapping[str, str] | None = None
) -> RetentionPlan:
    """Which states to delete so that retention never strands the run (the brief's rule 4).

    The newest resumable state is always kept, and nothing is deleted when no state is resumable;
    torn saves older than it go, unsafe ones are reported and kept (unless ``prune_unsafe``), and
    anything that is not a directory syncpoint wrote (another name, a link, a file) is never touched.

    Args:
        candidates: the classified states of the run, any order.
        keep_last: resumable states to keep, newest first (``<= 0``: all of them).
        prune_unsafe: also delete mid-cycle, corrupt, incompatible and untrusted states older than
            the newest resumable one (``checkpoint.prune_unsafe``).
        kinds: the storage's listing of ``states/`` without following links (name -> ``dir``,
            ``file``, ``link`` or ``other``); ``None`` trusts the candidates' own ``symlink`` flag.
    """
    plan = RetentionPlan()
    ordered: list[Candidate] = []
    for c in newest_first(candidates):
        if not is_state_name(c.name):
            plan.ignored.append(c.name)
            continue
        why = _not_ours(c, kinds)
        if why:
            plan.keep.append(c.name)
            plan.reported.append(f"{c.name}: {why}")
            continue
        ordered.append(c)
    resumable = [c for c in ordered if c.verdict is Verdict.RESUMABLE]
    if not resumable:
        # Nothing safe to anchor on: deleting anything could strand the run.
        plan.keep += [c.name for c in ordered]
        return plan
    newest_key = resumable[0].sort_key
    kept_resumable = resumable if keep_last <= 0 else resumable[: max(1, keep_last)]
    keep_names = {c.name for c in kept_resumable}
    for c in ordered:
        if c.verdict is Verdict.RESUMABLE:
            (plan.keep if c.name in keep_names else plan.delete).append(c.name)
        elif c.verdict is Verdict.TORN:
            (plan.delete if c.sort_key < newest_key else plan.keep).append(c.name)
        elif prune_unsafe and c.sort_key < newest_key:
            plan.delete.append(c.name)
        else:
            plan.keep.append(c.name)
            plan.reported.append(f"{c.name}: {c.verdict.value if c.verdict else '?'} ({c.reason})")
    return plan
