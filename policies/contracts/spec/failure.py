"""The spec's ``failure`` and ``faults`` sections: restart budgets, the placement bound, and injected crashes."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    model_validator,
)

from syncpoint.policies.contracts.spec.bounds import (
    MAX_COUNT,
    MAX_LEASE_TTL_S,
    MAX_MICRO_STEPS,
    MAX_WORKERS,
    Strict,
)


class FailureSpec(Strict):
    """Named after Ray Train's ``FailureConfig``."""

    max_failures: StrictInt = Field(
        0,
        ge=-1,
        le=MAX_COUNT,
        description=("Application-error restarts (Ray's FailureConfig.max_failures; -1: unlimited)."),
    )
    max_preemptions: StrictInt = Field(
        -1,
        ge=-1,
        le=MAX_COUNT,
        description=(
            "Preemption restarts (Ray's max_preemption_failures; -1: unlimited). Preemptions never count against "
            "max_failures."
        ),
    )
    placement_timeout_s: float = Field(
        900.0,
        gt=0,
        le=MAX_LEASE_TTL_S,
        description=(
            "How long the run waits in a row for room to place its workers (at start or after a lost node) "
            "before it fails with a message; Ray Train alone would wait forever. Checked each time Ray "
            "Train's worker-group start times out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by default)."
        ),
    )
    in_place: StrictBool = Field(
        True,
        description=(
            "Recover a rank that crashed or raised, while every node lives, inside the same Ray Train worker group: "
            "each worker supervises its training process and starts a new one (forked with torch and DeepSpeed "
            "already imported), and every rank resumes from the newest committed state (from the node's memory "
            "copy when it has one). Same budgets and verdicts as a Ray Train restart. false: every failure "
            "restarts the worker group."
        ),
    )
    warm_nodes: StrictBool = Field(
        True,
        description=(
            "With in_place on CPU ranks: keep one warm training-process server (torch and DeepSpeed imported) on "
            "every node that can host a rank, for the job's length, so a new worker group (a Ray Train restart, a "
            "lost node's replacement already in the cluster, the first one on an embedded run) forks its training "
            "processes from it instead of importing them again; and, on each node that hosts ranks, as many spare Ray "
            "worker processes for the job's next worker group as it has ranks, so that group's actors start without "
            "new processes. Costs each node one idle process (~0.5 GB here) and one per rank (~0.2 GB). "
            "false: each worker starts its own server, which ends with it, and no spares."
        ),
    )


class CrashFault(Strict):
    """Rehearse preemption: crash ``rank`` once per run, at a micro-step or a save phase.

    ``phase`` picks the save by its ordinal (``at_save``, the attempt's saves) or, with
    ``at_micro_step``, as the first save at or after that micro-step: a storm drill places a crash
    inside a save at a point of the run without knowing how many saves earlier attempts made."""

    rank: StrictInt = Field(0, ge=0, le=MAX_WORKERS, description="The rank to crash.")
    at_micro_step: StrictInt | None = Field(
        None,
        ge=1,
        le=MAX_MICRO_STEPS,
        description=("The micro-step to fire after; with phase: the first save at or after this micro-step."),
    )
    phase: (
        Literal[
            "before_shards",
            "after_some_shards",
            "before_manifest",
            "during_manifest",
            "before_retention",
            "during_retention",
        ]
        | None
    ) = Field(
        None,
        description=(
            "Crash inside a save at this phase; before_manifest, during_manifest and during_retention run on rank 0 "
            "only."
        ),
    )
    at_save: StrictInt = Field(
        1, ge=1, le=MAX_COUNT, description=("With phase (and no at_micro_step): which save (1 = first) of the attempt.")
    )
    mode: Literal["exit", "raise", "sigterm", "hold"] = Field(
        "exit",
        description="exit: os._exit (hard crash); raise: exception (in-process tests); sigterm: a preemption "
        "notice, then the process dies after the next boundary's save (at_micro_step only); "
        "hold: the rank stops after the micro-step and waits, bounded, for its node to be taken "
        "away (the storm drill's node loss at an exact point; at_micro_step only).",
    )

    @model_validator(mode="after")
    def _one_trigger(self) -> CrashFault:
        if self.at_micro_step is None and self.phase is None:
            raise ValueError(
                "a fault needs at_micro_step, phase, or both (phase with at_micro_step: the first save "
                "at or after that micro-step)"
            )
        # at_save's default (1) is what a dumped spec carries to the workers: only another value conflicts
        if self.phase is not None and self.at_micro_step is not None and self.at_save != 1:
            raise ValueError(
                "give phase with at_save (the attempt's Nth save) or with at_micro_step (the first save "
                "at or after it), not both"
            )
        if self.mode in ("sigterm", "hold") and (self.phase is not None or self.at_micro_step is None):
            raise ValueError(f"mode {self.mode} needs at_micro_step and no phase (it fires between micro-steps)")
        if self.phase in ("before_manifest", "during_manifest", "during_retention") and self.rank != 0:
            raise ValueError(
                f"phase {self.phase} happens on rank 0 only (it writes the manifest and runs "
                "retention): use rank: 0, or a phase every rank passes (before_shards, "
                "after_some_shards, before_retention)"
            )
        return self

    @property
    def fault_id(self) -> str:
        if self.phase is None:
            where = f"step{self.at_micro_step}"
        elif self.at_micro_step is None:
            where = f"{self.phase}-save{self.at_save}"
        else:
            where = f"{self.phase}-from-step{self.at_micro_step}"
        return f"rank{self.rank}-{where}"
