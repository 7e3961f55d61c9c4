"""The spec's ``checkpoint`` section: when states are saved, how they are checked, signed and kept."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)

from syncpoint.policies.contracts.import_path import is_import_path
from syncpoint.policies.contracts.spec.bounds import (
    MAX_COUNT,
    MAX_IMPORT_PATH_CHARS,
    MAX_LEASE_TTL_S,
    MAX_PREEMPTIONS_PER_HOUR,
    MAX_STEPS,
    Strict,
)


class SaveEvery(Strict):
    """``checkpoint.save_every``: ``{value, unit}``, ``"200 micro_steps"``, ``auto`` (stored as
    ``{value: 0, unit: auto}``: the interval is decided while the run goes, see
    ``syncpoint.policies.decisions.save_interval``), or ``0`` (no periodic saves: the explicit opt-out from the
    default, ``auto``)."""

    value: float = Field(..., ge=0, le=MAX_STEPS, description="0 disables periodic saves.")
    unit: Literal["micro_steps", "optimizer_steps", "seconds", "auto"] = Field(
        ..., description=("What value counts; auto takes no value.")
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip() == "auto":
            return {"value": 0, "unit": "auto"}
        if (isinstance(v, int) and not isinstance(v, bool) and v == 0) or (isinstance(v, str) and v.strip() == "0"):
            return {"value": 0, "unit": "optimizer_steps"}  # 0: never periodically (only notices and the end)
        if isinstance(v, str):
            parts = v.split()
            if len(parts) != 2:
                raise ValueError(
                    "write it as '<number> <unit>', e.g. '200 micro_steps', {value, unit}, auto, or 0 (never)"
                )
            return {"value": parts[0], "unit": parts[1]}
        return v

    @model_validator(mode="after")
    def _integral(self) -> SaveEvery:
        if self.unit == "auto" and self.value != 0:
            raise ValueError(
                "save_every auto takes no value (the interval is computed from the measured save cost "
                "and preemption rate): write `save_every: auto`, or give a fixed interval such as "
                f"'{self.value:g} seconds'"
            )
        if self.unit not in ("seconds", "auto") and self.value != int(self.value):
            raise ValueError(f"{self.unit} must be a whole number")
        return self


class CheckpointSpec(Strict):
    """``checkpoint``: when states are saved, how they are written, verified and kept."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    save_every: SaveEvery = Field(
        default_factory=lambda: SaveEvery(value=0, unit="auto"),
        description=(
            "{value, unit}, '200 micro_steps', auto (the default: an interval from the measured save cost and the "
            "preemption rate, the first state at the first boundary), or 0 (no periodic saves: only preemption "
            "notices and the end commit a state). A request that falls mid-cycle is carried to the next sync "
            "boundary, never dropped, and the run always commits a state at its end."
        ),
    )
    save_trigger: str | None = Field(
        None, max_length=MAX_IMPORT_PATH_CHARS, description="Custom trigger 'pkg.mod:Class' (replaces save_every)."
    )

    @field_validator("save_trigger")
    @classmethod
    def _trigger_path(cls, v: str | None) -> str | None:
        if v is not None and not is_import_path(v):
            raise ValueError("must look like 'package.module:Class' (a class with wants_save(tick) -> bool)")
        return v

    expected_preemptions_per_hour: float | None = Field(
        None,
        gt=0,
        le=MAX_PREEMPTIONS_PER_HOUR,
        description=(
            "With save_every: auto, the preemption rate assumed until this run has seen its own (default 1 per hour); "
            "the estimate then moves to the observed rate."
        ),
    )
    sigterm_grace_s: float | None = Field(
        None,
        gt=0,
        le=MAX_LEASE_TTL_S,
        description=(
            "Seconds the platform waits between a SIGTERM and its SIGKILL (Kubernetes' "
            "terminationGracePeriodSeconds, a launcher's timeout). A notice commits a state at the next boundary; "
            "with a known deadline (this, or the deadline in Ray's drain notice) the run then trains on without "
            "saving and saves again at the last boundaries that can commit before it. Unset, a SIGTERM's "
            "grace window saves at every boundary."
        ),
    )
    keep_last: StrictInt = Field(3, ge=0, le=MAX_COUNT, description="Resumable states to keep; 0 keeps all.")
    prune_unsafe: bool = Field(
        False,
        description=("Also delete mid-cycle, corrupt and incompatible states older than the newest resumable one."),
    )
    export_final: bool = Field(
        True,
        description=(
            "Write the final model to <run>/final/model.safetensors (a transformers model: its save_pretrained "
            "directory, which from_pretrained loads)."
        ),
    )
    async_save: bool = Field(
        False,
        alias="async",
        description=(
            "Training does not wait for serialization, checksum or upload, which run in the background, nor for the "
            "copy of parameters and optimizer state into reusable host buffers, which is made meanwhile and waited "
            "for only before the next optimizer step, nor for the check that they are finite, made on the copies (a "
            "snapshot that is not is never committed, and its save waits for a finite boundary); the manifest "
            "commits once every rank's upload finished (at most one save in flight; the run's last save is "
            "synchronous)."
        ),
    )
    memory_copy: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Keep this node's copy of the newest committed state in shared memory (/dev/shm, or "
            "SYNCPOINT_MEMORY_DIR), written alongside every save, so a restart on the same node restores from "
            "memory instead of the object store; the copy is verified against the state's manifest like any "
            "bytes, and a missing, stale or failing copy falls back to storage (the log says which). true, false, "
            "or auto: on when storage is neither a local filesystem (states there already restore in place) nor "
            "memory://. A finished run removes its copy."
        ),
    )
    checksum: Literal["xxh3_128", "sha256"] = Field(
        "xxh3_128",
        description=(
            "Checksum of every file in a state's manifest, verified before anything is loaded: xxh3_128 "
            "(fast, guards against torn and corrupt files) or sha256 (cryptographic, ~7x slower; needed for "
            "signing)."
        ),
    )
    signing_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description=(
            "Name of an environment variable holding a key (>= 32 bytes): rank 0 signs every manifest with "
            "HMAC-SHA256, and selection refuses unsigned or wrongly signed states as untrusted. Needs "
            "checksum: sha256."
        ),
    )

    @model_validator(mode="after")
    def _rate_needs_auto(self) -> CheckpointSpec:
        if self.expected_preemptions_per_hour is not None and (self.save_every.unit != "auto" or self.save_trigger):
            raise ValueError(
                "checkpoint.expected_preemptions_per_hour is only read by checkpoint.save_every: auto "
                "(it sets the preemption rate the interval assumes before any was observed); set "
                "save_every: auto, or remove expected_preemptions_per_hour"
            )
        return self

    @model_validator(mode="after")
    def _signed_needs_sha256(self) -> CheckpointSpec:
        if self.signing_key_env and self.checksum != "sha256":
            raise ValueError(
                "checkpoint.signing_key_env needs checkpoint.checksum: sha256 (a signature over xxh3_128 "
                "checksums would not authenticate the files: xxh3 is not collision-resistant)"
            )
        return self
