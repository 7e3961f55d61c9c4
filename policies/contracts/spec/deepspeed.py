"""The spec's ``deepspeed`` section: ZeRO stage, precision, offload and passthrough settings (no secrets in them)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from syncpoint.policies.contracts.spec.bounds import (
    MAX_YAML_DEPTH,
    Strict,
)

_SECRET_WORDS = {"key", "apikey", "token", "password", "passwd", "pwd", "secret", "credential", "credentials"}


def _key_words(key: str) -> list[str]:
    """'wandb.apiKey' / 'API-KEY' / 'api_key' -> ['api', 'key'] (camelCase split, case folded)."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def _secret_keys(obj: Any, path: str = "deepspeed.config", depth: int = 0) -> list[str]:
    """Dotted paths of every key in ``obj`` (recursively, lists included) that names a secret.

    Why refuse rather than strip: DeepSpeed pickles its config into every ``mp_rank_*.pt``; a
    stripped key would silently turn a monitor off, a refusal says where the secret belongs.
    """
    found: list[str] = []
    if depth > MAX_YAML_DEPTH:
        return found
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        here = f"{path}.{k}"
        words = _key_words(str(k)) if isinstance(k, str) else []
        if isinstance(k, str) and (_SECRET_WORDS & set(words) or "".join(words) in _SECRET_WORDS):
            found.append(here)
        found += _secret_keys(v, here, depth + 1)
    return found


class DeepSpeedSpec(Strict):
    """``deepspeed``: the engine's ZeRO stage, precision, offload and clipping."""

    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description=("ZeRO stage: 1 partitions the optimizer state, 2 also the gradients, 3 also the parameters.")
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="fp16 needs scaling.use_gpu.")
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none",
        description=(
            "ZeRO-Offload: optimizer state and step on the CPU (ZeRO 1-3; Adam/AdamW use DeepSpeed's CPU Adam)."
        ),
    )
    offload_params: Literal["none", "cpu"] = Field(
        "none", description="ZeRO-Infinity parameter offload to the CPU (ZeRO 3 only)."
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Passthrough DeepSpeed config keys: not the ones syncpoint sets (batch sizes, zero_optimization, "
            "optimizer, scheduler, bf16, fp16), and no secrets (DeepSpeed stores its config in every checkpoint file, "
            "so a key that names a credential is refused)."
        ),
    )

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> DeepSpeedSpec:
        """DeepSpeed offloads only what ZeRO partitions: the optimizer from stage 1, parameters at 3."""
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                "deepspeed.offload_optimizer needs deepspeed.zero_stage 1, 2 or 3 (ZeRO 0 does not "
                "partition the optimizer, so DeepSpeed has nothing to offload)"
            )
        if self.offload_params != "none" and self.zero_stage != 3:
            raise ValueError(
                "deepspeed.offload_params needs deepspeed.zero_stage: 3 (only ZeRO-3 partitions parameters)"
            )
        return self

    @field_validator("config")
    @classmethod
    def _no_conflicts(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = {
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "train_batch_size",
            "zero_optimization",
            "optimizer",
            "scheduler",
            "bf16",
            "fp16",
        }
        clash = sorted(owned & set(v))
        if clash:
            raise ValueError(
                f"keys {clash} are set by syncpoint from train.* and deepspeed.zero_stage/precision; "
                "set them there instead"
            )
        secrets = _secret_keys(v)
        if secrets:
            raise ValueError(
                f"{', '.join(secrets[:5])} look{'s' if len(secrets) == 1 else ''} like a secret "
                "(a key, token or password). "
                "DeepSpeed stores its whole config inside every checkpoint file (mp_rank_*.pt), so it would land in "
                "storage: remove it and give it to the workers as an environment variable instead (the monitors read "
                "WANDB_API_KEY, COMET_API_KEY, ...; set it from a secret store or a Kubernetes Secret)"
            )
        return v
