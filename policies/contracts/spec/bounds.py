"""The job spec's bounds: every limit a job file's values must lie within, and the strict base model.

Why bounds everywhere: a job file is input, sometimes hostile, often absurd by accident. Its size, YAML
nesting and alias expansion are bounded while it is parsed; every float must be finite and every
integer lie in a range a real job can use, so ``.inf``, ``.nan`` and ``seed: 2**70`` are errors naming
the field, not a crash hours later.
"""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
)

BUILTIN_POLICIES = ("newest-resumable", "pinned", "fresh", "best-metric")

# ---- input bounds (docs/reference/spec.md, "Bounds"). Generous for any real job, small enough
# that validating the worst allowed spec takes milliseconds.
MAX_SPEC_BYTES = 1 << 20  # job file size; a spec is a few hundred bytes
MAX_YAML_DEPTH = 32  # nesting levels, the document root included
MAX_YAML_NODES = 10_000  # YAML nodes after alias expansion (an alias counts as a copy of its target)
MAX_WORKERS = 4096  # Ray Train workers (torch ranks)
MAX_CPUS_PER_WORKER = 1024.0
MAX_MICRO_BATCH = 1 << 20  # samples per rank per micro-batch
MAX_GRAD_ACCUM = 1 << 16
MAX_STEPS = 10**9  # optimizer steps, schedule lengths, save/log intervals
MAX_EPOCHS = 10**6
MAX_MICRO_STEPS = 10**12  # state names are 12-digit global micro-steps
MAX_COUNT = 10**6  # keep_last, restarts, the save ordinal of a fault
MAX_DATALOADER_WORKERS = 256
MAX_STREAM_SHUFFLE_BUFFER = 1 << 20  # examples a stream's shuffle buffer holds (saved with every state)
MAX_SEED = (1 << 63) - 1  # torch and numpy take 64-bit seeds; 63 bits survive every signed cast
MAX_LR = 100.0  # above this it is a typo (1e3 for 1e-3), not a learning rate
MAX_LEASE_TTL_S = 7 * 24 * 3600.0  # a crashed owner blocks its successors this long at most
MAX_PATH_CHARS = 4096  # storage and state URLs
MAX_NAME_CHARS = 200  # the run directory's name (file systems stop at 255 bytes)
MAX_IMPORT_PATH_CHARS = 512
MAX_NO_DECAY_PATTERNS = 256  # train.optimizer.no_decay entries
MAX_PATTERN_CHARS = 256  # one no_decay name pattern
MAX_POWER = 100.0  # a polynomial schedule's exponent: beyond this the rate is 0 after the first step anyway
MAX_FAULTS = 1000
MAX_COLLECTIVE_TIMEOUT_S = 24 * 3600  # one collective's wait; a day is already a hang
MAX_PREEMPTIONS_PER_HOUR = 3600.0  # one a second: beyond that no state could ever commit
MAX_WINDOW_SHARDS = 1 << 16  # shards a shuffle window spans (each must fit the local cache)
MAX_CACHE_BYTES = 1 << 50  # a local shard cache of a petabyte is a typo
MAX_FETCH_CONCURRENCY = 64


def ranges(values: list[int], limit: int = 12) -> str:
    """[1, 2, 3, 5] -> '[1-3, 5]', at most ``limit`` runs: a range of thousands of workers must not
    make a message of thousands of numbers."""
    spans: list[list[int]] = []
    for v in values:
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    runs = [f"{lo}-{hi}" if hi - lo >= 2 else ", ".join(str(x) for x in range(lo, hi + 1)) for lo, hi in spans]
    shown = runs[:limit] + ([f"... ({len(runs) - limit} more)"] if len(runs) > limit else [])
    return "[" + ", ".join(shown) + "]"


class Strict(BaseModel):
    """Every spec model's base: unknown keys, infinities and NaNs are errors, and assignments are validated."""

    # allow_inf_nan=False: .inf/.nan in a learning rate or a TTL is never meant, and would otherwise
    # pass every gt/ge bound (or crash int() later)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
