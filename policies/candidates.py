"""Classify state candidates from metadata alone (``trainer.json``, ``manifest.json``, a listing).

Why plain data: selection must decide before any weights or data are touched, must be testable
without storage, and must give every rejected candidate a reason a person can act on. Nothing
here reads a file; discovery (``workers.discovery``) hands in what it read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from policies.boundaries import is_boundary

TRAINER_SCHEMA_VERSION = 1


class Verdict(str, Enum):
    RESUMABLE = "resumable"
    MID_CYCLE = "mid-cycle"
    TORN = "torn"
    CORRUPT = "corrupt"
    INCOMPATIBLE = "incompatible"

    @property
    def safe(self) -> bool:
        return self is Verdict.RESUMABLE


@dataclass
class Candidate:
    """One directory under ``states/`` as discovery saw it (metadata only)."""

    name: str
    trainer: dict[str, Any] | None = None
    trainer_error: str | None = None
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None
    listing: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes
    verdict: Verdict | None = None
    reason: str = ""

    @property
    def micro_step(self) -> int | None:
        if self.trainer and isinstance(self.trainer.get("global_micro_step"), int):
            return self.trainer["global_micro_step"]
        return int(self.name) if self.name.isdigit() else None

    @property
    def sort_key(self) -> tuple[int, str]:
        step = self.micro_step
        return (step if step is not None else -1, self.name)


@dataclass(frozen=True)
class Expectation:
    """What the current run can continue exactly; anything else is incompatible."""

    job_identity: str
    world_size: int
    micro_batch_size: int
    grad_accum: int
    micro_batches_per_epoch: int
    zero_stage: int
    model_fingerprint: str
    seed: int
    # elastic runs compare what must stay constant across world sizes instead of the layout itself
    elastic: bool = False
    global_batch: int = 0
    samples_per_epoch: int = 0


def _listing_problem(c: Candidate) -> str | None:
    files = (c.manifest or {}).get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    missing = [p for p in files if p not in c.listing]
    if missing:
        return f"missing file(s) listed in the manifest: {', '.join(sorted(missing)[:3])}"
    for path, info in files.items():
        size = info.get("size") if isinstance(info, dict) else None
        if size != c.listing[path]:
            return f"{path} is {c.listing[path]} bytes, the manifest says {size}"
    if "trainer.json" not in files:
        return "manifest does not cover trainer.json"
    return None


def _incompatibility(t: dict[str, Any], exp: Expectation) -> str | None:
    data = t.get("data") or {}
    if exp.elastic and t.get("world_size") != exp.world_size:
        if not t.get("elastic_optimizer"):
            return (f"saved on {t.get('world_size')} worker(s) without world-size-independent optimizer state "
                    f"(ZeRO {t.get('zero_stage')} non-elastic); cannot load on {exp.world_size}")
        layout_checks = [(data.get("global_batch"), exp.global_batch, "global batch (samples per optimizer step)"),
                         (data.get("samples_per_epoch"), exp.samples_per_epoch, "samples per epoch")]
        for have, want, what in layout_checks:
            if have != want:
                return f"{what} differs: state has {have}, this run has {want}"
        layout = [("micro_batch_size", exp.micro_batch_size, "micro-batch size differs")]
    else:
        layout = [("world_size", exp.world_size, "world size differs"),
                  ("micro_batch_size", exp.micro_batch_size, "micro-batch size differs"),
                  ("grad_accum", exp.grad_accum, "gradient accumulation differs"),
                  ("micro_batches_per_epoch", exp.micro_batches_per_epoch, "epoch length (micro-batches) differs")]
    checks = [
        ("job_identity", exp.job_identity, "written by another job"),
        *layout,
        ("zero_stage", exp.zero_stage, "ZeRO stage differs"),
        ("model_fingerprint", exp.model_fingerprint, "model parameters (names/shapes) differ"),
        ("seed", exp.seed, "sampler seed differs"),
    ]
    for key, want, what in checks:
        have = t.get(key)
        if have != want:
            return f"{what}: state has {key}={have!r}, this run has {want!r}"
    return None


def classify(c: Candidate, exp: Expectation) -> Candidate:
    """Set ``c.verdict`` and ``c.reason``; the order is torn, corrupt, mid-cycle, incompatible."""
    c.verdict, c.reason = _classify(c, exp)
    return c


def _classify(c: Candidate, exp: Expectation) -> tuple[Verdict, str]:
    if c.manifest is None and c.manifest_error is None:
        return Verdict.TORN, "no manifest.json: the save never committed"
    if c.manifest_error:
        return Verdict.CORRUPT, f"manifest.json unreadable: {c.manifest_error}"
    problem = _listing_problem(c)
    if problem:
        return Verdict.CORRUPT, problem
    if c.trainer_error or c.trainer is None:
        return Verdict.CORRUPT, f"trainer.json unreadable: {c.trainer_error or 'missing'}"
    t = c.trainer
    version = t.get("schema_version")
    if not isinstance(version, int) or version > TRAINER_SCHEMA_VERSION:
        return Verdict.INCOMPATIBLE, (
            f"trainer.json schema_version {version!r} is newer than this syncpoint reads "
            f"(<= {TRAINER_SCHEMA_VERSION}); upgrade syncpoint to resume it")
    try:
        pos, acc, mbpe = int(t["position_in_epoch"]), int(t["grad_accum"]), int(t["micro_batches_per_epoch"])
        epoch, step = int(t["epoch"]), int(t["global_micro_step"])
    except (KeyError, TypeError, ValueError) as e:
        return Verdict.CORRUPT, f"trainer.json lacks a usable position field ({e})"
    if not is_boundary(pos, acc, mbpe):
        return Verdict.MID_CYCLE, (
            f"mid-cycle: position {pos} of {mbpe} with accumulation {acc} is not a sync boundary; "
            "its pending micro-batch gradients were never persisted")
    data = t.get("data") or {}
    if "samples_in_epoch" in data:  # data position in global samples (schema 1, elastic-aware writers)
        per_micro = int(t.get("micro_batch_size", 0)) * int(t.get("world_size", 0))
        if data["samples_in_epoch"] != pos * per_micro:
            return Verdict.CORRUPT, (f"position inconsistent: {pos} micro-batches of {per_micro} samples != "
                                     f"{data['samples_in_epoch']} samples into the epoch")
    elif epoch * mbpe + pos != step:
        return Verdict.CORRUPT, f"position inconsistent: epoch {epoch} * {mbpe} + {pos} != micro-step {step}"
    why = _incompatibility(t, exp)
    if why:
        return Verdict.INCOMPATIBLE, why
    return Verdict.RESUMABLE, f"boundary at micro-step {step} (optimizer step {t.get('optimizer_step')})"


def newest_first(cands: list[Candidate]) -> list[Candidate]:
    return sorted(cands, key=lambda c: c.sort_key, reverse=True)


def candidates_table(cands: list[Candidate]) -> str:
    """Plain-text table of every candidate and its verdict (for errors and ``syncpoint states``)."""
    rows = [("state", "micro-step", "verdict", "reason")]
    for c in newest_first(cands):
        step = c.micro_step
        rows.append((c.name, "" if step is None else str(step), c.verdict.value if c.verdict else "?", c.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows)
