"""The spec's ``scaling`` section: workers (a fixed number or an elastic range), their resources and environment."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    Discriminator,
    Field,
    StrictInt,
    Tag,
    field_validator,
    model_validator,
)

from syncpoint.policies.contracts.spec.bounds import (
    MAX_COLLECTIVE_TIMEOUT_S,
    MAX_CPUS_PER_WORKER,
    MAX_WORKERS,
    Strict,
)


class ElasticWorkers(Strict):
    """``scaling.num_workers: {min, max}``: the world sizes an elastic run may continue on."""

    min: StrictInt = Field(..., ge=1, le=MAX_WORKERS, description="The fewest workers the run continues on.")
    max: StrictInt = Field(
        ..., ge=1, le=MAX_WORKERS, description=("The most workers; train.grad_accum is stated for this many.")
    )

    @model_validator(mode="after")
    def _order(self) -> ElasticWorkers:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


def _workers_kind(v: Any) -> str:
    """Which form of ``num_workers`` this is; the ``tagged-`` prefix keeps it out of error paths."""
    return "tagged-elastic" if isinstance(v, (dict, ElasticWorkers)) else "tagged-fixed"


MAX_ENV_VARS = 256  # scaling.env entries
MAX_ENV_VALUE_CHARS = 32 << 10  # one value; a path or a URL is well under it
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# what syncpoint sets for every rank, and where it comes from (the reason a scaling.env entry for it is refused)
_DISTRIBUTED = "torch.distributed's, one per rank"
RESERVED_ENV = {
    "PYTHONHASHSEED": "from train.seed, the same in every attempt",
    "PYTHONPATH": "the driver's working directory and its own PYTHONPATH: set it where `syncpoint run` runs",
    **dict.fromkeys(
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"),
        _DISTRIBUTED,
    ),
}


def _job_env(v: Any) -> Any:
    """``scaling.env``: names a shell would take (and no variable syncpoint sets per rank), string values
    (numbers are written as they read; anything else, or a NUL, is refused, naming the variable)."""
    if not isinstance(v, dict):  # said without the value: it may be a credential
        raise ValueError(f"must be a mapping of NAME: value (e.g. {{DATA_DIR: /data}}), not a {type(v).__name__}")
    if len(v) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} variables")
    out: dict[str, str] = {}
    for name, value in v.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ValueError(
                f"{str(name)[:80]!r} is not an environment variable name: letters, digits and _, not starting "
                "with a digit, at most 128 characters (e.g. DATA_DIR)"
            )
        if name in RESERVED_ENV:
            raise ValueError(f"{name} is syncpoint's to set for every rank ({RESERVED_ENV[name]}): remove it")
        if isinstance(value, bool):
            raise ValueError(f"{name}: a value must be a string: quote it ({name}: '{str(value).lower()}')")
        if not isinstance(value, (str, int, float)):
            raise ValueError(f"{name}: a value must be a string, not a {type(value).__name__}")
        text = value if isinstance(value, str) else str(value)
        if "\x00" in text or len(text) > MAX_ENV_VALUE_CHARS:
            raise ValueError(f"{name}: a value holds no NUL character and at most {MAX_ENV_VALUE_CHARS} characters")
        out[name] = text
    return out


# a tagged union: an elastic range's error is about its min/max only, not also "not an integer"
_Workers = Annotated[
    Annotated[StrictInt, Tag("tagged-fixed")] | Annotated[ElasticWorkers, Tag("tagged-elastic")],
    Discriminator(_workers_kind),
]


class ScalingSpec(Strict):
    """Named after Ray Train's ``ScalingConfig``."""

    num_workers: _Workers = Field(
        1,
        description=(
            "Ray Train workers (one torch rank each, at most 4096), or {min, max} for elastic training: the run "
            "continues on whatever number in the range Ray can place (train.grad_accum is then stated for max workers)."
        ),
    )
    cpus_per_worker: float = Field(
        1.0,
        gt=0,
        le=MAX_CPUS_PER_WORKER,
        description=(
            "CPUs reserved per worker; also the intra-op thread count, so results do not depend on the host's cores."
        ),
    )
    use_gpu: bool = Field(
        False,
        description=(
            "One GPU per worker (the one at LOCAL_RANK), NCCL instead of gloo; batches are moved to it for you."
        ),
    )
    collective_timeout_s: StrictInt = Field(
        600,
        ge=1,
        le=MAX_COLLECTIVE_TIMEOUT_S,
        description=(
            "Seconds any one collective (gloo or NCCL, DeepSpeed's own groups included) may wait for its peers "
            "before it fails (torch and Ray Train default to 1800 s): the backstop for a peer that went silent where "
            "Ray's node health check cannot see it. "
            "Every legitimate wait must fit (the slowest rank's save, load or op build at a barrier)."
        ),
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Environment variables of every worker process, on any cluster (Ray's runtime_env env_vars), in the "
            "pods `syncpoint k8s` renders and in ranks started without Ray, e.g. {DATA_DIR: /data/owt}; not "
            "PYTHONHASHSEED, PYTHONPATH or torch.distributed's per-rank variables. A name that looks like a "
            "credential's (KEY, TOKEN, SECRET, PASS, AUTH, ...) has its value shown as *** wherever syncpoint prints "
            "or stores the spec, and is refused by `syncpoint submit` and `syncpoint k8s` (their job files are "
            "readable on the cluster: give it from the nodes' own environment or a Kubernetes Secret)."
        ),
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        return _job_env(v)

    @field_validator("num_workers")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (or {min, max} for elastic training)")
        if isinstance(v, int) and v > MAX_WORKERS:
            raise ValueError(f"must be at most {MAX_WORKERS}; syncpoint runs one torch rank per worker")
        return v

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, ElasticWorkers)

    @property
    def min_workers(self) -> int:
        return self.num_workers.min if isinstance(self.num_workers, ElasticWorkers) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers.max if isinstance(self.num_workers, ElasticWorkers) else self.num_workers
