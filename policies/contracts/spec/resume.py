"""The spec's ``resume`` section: where a run starts (the resume policy, fine-tuning, opt-outs, the lease)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from syncpoint.policies.contracts.import_path import is_import_path
from syncpoint.policies.contracts.spec.bounds import (
    BUILTIN_POLICIES,
    MAX_IMPORT_PATH_CHARS,
    MAX_LEASE_TTL_S,
    MAX_PATH_CHARS,
    Strict,
)


class ResumeSpec(Strict):
    """``resume``: the policy that chooses where a submission starts, and the opt-outs it may take."""

    policy: str = Field(
        "newest-resumable",
        max_length=MAX_IMPORT_PATH_CHARS,
        description=(
            "newest-resumable, pinned, fresh, best-metric, or your own 'pkg.mod:Class'. A Ray "
            "restart inside one submission continues from that submission's newest state "
            "whatever the policy."
        ),
    )

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, v: str) -> str:
        if v not in BUILTIN_POLICIES and not is_import_path(v):
            raise ValueError(f"must be one of {', '.join(BUILTIN_POLICIES)}, or 'package.module:Class' for your own")
        return v

    policy_args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Keyword arguments for the policy, e.g. pinned: {state: 120}, best-metric: {metric: loss, mode: min}; "
            "a built-in's are checked against its own model before anything starts."
        ),
    )
    init_from: str | None = Field(
        None,
        max_length=MAX_PATH_CHARS,
        description=(
            "A state URL, a run directory (its newest committed state), or a Hugging Face save_pretrained directory "
            "(config.json and safetensors weights: a local copy of a hub model, another run's final/) to take "
            "weights from: fine-tuning. Never its position, RNG or data position; once this run has its own "
            "resumable state, that wins."
        ),
    )
    init_optimizer: bool = Field(False, description="With init_from: also import optimizer state.")
    init_from_signing_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description=(
            "With init_from: the environment variable holding the source run's signing key; its state must be "
            "signed with it. Default: this run's checkpoint.signing_key_env, when set."
        ),
    )
    reset_schedule: bool = Field(
        False,
        description=(
            "Opt-out: restart the LR schedule at 0 when the scheduler type or phases changed (otherwise refused)."
        ),
    )
    allow_user_state_change: bool = Field(
        False,
        description=(
            "Opt-out: resume although the task's Task.stateful names differ from the state's: objects the "
            "state saved and the task no longer has are dropped, objects the task added start from their own "
            "state. Without it such a change is refused at selection."
        ),
    )
    reset_optimizer: bool = Field(
        False,
        description=(
            "Opt-out: keep the state's weights and position but start the optimizer state (moments) fresh, e.g. "
            "after changing train.optimizer.type. Without it such a change is refused at selection."
        ),
    )
    on_existing: Literal["refuse", "archive", "overwrite"] = Field(
        "refuse",
        description=(
            "With policy: fresh on a run directory that has states: refuse, archive (move them to archive/) or "
            "overwrite."
        ),
    )
    lease_ttl_s: float = Field(
        60.0,
        gt=0,
        le=MAX_LEASE_TTL_S,
        description=(
            "The run directory's lease expires this long after its owner's last heartbeat; then a successor of the "
            "same job may take over. A re-submission waits (at most that long, plus a margin) for a dead holder's "
            "lease to expire instead of being refused."
        ),
    )
