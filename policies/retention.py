"""Retention: which state directories may be deleted after a new state commits.

Rules (the contract): keep the ``keep_last`` newest *resumable* states (0 keeps all); never
delete the newest resumable state; unsafe candidates never count toward ``keep_last`` and never
displace a resumable one. Torn directories older than the newest resumable state are debris of
crashed saves and go; torn ones newer than it may be a save in flight and stay. Mid-cycle,
corrupt and incompatible states are reported and only removed with ``prune_unsafe``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.candidates import Candidate, Verdict, newest_first


@dataclass
class RetentionPlan:
    delete: list[str] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)
    reported: list[str] = field(default_factory=list)  # unsafe states left in place, with reasons


def plan_retention(candidates: list[Candidate], keep_last: int, prune_unsafe: bool = False) -> RetentionPlan:
    plan = RetentionPlan()
    ordered = newest_first(candidates)
    resumable = [c for c in ordered if c.verdict is Verdict.RESUMABLE]
    if not resumable:
        # Nothing safe to anchor on: deleting anything could strand the run.
        plan.keep = [c.name for c in ordered]
        return plan
    newest_key = resumable[0].sort_key
    kept_resumable = resumable if keep_last <= 0 else resumable[:max(1, keep_last)]
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
