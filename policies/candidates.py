"""Classify state candidates from metadata alone (``trainer.json``, ``manifest.json``, a listing).

Why plain data: selection must decide before any weights or data are touched, must be testable
without storage, and must give every rejected candidate a reason a person can act on. Nothing
here reads a file; discovery (``workers.discovery``) hands in what it read.

The rule this module keeps: anything a later step (fetch, load, the loop's resume arithmetic)
could refuse, classification refuses first. So it checks the manifest's structure (known
checksum algorithms, paths inside the state, every file the layout needs), every redundant
position field against the others, and every field that decides which samples a step sees or
whether the optimizer state can be loaded, naming the spec field and any opt-out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from policies.boundaries import is_boundary
from policies.state_paths import path_problem

TRAINER_SCHEMA_VERSION = 1
SAMPLER_VERSION = "global-permutation/v1"
# The checksum algorithms a manifest entry may name (``workers.checksum`` implements them).
CHECKSUM_ALGORITHMS = ("xxh3_128", "sha256")
STATE_NAME_DIGITS = 12


class Verdict(str, Enum):
    RESUMABLE = "resumable"
    MID_CYCLE = "mid-cycle"
    TORN = "torn"
    CORRUPT = "corrupt"
    INCOMPATIBLE = "incompatible"
    UNTRUSTED = "untrusted"


def is_state_name(name: str) -> bool:
    """Only directories named like ``workers.state_writer.state_name`` are syncpoint's states."""
    return len(name) == STATE_NAME_DIGITS and name.isascii() and name.isdigit()


@dataclass
class Candidate:
    """One directory under ``states/`` as discovery saw it (metadata only)."""

    name: str
    trainer: dict[str, Any] | None = None
    trainer_error: str | None = None
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None
    listing: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes
    symlink: bool = False  # the directory is a link: never followed, never deleted through
    trust_error: str | None = None  # signing on and the manifest's signature missing or wrong
    verdict: Verdict | None = None
    reason: str = ""

    @property
    def micro_step(self) -> int | None:
        if self.name.isdigit():
            return int(self.name)
        if self.trainer and isinstance(self.trainer.get("global_micro_step"), int):
            return self.trainer["global_micro_step"]
        return None

    @property
    def sort_key(self) -> tuple[int, str]:
        step = self.micro_step
        return (step if step is not None else -1, self.name)


@dataclass(frozen=True)
class Expectation:
    """What the current run can continue exactly; anything else is incompatible.

    A state's ``trainer.json`` embeds exactly these fields (``identity_record``), and
    ``expectation_from_trainer`` reads them back: the loop and ``syncpoint states`` build their
    expectation the same way. ``None`` in an optional field means "not known, do not compare"
    (states written before the field existed).
    """

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
    num_samples: int | None = None
    precision: str | None = None
    optimizer_type: str | None = None
    scheduler_type: str | None = None
    scheduler_phases: tuple[str, ...] | None = None
    sampler: str = SAMPLER_VERSION
    # opt-outs (resume.*): continue on these weights and this position although that part differs
    reset_schedule: bool = False
    reset_optimizer: bool = False


def identity_record(exp: Expectation) -> dict[str, Any]:
    """The identity fields of ``trainer.json`` (the rest is position, metrics and provenance)."""
    return {
        "job_identity": exp.job_identity,
        "world_size": exp.world_size,
        "micro_batch_size": exp.micro_batch_size,
        "grad_accum": exp.grad_accum,
        "micro_batches_per_epoch": exp.micro_batches_per_epoch,
        "zero_stage": exp.zero_stage,
        "precision": exp.precision,
        "model_fingerprint": exp.model_fingerprint,
        "seed": exp.seed,
        "elastic": exp.elastic,
        "optimizer": {"type": exp.optimizer_type},
    }


def expectation_from_trainer(t: dict[str, Any], **overrides: Any) -> Expectation:
    """The expectation a state itself implies (``syncpoint states`` without a live run)."""
    data = t.get("data") if isinstance(t.get("data"), dict) else {}
    sched = t.get("scheduler") if isinstance(t.get("scheduler"), dict) else {}
    opt = t.get("optimizer") if isinstance(t.get("optimizer"), dict) else {}
    phases = sched.get("phases")
    fields: dict[str, Any] = dict(
        job_identity=t.get("job_identity", ""), world_size=t.get("world_size", 0),
        micro_batch_size=t.get("micro_batch_size", 0), grad_accum=t.get("grad_accum", 0),
        micro_batches_per_epoch=t.get("micro_batches_per_epoch", 0), zero_stage=t.get("zero_stage", -1),
        model_fingerprint=t.get("model_fingerprint", ""), seed=t.get("seed", -1),
        elastic=bool(t.get("elastic", False)), global_batch=data.get("global_batch", 0),
        samples_per_epoch=data.get("samples_per_epoch", 0), num_samples=data.get("num_samples"),
        precision=t.get("precision"), optimizer_type=opt.get("type"), scheduler_type=sched.get("type"),
        scheduler_phases=tuple(phases) if isinstance(phases, list) else None,
        sampler=data.get("sampler", SAMPLER_VERSION))
    fields.update(overrides)
    return Expectation(**fields)


def required_files(*, world_size: int, zero_stage: int, precision: str | None,
                   full_optimizer_state: bool) -> list[str]:
    """Every file a committed state of this layout must list (DeepSpeed 0.19's file names).

    ZeRO 0 keeps model and optimizer in one file (fp32 and bf16 alike, measured); ZeRO 1/2 write
    one optimizer shard per rank (``bf16_``-prefixed in bf16); ZeRO 3 partitions the model too, so
    every rank writes its own model file (``zero_pp_rank_<r>_mp_rank_00_model_states.pt``, shapes
    and buffers; no ``mp_rank_00_model_states.pt``) next to its optimizer shard, which holds the
    rank's fp32 partition of every parameter. Offload (optimizer or parameters, to the CPU) changes
    where tensors live while training, not the files (measured). Elastic ZeRO 1-3 add the gathered
    optimizer state. Every rank writes its RNG file.
    """
    files = ["trainer.json"]
    prefix = "bf16_" if precision == "bf16" else ""
    if zero_stage == 3:
        files += [f"engine/zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)]
    else:
        files.append("engine/mp_rank_00_model_states.pt")
    if zero_stage in (1, 2, 3):
        files += [f"engine/{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world_size)]
    if full_optimizer_state and zero_stage in (1, 2, 3):
        files.append("optim/full.safetensors")
    files += [f"rng/rank_{r:05d}.safetensors" for r in range(world_size)]
    return files


def entry_problem(rel: Any, info: Any) -> str | None:
    """Why one manifest entry is unusable (an unsafe path, no valid size, not exactly one known
    checksum): the one rule that classification, fetch and ``digest`` apply alike."""
    if not isinstance(rel, str):
        return f"manifest names a non-string path {rel!r}"
    bad_path = path_problem(rel)
    if bad_path:
        return f"manifest entry {rel!r} {bad_path}"
    if not isinstance(info, dict):
        return f"manifest entry {rel} is not an object"
    size = info.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"manifest entry {rel} has no valid size ({size!r})"
    algos = [a for a in CHECKSUM_ALGORITHMS if a in info]
    if len(algos) != 1:
        return (f"manifest entry {rel} names {'no' if not algos else 'more than one'} known checksum algorithm "
                f"(one of {', '.join(CHECKSUM_ALGORITHMS)}; it has {sorted(k for k in info if k != 'size')})")
    digest = info[algos[0]]
    if not isinstance(digest, str) or not digest or any(ch not in "0123456789abcdef" for ch in digest):
        return f"manifest entry {rel}: {algos[0]} is not a hex digest"
    return None


def _entry_problem(rel: Any, info: Any, listing: dict[str, int]) -> str | None:
    problem = entry_problem(rel, info)
    if problem:
        return problem
    if rel not in listing:
        return f"missing file listed in the manifest: {rel}"
    if info["size"] != listing[rel]:
        return f"{rel} is {listing[rel]} bytes, the manifest says {info['size']}"
    return None


def _manifest_problem(c: Candidate) -> str | None:
    m = c.manifest or {}
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        return "manifest lists no files"
    if m.get("state", c.name) != c.name:
        return f"manifest names state {m.get('state')!r} but lies in directory {c.name}"
    for rel, info in files.items():
        problem = _entry_problem(rel, info, c.listing)
        if problem:
            return problem
    if "trainer.json" not in files:
        return "manifest does not cover trainer.json"
    return None


_INT_FIELDS = ("epoch", "position_in_epoch", "global_micro_step", "optimizer_step", "grad_accum",
               "micro_batches_per_epoch", "micro_batch_size", "world_size", "zero_stage")


def _int_field(t: dict[str, Any], key: str) -> int:
    v = t.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"trainer.json {key} is {v!r}, not an integer")
    return v


def _position_problem(c: Candidate, t: dict[str, Any]) -> str | None:
    """Every redundant position field must agree with the others (and with the directory name),
    so an edited field cannot move a state to a mid-cycle position or reorder selection."""
    try:
        v = {k: _int_field(t, k) for k in _INT_FIELDS}
    except ValueError as e:
        return str(e)
    epoch, pos, gms, step = v["epoch"], v["position_in_epoch"], v["global_micro_step"], v["optimizer_step"]
    acc, mbpe, mbs, world = v["grad_accum"], v["micro_batches_per_epoch"], v["micro_batch_size"], v["world_size"]
    if min(acc, mbpe, mbs, world) < 1 or epoch < 0 or gms < 1 or step < 1 or not 1 <= pos <= mbpe:
        return f"position fields out of range (epoch {epoch}, position {pos} of {mbpe}, micro-step {gms}, step {step})"
    if c.name != f"{gms:0{STATE_NAME_DIGITS}d}":
        return f"directory {c.name} does not hold micro-step {gms} (trainer.json global_micro_step)"
    if c.manifest and c.manifest.get("world_size", world) != world:
        return f"manifest world_size {c.manifest.get('world_size')!r} != trainer.json world_size {world}"
    data = t.get("data") if isinstance(t.get("data"), dict) else {}
    per_micro = mbs * world
    if "samples_in_epoch" in data or "samples_per_epoch" in data:
        sie, spe, gb = data.get("samples_in_epoch"), data.get("samples_per_epoch"), data.get("global_batch")
        g = data.get("global_samples")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (sie, spe, gb, g)):
            return "trainer.json data position fields are missing or not integers"
        if sie != pos * per_micro:
            return f"position inconsistent: {pos} micro-batches of {per_micro} samples != {sie} samples into the epoch"
        if spe != mbpe * per_micro:
            return f"position inconsistent: {mbpe} micro-batches of {per_micro} samples != {spe} samples per epoch"
        if gb != acc * per_micro:
            return f"position inconsistent: accumulation {acc} x {per_micro} samples != global batch {gb}"
        if g != epoch * spe + sie:
            return f"position inconsistent: epoch {epoch} x {spe} + {sie} samples != {g} samples seen"
        steps = epoch * -(-spe // gb) + sie // gb + (1 if sie == spe and spe % gb else 0)
        if step != steps:
            return f"position inconsistent: {g} samples at global batch {gb} are {steps} optimizer steps, not {step}"
    else:  # states written before the data block: the micro-step counters alone
        steps = epoch * -(-mbpe // acc) + pos // acc + (1 if pos == mbpe and mbpe % acc else 0)
        if step != steps:
            return f"position inconsistent: micro-step {gms} is optimizer step {steps}, not {step}"
    never_resized = not t.get("elastic") and not t.get("elastic_optimizer")
    if (never_resized or t.get("elastic") is False) and epoch * mbpe + pos != gms:
        return f"position inconsistent: epoch {epoch} * {mbpe} + {pos} != micro-step {gms}"
    return None


def _differs(field_name: str, have: Any, want: Any, what: str, fix: str) -> str:
    return f"{what}: the state has {field_name}={have!r}, this run has {want!r}. {fix}"


def _incompatibility(t: dict[str, Any], exp: Expectation) -> str | None:
    data = t.get("data") if isinstance(t.get("data"), dict) else {}
    restore = "Restore the previous value, or start a new run (another name, or resume.policy: fresh)."
    checks: list[tuple[str, Any, Any, str, str]] = [
        ("job_identity", t.get("job_identity"), exp.job_identity, "written by another job (name / task.path)", restore),
        ("model_fingerprint", t.get("model_fingerprint"), exp.model_fingerprint,
         "model parameters (names/shapes) differ (task)", "Use resume.init_from to take compatible weights instead."),
        ("seed", t.get("seed"), exp.seed, "sampler seed differs (train.seed): other samples per step", restore),
        ("data.sampler", data.get("sampler", SAMPLER_VERSION), exp.sampler, "sampler version differs",
         "Resume it with the syncpoint version that wrote it."),
    ]
    if exp.num_samples is not None and "num_samples" in data:
        checks.append(("data.num_samples", data.get("num_samples"), exp.num_samples,
                       "dataset size differs (the task's dataset): each epoch's permutation changes", restore))
    resized = t.get("world_size") != exp.world_size
    if exp.elastic and resized:
        if not t.get("elastic_optimizer"):
            return (f"saved on {t.get('world_size')} worker(s) without world-size-independent optimizer state "
                    f"(ZeRO {t.get('zero_stage')} non-elastic); cannot load on {exp.world_size} (scaling.num_workers)")
        checks += [
            ("data.global_batch", data.get("global_batch"), exp.global_batch,
             "global batch (samples per optimizer step) differs (train.micro_batch_size x max workers x "
             "train.grad_accum)", restore),
            ("data.samples_per_epoch", data.get("samples_per_epoch"), exp.samples_per_epoch,
             "samples per epoch differ (dataset size or the elastic range)", restore),
            ("micro_batch_size", t.get("micro_batch_size"), exp.micro_batch_size,
             "micro-batch size differs (train.micro_batch_size)", restore),
        ]
        sie, per_micro = data.get("samples_in_epoch"), exp.micro_batch_size * exp.world_size
        if isinstance(sie, int) and per_micro and sie % per_micro:
            return (f"{sie} samples into the epoch is not a whole number of micro-batches on {exp.world_size} "
                    f"worker(s) (scaling.num_workers); resume it on {t.get('world_size')}")
    else:
        checks += [
            ("world_size", t.get("world_size"), exp.world_size, "world size differs (scaling.num_workers)",
             "Use the same number of workers, or an elastic range {min, max} (with ZeRO 0, or elastic ZeRO 1-3 states)."),
            ("micro_batch_size", t.get("micro_batch_size"), exp.micro_batch_size,
             "micro-batch size differs (train.micro_batch_size)", restore),
            ("grad_accum", t.get("grad_accum"), exp.grad_accum, "gradient accumulation differs (train.grad_accum)",
             restore),
            ("micro_batches_per_epoch", t.get("micro_batches_per_epoch"), exp.micro_batches_per_epoch,
             "epoch length in micro-batches differs (dataset size, train.micro_batch_size)", restore),
        ]
        if exp.samples_per_epoch and "samples_per_epoch" in data:
            checks.append(("data.samples_per_epoch", data.get("samples_per_epoch"), exp.samples_per_epoch,
                           "samples per epoch differ (dataset size)", restore))
    checks.append(("zero_stage", t.get("zero_stage"), exp.zero_stage, "ZeRO stage differs (deepspeed.zero_stage)",
                   "DeepSpeed shards the optimizer state by stage; restore deepspeed.zero_stage."))
    if exp.precision is not None and t.get("precision") is not None:
        checks.append(("precision", t.get("precision"), exp.precision, "precision differs (deepspeed.precision)",
                       "Master weights and loss-scale state are stored per precision; restore deepspeed.precision, "
                       "or take the weights into a new run with resume.init_from."))
    opt = t.get("optimizer") if isinstance(t.get("optimizer"), dict) else {}
    if not exp.reset_optimizer and exp.optimizer_type is not None and opt.get("type") is not None:
        checks.append(("optimizer.type", opt.get("type"), exp.optimizer_type,
                       "optimizer type differs (train.optimizer.type): its moments cannot be loaded",
                       "Set resume.reset_optimizer: true to keep weights and position and start the optimizer "
                       "state fresh, or restore train.optimizer.type."))
    for key, have, want, what, fix in checks:
        if have != want:
            return _differs(key, have, want, what, fix)
    return _schedule_incompatibility(t, exp)


def _schedule_incompatibility(t: dict[str, Any], exp: Expectation) -> str | None:
    """Only the schedule's position is kept; another type or phase order cannot be continued."""
    sched = t.get("scheduler") if isinstance(t.get("scheduler"), dict) else None
    if exp.reset_schedule or exp.scheduler_type is None or not sched or "position" not in sched:
        return None
    phases = sched.get("phases")
    have = (sched.get("type"), tuple(phases) if isinstance(phases, list) else phases)
    if have != (exp.scheduler_type, exp.scheduler_phases):
        return (f"train.scheduler changed from {have[0]} {list(have[1] or [])} to {exp.scheduler_type} "
                f"{list(exp.scheduler_phases or [])}: a schedule of another type or phase order cannot be continued. "
                "Set resume.reset_schedule: true to restart the schedule from step 0 on these weights, or restore "
                "the previous train.scheduler.")
    if not isinstance(sched.get("position"), int) or sched["position"] < 0:
        return f"trainer.json scheduler.position is {sched.get('position')!r}, not a count"
    return None


def _completeness_problem(c: Candidate, t: dict[str, Any]) -> str | None:
    files = (c.manifest or {}).get("files") or {}
    full = bool(t.get("elastic")) or (bool(t.get("elastic_optimizer")) and t.get("zero_stage") in (1, 2))
    need = required_files(world_size=int(t["world_size"]), zero_stage=int(t["zero_stage"]),
                          precision=t.get("precision"), full_optimizer_state=full)
    missing = [f for f in need if f not in files]
    if missing:
        return (f"incomplete: the manifest lacks {', '.join(missing[:3])}"
                f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''}, which a ZeRO {t['zero_stage']} "
                f"{t.get('precision') or ''} state of {t['world_size']} worker(s) needs").replace("  ", " ")
    return None


def _metric_problem(t: dict[str, Any]) -> str | None:
    metrics = t.get("metrics", {})
    if not isinstance(metrics, dict):
        return "trainer.json metrics is not an object"
    return None


def classify(c: Candidate, exp: Expectation) -> Candidate:
    """Set ``c.verdict`` and ``c.reason``; the order is torn, corrupt, untrusted, mid-cycle, incompatible."""
    c.verdict, c.reason = _classify(c, exp)
    return c


def _classify(c: Candidate, exp: Expectation) -> tuple[Verdict, str]:
    if c.symlink:
        return Verdict.CORRUPT, "a symbolic link, not a directory syncpoint wrote: never followed (left alone)"
    if not is_state_name(c.name):
        return Verdict.CORRUPT, f"{c.name!r} is not a state name ({STATE_NAME_DIGITS} digits): not written by syncpoint"
    if c.manifest is None and c.manifest_error is None:
        return Verdict.TORN, "no manifest.json: the save never committed"
    if c.manifest_error:
        return Verdict.CORRUPT, f"manifest.json unreadable: {c.manifest_error}"
    problem = _manifest_problem(c)
    if problem:
        return Verdict.CORRUPT, problem
    if c.trust_error:
        return Verdict.UNTRUSTED, c.trust_error
    if c.trainer_error or c.trainer is None:
        return Verdict.CORRUPT, f"trainer.json unusable: {c.trainer_error or 'missing'}"
    t = c.trainer
    version = t.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version > TRAINER_SCHEMA_VERSION:
        return Verdict.INCOMPATIBLE, (
            f"trainer.json schema_version {version!r} is newer than this syncpoint reads "
            f"(<= {TRAINER_SCHEMA_VERSION}); upgrade syncpoint to resume it")
    try:
        pos, acc, mbpe = _int_field(t, "position_in_epoch"), _int_field(t, "grad_accum"), \
            _int_field(t, "micro_batches_per_epoch")
    except ValueError as e:
        return Verdict.CORRUPT, f"trainer.json lacks a usable position field ({e})"
    if not is_boundary(pos, acc, mbpe):
        return Verdict.MID_CYCLE, (
            f"mid-cycle: position {pos} of {mbpe} with accumulation {acc} is not a sync boundary; "
            "its pending micro-batch gradients were never persisted")
    for check in (_position_problem(c, t), _completeness_problem(c, t), _metric_problem(t)):
        if check:
            return Verdict.CORRUPT, check
    why = _incompatibility(t, exp)
    if why:
        return Verdict.INCOMPATIBLE, why
    return Verdict.RESUMABLE, f"boundary at micro-step {t['global_micro_step']} (optimizer step {t['optimizer_step']})"


def finite_metric(t: dict[str, Any] | None, name: str) -> tuple[float | None, str]:
    """A recorded metric as a finite float, or (None, why it cannot be compared)."""
    metrics = (t or {}).get("metrics")
    if not isinstance(metrics, dict) or name not in metrics:
        return None, f"records no metric {name!r}"
    v = metrics[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, f"metric {name} is {v!r}, not a number"
    if not math.isfinite(v):
        return None, f"metric {name} is {v!r}, not finite"
    return float(v), ""


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
