"""Bad input corpus: job specs, CLI arguments and storage URLs.

Every bad input must be refused with a message that names the offending field/argument and says
how to fix it (CLI: exit 2, or argparse's SystemExit(2); never a traceback), and must never cost
what is already committed: every test here runs against a real committed run directory and checks
that its ``states/`` are byte-for-byte unchanged afterwards (many cases point their spec at that
very run: same storage, same name).

Ray is never started in this file: ``syncpoint.orchestrator.ray_runner`` is replaced by a stub that fails the
test if bad input ever reaches the launcher. Bad input that only shows up at run time (a task import
path that does not resolve, a dataset smaller than one global batch, ...) goes through the
in-process runner.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from syncpoint.orchestrator.spec_file import parse_spec
from syncpoint.policies.contracts.errors import JobConfigError, ResumeRefused, SpecError, TaskError
from syncpoint.workers.data.sampler import DataLayoutError
from tests.helpers import cli, committed_steps, linear_spec, run

# ----------------------------------------------------------------------------- the committed run

COMMITTED_STEPS = [2, 4, 6, 8]


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """A real, finished run (name ``linear``) with four committed states."""
    storage = tmp_path_factory.mktemp("committed")
    spec = linear_spec(
        storage,
        "task.path=tests.light_tasks:linear",
        "task.config.num_samples=8",
        "train.grad_accum=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    )
    run(spec)
    assert committed_steps(spec) == COMMITTED_STEPS
    return spec


def _local(url: str) -> Path:
    assert url.startswith("file://"), url
    return Path(url[len("file://") :])


def tree_digest(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``root``."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(autouse=True)
def nothing_committed_is_lost(committed):
    states = _local(committed.run_url) / "states"
    before = tree_digest(states)
    assert len(before) >= 4 * len(COMMITTED_STEPS)  # engine file(s), rng, trainer.json, manifest.json per state
    yield
    assert tree_digest(states) == before, "bad input changed the committed states"
    assert committed_steps(committed) == COMMITTED_STEPS


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Bad input must be refused before the launcher: reaching it fails the test (and starts no Ray)."""
    fake = types.ModuleType("syncpoint.orchestrator.ray_runner")

    def run_on_ray(spec, address=None, **kwargs):
        raise AssertionError(f"bad input reached the Ray launcher (storage {spec.storage!r})")

    fake.run_on_ray = run_on_ray
    monkeypatch.setitem(sys.modules, "syncpoint.orchestrator.ray_runner", fake)


# ----------------------------------------------------------------------------- job specs

# The committed run's own spec (block style, so errors can point at lines); @STORAGE@ is replaced by
# the committed run's storage, so every case below targets the committed run directory itself.
BASE = """\
name: linear
storage: "@STORAGE@"
task:
  path: tests.light_tasks:linear
  config:
    num_samples: 8
train:
  micro_batch_size: 1
  grad_accum: 2
  epochs: 1
  seed: 3
  lr: 0.01
deepspeed:
  zero_stage: 0
checkpoint:
  keep_last: 0
  export_final: false
  save_every: {value: 1, unit: optimizer_steps}
"""


def _edit(old: str, new: str):
    """old -> new in BASE (old == "" appends new)."""

    def apply(text: str) -> str:
        if not old:
            return text + new
        assert old in text, old
        return text.replace(old, new, 1)

    return apply


_FINITE = r"must be a finite number; \.inf and \.nan are not allowed"


def spec_case(case_id, edit, field, fix, line=None, marks=()):
    return pytest.param(edit, field, fix, line, id=case_id, marks=marks)


SPEC_CASES = [
    # --- required fields and types
    spec_case("name-missing", _edit("name: linear\n", ""), r"\bname\b", r"required field is missing"),
    spec_case("name-empty", _edit("name: linear", "name: ''"), r"\bname\b", r"at least 1 character", line=1),
    spec_case("name-with-slash", _edit("name: linear", "name: a/b"), r"\bname\b", r"should match pattern", line=1),
    spec_case("name-not-a-string", _edit("name: linear", "name: [a, b]"), r"\bname\b", r"valid string"),
    spec_case("storage-not-a-string", _edit('storage: "@STORAGE@"', "storage: [x]"), r"\bstorage\b", r"valid string"),
    spec_case(
        "task-missing",
        _edit("task:\n  path: tests.light_tasks:linear\n  config:\n    num_samples: 8\n", ""),
        r"\btask\b",
        r"required field is missing",
    ),
    spec_case(
        "task-path-not-an-import-path",
        _edit("path: tests.light_tasks:linear", "path: tests.light_tasks.linear"),
        r"task\.path",
        r"package\.module:function",
        line=4,
    ),
    spec_case(
        "task-config-not-a-mapping",
        _edit("  config:\n    num_samples: 8\n", "  config: [1]\n"),
        r"task\.config",
        r"valid dictionary",
    ),
    spec_case(
        "train-micro-batch-size-zero",
        _edit("micro_batch_size: 1", "micro_batch_size: 0"),
        r"train\.micro_batch_size",
        r"greater than or equal to 1",
        line=8,
    ),
    spec_case(
        "train-micro-batch-size-string",
        _edit("micro_batch_size: 1", "micro_batch_size: two"),
        r"train\.micro_batch_size",
        r"valid integer.*'two'",
    ),
    spec_case(
        "train-micro-batch-size-fraction",
        _edit("micro_batch_size: 1", "micro_batch_size: 1.5"),
        r"train\.micro_batch_size",
        r"valid integer.*1\.5",
    ),
    spec_case(
        "train-grad-accum-zero",
        _edit("grad_accum: 2", "grad_accum: 0"),
        r"train\.grad_accum",
        r"greater than or equal to 1",
        line=9,
    ),
    spec_case(
        "train-grad-accum-negative",
        _edit("grad_accum: 2", "grad_accum: -3"),
        r"train\.grad_accum",
        r"greater than or equal to 1",
    ),
    spec_case("train-epochs-zero", _edit("epochs: 1", "epochs: 0"), r"train\.epochs", r"greater than or equal to 1"),
    spec_case(
        "train-epochs-and-max-steps-missing",
        _edit("  epochs: 1\n", ""),
        r"train\.epochs or train\.max_steps",
        r"set train\.epochs or train\.max_steps",
    ),
    spec_case(
        "train-max-steps-zero", _edit("epochs: 1", "max_steps: 0"), r"train\.max_steps", r"greater than or equal to 1"
    ),
    spec_case("train-epochs-boolean", _edit("epochs: 1", "epochs: true"), r"train\.epochs", r"valid integer"),
    spec_case("train-lr-zero", _edit("lr: 0.01", "lr: 0"), r"train\.lr", r"greater than 0"),
    spec_case("train-lr-string", _edit("lr: 0.01", "lr: fast"), r"train\.lr", r"valid number"),
    spec_case("train-seed-negative", _edit("seed: 3", "seed: -1"), r"train\.seed", r"greater than or equal to 0"),
    # --- unknown keys at several depths
    spec_case(
        "unknown-key-top-level",
        _edit("", "bogus: 1\n"),
        r"\bbogus\b",
        r"unknown key; allowed keys here are: .*checkpoint.*train",
    ),
    spec_case(
        "unknown-key-in-task",
        _edit("  path: tests.light_tasks:linear\n", "  path: tests.light_tasks:linear\n  cfg: 1\n"),
        r"task\.cfg",
        r"allowed keys here are: config, path",
        line=5,
    ),
    spec_case(
        "unknown-key-in-train",
        _edit("  epochs: 1\n", "  epochs: 1\n  epochz: 1\n"),
        r"train\.epochz",
        r"allowed keys here are: .*epochs",
        line=11,
    ),
    spec_case(
        "unknown-key-in-train-scheduler",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  scheduler:\n    type: cosine\n    warmpu: 3\n"),
        r"train\.scheduler\.warmpu",
        r"allowed keys here are: .*warmup",
        line=15,
    ),
    spec_case(
        "unknown-key-in-train-optimizer",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {type: sgd, nesterov: true}\n"),
        r"train\.optimizer\.nesterov",
        r"allowed keys here are: .*momentum",
    ),
    spec_case(
        "unknown-key-in-checkpoint-save-every",
        _edit("{value: 1, unit: optimizer_steps}", "{value: 1, unit: optimizer_steps, every: 2}"),
        r"checkpoint\.save_every\.every",
        r"allowed keys here are: unit, value",
    ),
    spec_case(
        "unknown-key-in-a-fault",
        _edit("", "faults:\n  - at_micro_step: 3\n    when: now\n"),
        r"faults\.0\.when",
        r"allowed keys here are: at_micro_step, at_save, mode, phase, rank",
    ),
    spec_case(
        "unknown-key-in-scaling",
        _edit("", "scaling: {num_gpus: 1}\n"),
        r"scaling\.num_gpus",
        r"allowed keys here are: .*num_workers",
    ),
    spec_case(
        "unknown-key-in-failure",
        _edit("", "failure: {retries: 3}\n"),
        r"failure\.retries",
        r"allowed keys here are: in_place, max_failures, max_preemptions",
    ),
    # --- scheduler and optimizer
    spec_case(
        "scheduler-type-unknown",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  scheduler: {type: exponential}\n"),
        r"train\.scheduler\.type",
        r"'constant', 'linear', 'cosine', 'wsd', .* or 'custom'",
    ),
    spec_case(
        "scheduler-unit-unknown",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  scheduler: {unit: minutes}\n"),
        r"train\.scheduler\.unit",
        r"'optimizer_steps' or 'epochs'",
    ),
    spec_case(
        "scheduler-min-lr-ratio-above-one",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  scheduler: {min_lr_ratio: 1.5}\n"),
        r"train\.scheduler\.min_lr_ratio",
        r"less than or equal to 1",
    ),
    spec_case(
        "scheduler-epochs-unit-without-epochs",
        _edit("  epochs: 1\n", "  max_steps: 4\n  scheduler: {unit: epochs}\n"),
        r"train\.scheduler\.unit epochs",
        r"needs train\.epochs or train\.scheduler\.total",
    ),
    spec_case(
        "optimizer-type-unknown",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: lamb\n"),
        r"train\.optimizer\.type",
        r"'adamw', 'adam' or 'sgd'",
    ),
    spec_case(
        "optimizer-betas-one-value",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {betas: [0.9]}\n"),
        r"train\.optimizer\.betas",
        r"required",
    ),
    # --- issue 17.1: the new schedules and no_decay
    *[
        spec_case(f"scheduler-{case_id}", _edit("  lr: 0.01\n", f"  lr: 0.01\n  scheduler: {sched}\n"), field, fix)
        for case_id, sched, field, fix in [
            ("power-inf", "{type: polynomial, power: .inf}", r"train\.scheduler\.power", _FINITE),
            (
                "power-absurd",
                "{type: polynomial, power: 1.0e+9}",
                r"train\.scheduler\.power",
                r"less than or equal to 100",
            ),
            ("power-zero", "{type: polynomial, power: 0}", r"train\.scheduler\.power", r"greater than 0"),
            ("gamma-zero", "{type: step, step_size: 2, gamma: 0}", r"train\.scheduler\.gamma", r"greater than 0"),
            (
                "gamma-above-one",
                "{type: step, step_size: 2, gamma: 1.5}",
                r"train\.scheduler\.gamma",
                r"less than or equal to 1",
            ),
            ("gamma-nan", "{type: step, step_size: 2, gamma: .nan}", r"train\.scheduler\.gamma", _FINITE),
            ("step-without-step-size", "{type: step}", r"train\.scheduler", r"type step needs step_size"),
            (
                "step-size-zero",
                "{type: step, step_size: 0}",
                r"train\.scheduler\.step_size",
                r"greater than or equal to 1",
            ),
            ("wsd-without-decay", "{type: wsd}", r"train\.scheduler", r"exactly one of decay .* or decay_fraction"),
            (
                "wsd-with-both-decays",
                "{type: wsd, decay: 3, decay_fraction: 0.2}",
                r"train\.scheduler",
                r"exactly one of decay",
            ),
            (
                "wsd-decay-fraction-nan",
                "{type: wsd, decay_fraction: .nan}",
                r"train\.scheduler\.decay_fraction",
                _FINITE,
            ),
            (
                "wsd-decay-fraction-above-one",
                "{type: wsd, decay_fraction: 2}",
                r"train\.scheduler\.decay_fraction",
                r"less than or equal to 1",
            ),
            (
                "wsd-decay-absurd",
                f"{{type: wsd, decay: {10**12}}}",
                r"train\.scheduler\.decay",
                r"less than or equal to",
            ),
            (
                "wsd-decay-shape-unknown",
                "{type: wsd, decay: 3, decay_shape: exponential}",
                r"train\.scheduler\.decay_shape",
                r"'linear' or 'cosine'",
            ),
            (
                "field-of-another-type",
                "{type: cosine, power: 2}",
                r"train\.scheduler\.power",
                r"applies to type polynomial only.*set type: polynomial",
            ),
            ("custom-without-path", "{type: custom}", r"train\.scheduler", r"type custom needs path"),
            (
                "custom-path-not-an-import-path",
                "{type: custom, path: schedules/mine.py}",
                r"train\.scheduler\.path",
                r"package\.module:function",
            ),
            (
                "custom-with-warmup",
                "{type: custom, path: 'tests.group_tasks:half_then_quarter', warmup: 2}",
                r"train\.scheduler",
                r"remove warmup and min_lr_ratio",
            ),
        ]
    ],
    spec_case(
        "optimizer-no-decay-not-a-list",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {no_decay: '*.bias'}\n"),
        r"train\.optimizer\.no_decay",
        r"valid list",
    ),
    spec_case(
        "optimizer-no-decay-empty-pattern",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {no_decay: ['']}\n"),
        r"train\.optimizer\.no_decay\.0",
        r"at least 1 character",
    ),
    spec_case(
        "optimizer-no-decay-too-many",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {no_decay: [" + ", ".join(["a"] * 300) + "]}\n"),
        r"train\.optimizer\.no_decay",
        r"at most 256 items",
    ),
    # --- deepspeed and scaling
    spec_case("zero-stage-4", _edit("zero_stage: 0", "zero_stage: 4"), r"deepspeed\.zero_stage", r"0, 1, 2 or 3"),
    spec_case(
        "precision-unknown",
        _edit("zero_stage: 0\n", "zero_stage: 0\n  precision: fp8\n"),
        r"deepspeed\.precision",
        r"'fp32', 'bf16' or 'fp16'",
    ),
    spec_case(
        "fp16-without-gpu",
        _edit("zero_stage: 0\n", "zero_stage: 0\n  precision: fp16\n"),
        r"deepspeed\.precision fp16",
        r"needs scaling\.use_gpu: true \(use fp32 or bf16 on CPU\)",
    ),
    spec_case(
        "deepspeed-config-owned-key",
        _edit("zero_stage: 0\n", "zero_stage: 0\n  config: {train_batch_size: 8}\n"),
        r"deepspeed\.config",
        r"set by syncpoint .*set them there instead",
    ),
    spec_case(
        "num-workers-zero",
        _edit("", "scaling: {num_workers: 0}\n"),
        r"scaling\.num_workers",
        r"(at least 1|greater than or equal to 1)",
    ),
    spec_case(
        "cpus-per-worker-zero",
        _edit("", "scaling: {cpus_per_worker: 0}\n"),
        r"scaling\.cpus_per_worker",
        r"greater than 0",
    ),
    spec_case("use-gpu-not-a-boolean", _edit("", "scaling: {use_gpu: maybe}\n"), r"scaling\.use_gpu", r"valid boolean"),
    spec_case(
        "collective-timeout-zero",
        _edit("", "scaling: {collective_timeout_s: 0}\n"),
        r"scaling\.collective_timeout_s",
        r"greater than or equal to 1",
    ),
    spec_case(
        "collective-timeout-absurd",
        _edit("", "scaling: {collective_timeout_s: 1.0e+9}\n"),
        r"scaling\.collective_timeout_s",
        r"valid integer",
    ),
    spec_case(
        "collective-timeout-over-a-day",
        _edit("", "scaling: {collective_timeout_s: 86401}\n"),
        r"scaling\.collective_timeout_s",
        r"less than or equal to 86400",
    ),
    # --- faults
    spec_case(
        "fault-rank-does-not-exist",
        _edit("", "faults: [{rank: 3, at_micro_step: 2}]\n"),
        r"faults: rank 3 does not exist",
        r"scaling\.num_workers=1",
    ),
    spec_case(
        "fault-save-picked-two-ways",
        _edit("", "faults: [{at_micro_step: 3, phase: before_manifest, at_save: 2}]\n"),
        r"faults\.0",
        r"at_save .* or with at_micro_step .* not both",
    ),
    spec_case(
        "fault-without-trigger",
        _edit("", "faults: [{rank: 0}]\n"),
        r"faults\.0",
        r"needs at_micro_step, phase, or both",
    ),
    spec_case(
        "fault-phase-unknown",
        _edit("", "faults: [{phase: after_manifest}]\n"),
        r"faults\.0\.phase",
        r"'before_shards'.*'during_retention'",
    ),
    spec_case(
        "fault-sigterm-at-a-phase",
        _edit("", "faults: [{phase: before_manifest, mode: sigterm}]\n"),
        r"faults\.0",
        r"mode sigterm needs at_micro_step",
    ),
    spec_case(
        "fault-mode-unknown",
        _edit("", "faults: [{at_micro_step: 3, mode: explode}]\n"),
        r"faults\.0\.mode",
        r"'exit', 'raise', 'sigterm' or 'hold'",
    ),
    spec_case(
        "fault-at-micro-step-zero",
        _edit("", "faults: [{at_micro_step: 0}]\n"),
        r"faults\.0\.at_micro_step",
        r"greater than or equal to 1",
    ),
    spec_case("faults-not-a-list", _edit("", "faults: {rank: 0, at_micro_step: 1}\n"), r"\bfaults\b", r"valid list"),
    # --- checkpoint
    spec_case(
        "save-every-bad-unit",
        _edit("{value: 1, unit: optimizer_steps}", "'5 weeks'"),
        r"checkpoint\.save_every\.unit",
        r"'micro_steps', 'optimizer_steps', 'seconds' or 'auto'",
    ),
    spec_case(
        "save-every-no-unit-shorthand",
        _edit("{value: 1, unit: optimizer_steps}", "'5'"),
        r"checkpoint\.save_every",
        r"write it as '<number> <unit>'",
    ),
    spec_case(
        "save-every-unit-missing",
        _edit("{value: 1, unit: optimizer_steps}", "{value: 3}"),
        r"checkpoint\.save_every\.unit",
        r"required field is missing",
    ),
    spec_case(
        "save-every-fractional-micro-steps",
        _edit("{value: 1, unit: optimizer_steps}", "{value: 1.5, unit: micro_steps}"),
        r"checkpoint\.save_every",
        r"micro_steps must be a whole number",
    ),
    spec_case(
        "save-every-negative",
        _edit("{value: 1, unit: optimizer_steps}", "{value: -1, unit: micro_steps}"),
        r"checkpoint\.save_every\.value",
        r"greater than or equal to 0",
    ),
    spec_case(
        "save-every-value-not-a-number",
        _edit("{value: 1, unit: optimizer_steps}", "'abc micro_steps'"),
        r"checkpoint\.save_every\.value",
        r"valid number",
    ),
    spec_case(
        "keep-last-negative",
        _edit("keep_last: 0", "keep_last: -1"),
        r"checkpoint\.keep_last",
        r"greater than or equal to 0",
    ),
    spec_case(
        "save-trigger-not-an-import-path",
        _edit("export_final: false\n", "export_final: false\n  save_trigger: not a path\n"),
        r"checkpoint\.save_trigger",
        r"package\.module:(Class|Name|function)",
    ),
    # --- resume and failure
    spec_case(
        "resume-on-existing-unknown",
        _edit("", "resume: {on_existing: delete}\n"),
        r"resume\.on_existing",
        r"'refuse', 'archive' or 'overwrite'",
    ),
    spec_case(
        "resume-policy-args-not-a-mapping",
        _edit("", "resume: {policy_args: [1]}\n"),
        r"resume\.policy_args",
        r"valid dictionary",
    ),
    spec_case(
        "resume-policy-unknown-name",
        _edit("", "resume: {policy: newest}\n"),
        r"resume\.policy",
        r"newest-resumable.*pinned.*fresh.*best-metric",
    ),
    spec_case(
        "resume-lease-ttl-zero", _edit("", "resume: {lease_ttl_s: 0}\n"), r"resume\.lease_ttl_s", r"greater than 0"
    ),
    spec_case(
        "checkpoint-async-not-a-boolean",
        _edit("keep_last: 0\n", "keep_last: 0\n  async: sometimes\n"),
        r"checkpoint\.async",
        r"valid boolean",
    ),
    spec_case(
        "failure-max-failures-below-minus-one",
        _edit("", "failure: {max_failures: -2}\n"),
        r"failure\.max_failures",
        r"greater than or equal to -1",
    ),
    # --- YAML itself
    spec_case("yaml-tab-indentation", _edit("  epochs: 1\n", "\tepochs: 1\n"), r"not valid YAML", r"line \d+"),
    spec_case(
        "yaml-top-level-list",
        lambda text: "- a\n- b\n",
        r"top level",
        r"must be a mapping with at least name, task and train",
    ),
    spec_case(
        "yaml-empty-file", lambda text: "", r"top level", r"must be a mapping with at least name, task and train"
    ),
    spec_case("yaml-duplicate-key", _edit("", "train: {micro_batch_size: 4, epochs: 2}\n"), r"\btrain\b", r"duplicate"),
    # --- issue 14 §6: non-finite floats (each validated before; save_every: .inf was an OverflowError)
    spec_case("train-lr-inf", _edit("lr: 0.01", "lr: .inf"), r"train\.lr", _FINITE, line=12),
    spec_case("train-lr-nan", _edit("lr: 0.01", "lr: .nan"), r"train\.lr", _FINITE, line=12),
    spec_case("train-lr-negative-inf", _edit("lr: 0.01", "lr: -.inf"), r"train\.lr", r"(finite|greater than 0)"),
    spec_case(
        "train-gradient-clipping-inf",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  gradient_clipping: .inf\n"),
        r"train\.gradient_clipping",
        _FINITE,
        line=13,
    ),
    spec_case(
        "train-gradient-clipping-nan",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  gradient_clipping: .nan\n"),
        r"train\.gradient_clipping",
        _FINITE,
    ),
    spec_case(
        "scaling-cpus-per-worker-inf",
        _edit("", "scaling: {cpus_per_worker: .inf}\n"),
        r"scaling\.cpus_per_worker",
        _FINITE,
    ),
    spec_case(
        "scaling-cpus-per-worker-nan",
        _edit("", "scaling: {cpus_per_worker: .nan}\n"),
        r"scaling\.cpus_per_worker",
        _FINITE,
    ),
    spec_case("resume-lease-ttl-inf", _edit("", "resume: {lease_ttl_s: .inf}\n"), r"resume\.lease_ttl_s", _FINITE),
    spec_case("resume-lease-ttl-nan", _edit("", "resume: {lease_ttl_s: .nan}\n"), r"resume\.lease_ttl_s", _FINITE),
    spec_case(
        "optimizer-betas-nan",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {betas: [0.9, .nan]}\n"),
        r"train\.optimizer\.betas\.1",
        _FINITE,
    ),
    spec_case(
        "optimizer-betas-inf",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {betas: [.inf, 0.999]}\n"),
        r"train\.optimizer\.betas\.0",
        _FINITE,
    ),
    spec_case(
        "optimizer-betas-not-below-one",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {betas: [0.9, 1.5]}\n"),
        r"train\.optimizer\.betas\.1",
        r"less than 1",
    ),
    spec_case(
        "optimizer-eps-inf",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {eps: .inf}\n"),
        r"train\.optimizer\.eps",
        _FINITE,
    ),
    spec_case(
        "optimizer-weight-decay-nan",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  optimizer: {weight_decay: .nan}\n"),
        r"train\.optimizer\.weight_decay",
        _FINITE,
    ),
    spec_case(
        "scheduler-min-lr-ratio-nan",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  scheduler: {min_lr_ratio: .nan}\n"),
        r"train\.scheduler\.min_lr_ratio",
        _FINITE,
    ),
    spec_case(
        "save-every-inf-micro-steps",
        _edit("{value: 1, unit: optimizer_steps}", "{value: .inf, unit: micro_steps}"),
        r"checkpoint\.save_every\.value",
        _FINITE,
        line=18,
    ),
    spec_case(
        "save-every-inf-seconds",
        _edit("{value: 1, unit: optimizer_steps}", "{value: .inf, unit: seconds}"),
        r"checkpoint\.save_every\.value",
        _FINITE,
    ),
    spec_case(
        "save-every-nan-shorthand",
        _edit("{value: 1, unit: optimizer_steps}", "'nan seconds'"),
        r"checkpoint\.save_every\.value",
        r"(finite|valid number)",
    ),
    # --- issue 17 §2: train.eval_every (the shape of checkpoint.save_every)
    spec_case(
        "eval-every-seconds",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: '30 seconds'\n"),
        r"train\.eval_every\.unit",
        r"'optimizer_steps' or 'epochs'",
    ),
    spec_case(
        "eval-every-micro-steps",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: {value: 4, unit: micro_steps}\n"),
        r"train\.eval_every\.unit",
        r"'optimizer_steps' or 'epochs'",
    ),
    spec_case(
        "eval-every-no-unit",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: '5'\n"),
        r"train\.eval_every",
        r"write it as '<number> <unit>', e\.g\. '100 optimizer_steps'",
    ),
    spec_case(
        "eval-every-number-without-unit",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: 5\n"),
        r"train\.eval_every",
        r"5 needs a unit: write '5 optimizer_steps' or '5 epochs' \(0 turns evaluation off\)",
    ),
    spec_case(
        "eval-every-unit-missing",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: {value: 5}\n"),
        r"train\.eval_every\.unit",
        r"required field is missing",
    ),
    spec_case(
        "eval-every-fractional",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: 1.5 epochs\n"),
        r"train\.eval_every",
        r"epochs must be a whole number",
    ),
    spec_case(
        "eval-every-negative",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: {value: -2, unit: epochs}\n"),
        r"train\.eval_every\.value",
        r"greater than or equal to 0",
        line=13,
    ),
    spec_case(
        "eval-every-inf",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: {value: .inf, unit: epochs}\n"),
        r"train\.eval_every\.value",
        _FINITE,
    ),
    spec_case(
        "eval-every-huge",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: 10000000000 optimizer_steps\n"),
        r"train\.eval_every\.value",
        r"less than or equal to 1000000000",
    ),
    spec_case(
        "eval-every-unknown-key",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  eval_every: {value: 1, unit: epochs, at: end}\n"),
        r"train\.eval_every\.at",
        r"allowed keys here are: unit, value",
    ),
    # --- issue 14 §6: absurd integers and sizes
    spec_case(
        "train-seed-2-to-the-70",
        _edit("seed: 3", f"seed: {2**70}"),
        r"train\.seed",
        r"less than or equal to 9223372036854775807",
        line=11,
    ),
    spec_case(
        "train-micro-batch-size-10-to-the-30",
        _edit("micro_batch_size: 1", f"micro_batch_size: {10**30}"),
        r"train\.micro_batch_size",
        r"less than or equal to 1048576",
        line=8,
    ),
    spec_case(
        "train-grad-accum-absurd",
        _edit("grad_accum: 2", f"grad_accum: {10**12}"),
        r"train\.grad_accum",
        r"less than or equal to 65536",
    ),
    spec_case(
        "train-epochs-absurd", _edit("epochs: 1", f"epochs: {10**18}"), r"train\.epochs", r"less than or equal to"
    ),
    spec_case(
        "train-max-steps-absurd",
        _edit("epochs: 1", f"max_steps: {2**64}"),
        r"train\.max_steps",
        r"less than or equal to",
    ),
    spec_case("train-lr-absurd", _edit("lr: 0.01", "lr: 1.0e+30"), r"train\.lr", r"less than or equal to 100"),
    spec_case(
        "train-dataloader-workers-absurd",
        _edit("  lr: 0.01\n", "  lr: 0.01\n  dataloader_workers: 100000\n"),
        r"train\.dataloader_workers",
        r"less than or equal to 256",
    ),
    spec_case(
        "train-log-every-absurd",
        _edit("  lr: 0.01\n", f"  lr: 0.01\n  log_every: {10**30}\n"),
        r"train\.log_every",
        r"less than or equal to",
    ),
    spec_case(
        "scaling-num-workers-absurd",
        _edit("", "scaling: {num_workers: 10000000}\n"),
        r"scaling\.num_workers",
        r"at most 4096",
    ),
    spec_case(
        "scaling-elastic-max-ten-million",
        _edit("", "scaling: {num_workers: {min: 1, max: 10000000}}\n"),
        r"scaling\.num_workers\.max",
        r"less than or equal to 4096",
    ),
    spec_case(
        "scaling-cpus-per-worker-absurd",
        _edit("", "scaling: {cpus_per_worker: 1.0e+9}\n"),
        r"scaling\.cpus_per_worker",
        r"less than or equal to 1024",
    ),
    spec_case(
        "checkpoint-keep-last-absurd",
        _edit("keep_last: 0", f"keep_last: {10**20}"),
        r"checkpoint\.keep_last",
        r"less than or equal to",
    ),
    spec_case(
        "failure-max-failures-absurd",
        _edit("", f"failure: {{max_failures: {10**20}}}\n"),
        r"failure\.max_failures",
        r"less than or equal to",
    ),
    spec_case(
        "fault-at-micro-step-absurd",
        _edit("", f"faults: [{{at_micro_step: {10**15}}}]\n"),
        r"faults\.0\.at_micro_step",
        r"less than or equal to",
    ),
    spec_case("name-too-long", _edit("name: linear", "name: " + "a" * 300), r"\bname\b", r"at most 200 characters"),
    spec_case(
        "integer-of-5000-digits",
        _edit("seed: 3", "seed: " + "9" * 5000),
        r"line 11: an integer of 5000",
        r"at most 19 digits",
    ),
    spec_case(
        "deepspeed-config-monitor-api-key",
        _edit("zero_stage: 0\n", "zero_stage: 0\n  config: {wandb: {enabled: false, api_key: sk-123456}}\n"),
        r"deepspeed\.config\.wandb\.api_key",
        r"environment variable.*WANDB_API_KEY",
    ),
]


@pytest.mark.parametrize("edit,field,fix,line", SPEC_CASES)
def test_bad_spec_is_refused_naming_field_and_fix(committed, tmp_path, capsys, edit, field, fix, line):
    storage = committed.storage[len("file://") :]
    text = edit(BASE).replace("@STORAGE@", storage)

    # the library: one SpecError naming the field (and line) and the fix
    with pytest.raises(SpecError) as e:
        parse_spec(text, "job.yaml")
    message = str(e.value)
    assert message.startswith("job.yaml: invalid job spec")
    assert re.search(field, message), message
    assert re.search(fix, message), message
    if line is not None:
        assert f"(line {line})" in message, message
    assert "Traceback" not in message

    # the CLI: validate and run exit 2 with the same paragraph (run never reaches Ray)
    job = tmp_path / "job.yaml"
    job.write_text(text)
    for command in ("validate", "run"):
        rc, out, err = cli(capsys, command, str(job))
        assert rc == 2, (command, out, err)
        assert err.startswith("syncpoint: ")
        assert re.search(field, err) and re.search(fix, err), err
        assert out == ""
        assert_one_paragraph(err)


def assert_one_paragraph(err: str) -> None:
    """A refusal is one short paragraph: no blank line, no traceback, well under 2 KB."""
    assert "Traceback" not in err
    assert "\n\n" not in err.strip(), err
    assert len(err.encode()) < 2048, f"{len(err.encode())} bytes: {err[:300]}..."


# ----------------------------------------------------------------------------- hostile and absurd specs (issue 14 §6)

# `--set` overrides: the same bounds as the job file (validate, run and submit refuse them alike)
SET_CASES = [
    pytest.param("train.lr=.inf", r"train\.lr", _FINITE, id="set-lr-inf"),
    pytest.param("train.gradient_clipping=.nan", r"train\.gradient_clipping", _FINITE, id="set-gradient-clipping-nan"),
    pytest.param("scaling.cpus_per_worker=.inf", r"scaling\.cpus_per_worker", _FINITE, id="set-cpus-per-worker-inf"),
    pytest.param("resume.lease_ttl_s=.inf", r"resume\.lease_ttl_s", _FINITE, id="set-lease-ttl-inf"),
    pytest.param("train.optimizer={betas: [0.9, .nan]}", r"train\.optimizer\.betas\.1", _FINITE, id="set-betas-nan"),
    pytest.param(
        "checkpoint.save_every={value: .inf, unit: micro_steps}",
        r"checkpoint\.save_every\.value",
        _FINITE,
        id="set-save-every-inf",
    ),
    pytest.param(f"train.seed={2**70}", r"train\.seed", r"less than or equal to", id="set-seed-2-to-the-70"),
    pytest.param(
        f"train.micro_batch_size={10**30}",
        r"train\.micro_batch_size",
        r"less than or equal to 1048576",
        id="set-micro-batch-size-10-to-the-30",
    ),
    pytest.param(
        "scaling.num_workers={min: 1, max: 10000000}",
        r"scaling\.num_workers\.max",
        r"less than or equal to 4096",
        id="set-elastic-max-ten-million",
    ),
    pytest.param(
        "train.seed=" + "9" * 5000, r"--set", r"an integer of 5000 characters", id="set-integer-of-5000-digits"
    ),
    pytest.param("task.config.x=&a [*a]", r"--set", r"refers to a node that contains it", id="set-self-alias"),
    pytest.param(
        "task.config.x=" + "[" * 10_000 + "]" * 10_000,
        r"--set",
        r"nested deeper than 32 levels",
        id="set-10000-deep-list",
    ),
    pytest.param(
        "task.config." + ".".join(["a"] * 10_000) + "=1",
        r"--set",
        r"nested deeper than 32 levels",
        id="set-10000-deep-key",
    ),
    pytest.param("task.config.x=" + "a" * (1 << 21), r"--set", r"longer than 1048576 characters", id="set-huge-value"),
]


@pytest.mark.parametrize("override,field,fix", SET_CASES)
def test_hostile_set_override_is_refused_in_one_paragraph(job, capsys, override, field, fix):
    for argv in (["validate", str(job)], ["run", str(job)], ["submit", str(job), "--address", "http://127.0.0.1:9"]):
        rc, out, err = cli(capsys, *argv, "--set", override)
        assert rc == 2, (argv[0], out, err[:500])
        assert re.search(field, err) and re.search(fix, err), err[:500]
        assert out == ""
        assert_one_paragraph(err)


@pytest.mark.parametrize(
    "overrides,fix",
    [
        (("resume.policy=pinned",), r"resume\.policy_args for pinned: state field required \(it takes: state\)"),
        (
            ("resume.policy=best-metric", "resume.policy_args={mode: low}"),
            r"resume\.policy_args for best-metric: mode input should be 'min' or 'max'",
        ),
    ],
    ids=["pinned-without-state", "best-metric-bad-mode"],
)
def test_a_builtin_policys_bad_arguments_end_validate_and_run_before_anything_starts(job, capsys, overrides, fix):
    sets = [a for o in overrides for a in ("--set", o)]
    for argv in (["validate", str(job)], ["run", str(job)]):
        rc, out, err = cli(capsys, *argv, *sets)
        assert rc == 2, (argv[0], out, err[:500])
        assert re.search(fix, err), err[:500]
        assert out == ""
        assert_one_paragraph(err)


def _alias_bomb(levels: int) -> str:
    """The billion-laughs shape, inside task.config: 9**levels leaves from a few hundred bytes."""
    rows = ["    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    rows += [f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(rows) + "\n"


def _in_task_config(extra: str):
    return _edit("    num_samples: 8\n", "    num_samples: 8\n" + extra)


def _block_nesting(depth: int) -> str:
    return "".join("  " * (2 + i) + "a:\n" for i in range(depth)) + "  " * (2 + depth) + "b: 1\n"


# (file content from BASE, or a path to use as the job file; extra argv). Each of these took seconds
# to minutes, hundreds of MB, or ended in a RecursionError/OverflowError/MemoryError traceback.
HOSTILE_CASES = [
    pytest.param(_in_task_config(_alias_bomb(9)), [], r"more than 10000 YAML nodes", id="alias-bomb-9-levels"),
    pytest.param(_in_task_config(_alias_bomb(10)), [], r"more than 10000 YAML nodes", id="alias-bomb-10-levels"),
    pytest.param(
        _edit("  config:\n    num_samples: 8\n", "  config: &c {self: *c}\n"),
        [],
        r"alias \*c refers to a node that contains it",
        id="alias-self-reference",
    ),
    pytest.param(
        _edit("  config:\n    num_samples: 8\n", "  config: &c {<<: *c}\n"),
        [],
        r"alias \*c refers to a node that contains it",
        id="alias-self-merge",
    ),
    pytest.param(
        _in_task_config("    deep: " + "[" * 10_000 + "]" * 10_000 + "\n"),
        [],
        r"nested deeper than 32 levels",
        id="nesting-10000-flow",
    ),
    pytest.param(
        _in_task_config("    deep: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n"),
        [],
        r"nested deeper than 32 levels",
        id="nesting-10000-flow-mappings",
    ),
    pytest.param(
        _in_task_config("    deep:\n" + _block_nesting(600)),
        [],
        r"nested deeper than 32 levels",
        id="nesting-600-block",
    ),
    pytest.param(
        _in_task_config(
            "".join(f"    d{i}: &d{i} " + "[" * 20 + (f"*d{i - 1}" if i else "1") + "]" * 20 + "\n" for i in range(60))
        ),
        [],
        r"nested deeper than 32 levels",
        id="nesting-through-chained-aliases",
    ),
    pytest.param("/dev/zero", [], r"not a regular file", id="dev-zero"),
    pytest.param(_edit("", "# padding\n" * 300_000), [], r"larger than 1048576 bytes", id="huge-file"),
    pytest.param(
        _edit("", "".join(f"k{i}: 0\n" for i in range(4000))),
        [],
        r"unknown key.*more problem",
        id="four-thousand-unknown-keys",
    ),
    pytest.param(
        _edit("", "scaling: {num_workers: {min: 1, max: 10000000}}\n"),
        [],
        r"scaling\.num_workers\.max.*less than or equal to 4096",
        id="elastic-max-ten-million",
    ),
    pytest.param(
        _edit("seed: 3", "seed: " + "9" * 5000), [], r"an integer of 5000 characters", id="integer-of-5000-digits"
    ),
    pytest.param(
        _edit("save_every: {value: 1, unit: optimizer_steps}", "save_every: {value: .inf, unit: micro_steps}"),
        [],
        _FINITE,
        id="save-every-inf",
    ),
    pytest.param(
        lambda t: t,
        [
            "--set",
            "task.config.x=["
            + ", ".join(
                ["&a [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
                + [f"&{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
            )
            + "]",
        ],
        r"more than 10000 YAML nodes",
        id="set-alias-bomb",
    ),
]

# Runs the CLI in one fresh interpreter for the whole corpus (a hang is a timeout, a blow-up is bounded
# by an address-space limit, not this test process), with the launchers replaced by stubs exiting 99.
_DRIVER = r"""
import contextlib, io, json, sys, time, types
def reached(*a, **k):
    raise SystemExit(99)
for mod, attr in (("syncpoint.orchestrator.ray_runner", "run_on_ray"), ("syncpoint.orchestrator.submit", "submit")):
    stub = types.ModuleType(mod); setattr(stub, attr, reached); sys.modules[mod] = stub
from syncpoint.orchestrator.cli import main
results = {}
for case, argvs in json.loads(sys.stdin.read()).items():
    for argv in argvs:
        err, t0 = io.StringIO(), time.monotonic()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code
            except BaseException as e:
                rc, _ = "uncaught", err.write(f"Traceback: {type(e).__name__}")
        results.setdefault(case, []).append(
            {"argv0": argv[0], "rc": rc, "err": err.getvalue(), "seconds": round(time.monotonic() - t0, 3)})
print(json.dumps(results))
"""


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


@pytest.fixture(scope="module")
def hostile_results(committed, tmp_path_factory):
    """Every HOSTILE_CASES input through validate, run and submit, in one subprocess."""
    import subprocess

    tmp = tmp_path_factory.mktemp("hostile")
    base = BASE.replace("@STORAGE@", committed.storage[len("file://") :])
    runs = {}
    for case in HOSTILE_CASES:
        content, extra, _ = case.values
        job = tmp / f"{case.id}.yaml"
        if isinstance(content, str):
            job = Path(content)
        else:
            job.write_text(content(base))
        runs[case.id] = [[cmd, str(job), *extra] for cmd in ("validate", "run")]
        runs[case.id].append(["submit", str(job), "--address", "http://127.0.0.1:9", *extra])
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(runs),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_memory,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("content,extra,fix", HOSTILE_CASES)
def test_hostile_spec_fails_fast_and_bounded(hostile_results, request, content, extra, fix):
    """validate, run and submit: exit 2, one paragraph under 2 KB, no traceback, no launcher, no hang
    (the subprocess timeout bounds a hang; each command takes milliseconds here, see `seconds`)."""
    case = request.node.callspec.id
    assert [r["argv0"] for r in hostile_results[case]] == ["validate", "run", "submit"]
    for r in hostile_results[case]:
        assert r["rc"] == 2, r
        assert re.search(fix, r["err"], re.S), r["err"][:500]
        assert_one_paragraph(r["err"])


@pytest.mark.parametrize(
    "case_id",
    [
        "alias-bomb-10-levels",
        "alias-self-reference",
        "alias-self-merge",
        "nesting-10000-flow",
        "nesting-through-chained-aliases",
        "integer-of-5000-digits",
    ],
)
def test_parse_bounds_hold_without_libyaml(monkeypatch, case_id):
    """The same bounds when PyYAML has no libyaml (the pure-Python event parser): the composer checks them."""
    import syncpoint.orchestrator.spec_file as spec_module

    monkeypatch.setattr(spec_module, "_BoundedLoader", spec_module._PyLoader)
    content, _, fix = next(c.values for c in HOSTILE_CASES if c.id == case_id)
    with pytest.raises(SpecError) as e:
        parse_spec(content(BASE.replace("@STORAGE@", "/tmp/never-written")), "job.yaml")
    assert re.search(fix, str(e.value)), str(e.value)
    assert_one_paragraph(str(e.value))


def test_the_base_spec_itself_is_valid(committed, tmp_path, capsys):
    """Guards the corpus: every case above differs from a spec that loads (the committed run's own)."""
    text = BASE.replace("@STORAGE@", committed.storage[len("file://") :])
    spec = parse_spec(text, "job.yaml")
    assert spec.name == committed.name and spec.train.grad_accum == committed.train.grad_accum
    job = tmp_path / "job.yaml"
    job.write_text(text)
    rc, out, _ = cli(capsys, "validate", str(job))
    assert rc == 0 and json.loads(out)["storage"] == committed.storage


# ----------------------------------------------------------------------------- CLI arguments


@pytest.fixture
def job(committed, tmp_path):
    """A valid job file pointing at the committed run (same storage, same name)."""
    path = tmp_path / "job.yaml"
    path.write_text(BASE.replace("@STORAGE@", committed.storage[len("file://") :]))
    return path


def _arg_case(case_id, argv, fix, marks=()):
    """argv may contain {job}, {tmp}, {run}, {state} placeholders; fix: regex on stderr."""
    return pytest.param(argv, fix, id=case_id, marks=marks)


ARG_CASES = [
    # argparse refusals: SystemExit(2) with the usage line
    _arg_case("no-command", [], r"usage: syncpoint .*required: command"),
    _arg_case("unknown-command", ["teleport"], r"invalid choice: 'teleport' \(choose from .*'run'"),
    _arg_case("run-without-job", ["run"], r"usage: syncpoint run .*required: job"),
    _arg_case("unknown-option", ["validate", "{job}", "--bogus"], r"unrecognized arguments: --bogus"),
    _arg_case("states-without-run-dir", ["states"], r"required: run_dir"),
    _arg_case("drill-without-preempt-at", ["drill", "{job}"], r"--preempt-at.*--storm N"),
    # the job file
    _arg_case(
        "validate-missing-file",
        ["validate", "{tmp}/missing.yaml"],
        r"missing\.yaml.*cannot read the job file.*check the path",
    ),
    _arg_case(
        "run-missing-file", ["run", "{tmp}/missing.yaml"], r"missing\.yaml.*cannot read the job file.*check the path"
    ),
    _arg_case("run-a-directory", ["run", "{tmp}"], r"cannot read the job file.*check the path"),
    _arg_case("job-file-not-utf8", ["validate", "{tmp}/binary.yaml"], r"binary\.yaml.*(UTF-8|utf-8|decode|encoding)"),
    # --set
    _arg_case(
        "set-without-equals",
        ["validate", "{job}", "--set", "novalue"],
        r"--set.*'novalue': write overrides as a\.b=value",
    ),
    _arg_case("set-empty-key", ["validate", "{job}", "--set", "=3"], r"--set.*'=3': write overrides as a\.b=value"),
    _arg_case(
        "set-into-a-scalar", ["validate", "{job}", "--set", "name.x=1"], r"--set.*name\.x: name is not a mapping"
    ),
    _arg_case(
        "set-into-a-nested-scalar",
        ["run", "{job}", "--set", "train.epochs.x=1"],
        r"--set.*train\.epochs\.x: epochs is not a mapping",
    ),
    _arg_case("set-list-index", ["validate", "{job}", "--set", "faults.0.rank=1"], r"\bfaults\b.*valid list"),
    _arg_case(
        "set-bad-value",
        ["run", "{job}", "--set", "train.grad_accum=0"],
        r"train\.grad_accum.*greater than or equal to 1",
    ),
    _arg_case("set-value-not-yaml", ["validate", "{job}", "--set", "train.grad_accum=["], r"--set.*train\.grad_accum"),
    # --metrics-port (checked before the spec is read or Ray starts)
    _arg_case(
        "run-metrics-port-not-a-number",
        ["run", "{job}", "--metrics-port", "http"],
        r"--metrics-port.*'http' is not a TCP port; pass a number from 1 to 65535",
    ),
    _arg_case(
        "run-metrics-port-zero", ["run", "{job}", "--metrics-port", "0"], r"--metrics-port.*'0' is not a TCP port"
    ),
    _arg_case(
        "run-metrics-port-too-high",
        ["run", "{job}", "--metrics-port", "65536"],
        r"--metrics-port.*'65536' is not a TCP",
    ),
    # drill arguments (checked before the reference run is started or any drill directory deleted)
    _arg_case(
        "drill-preempt-at-not-a-number", ["drill", "{job}", "--preempt-at", "abc"], r"--preempt-at.*'abc'.*e\.g\. 13,40"
    ),
    _arg_case(
        "drill-preempt-at-zero", ["drill", "{job}", "--preempt-at", "0"], r"--preempt-at.*increasing micro-steps >= 1"
    ),
    _arg_case(
        "drill-preempt-at-decreasing",
        ["drill", "{job}", "--preempt-at", "5,3"],
        r"--preempt-at.*increasing micro-steps",
    ),
    _arg_case(
        "drill-preempt-at-repeated", ["drill", "{job}", "--preempt-at", "3,3"], r"--preempt-at.*increasing micro-steps"
    ),
    _arg_case("drill-preempt-at-empty", ["drill", "{job}", "--preempt-at", ""], r"--preempt-at.*e\.g\. 13,40"),
    _arg_case(
        "drill-how-teleport",
        ["drill", "{job}", "--preempt-at", "3", "--how", "teleport"],
        r"--how.*'teleport'.*one of crash, sigterm, node",
    ),
    _arg_case(
        "drill-how-count-mismatch",
        ["drill", "{job}", "--preempt-at", "3,4,5", "--how", "crash,sigterm"],
        r"--how.*one for all points or one per point",
    ),
    _arg_case(
        "drill-no-replacement-without-node",
        ["drill", "{job}", "--preempt-at", "3", "--no-replacement"],
        r"--no-replacement.*only applies to --how node",
    ),
    _arg_case(
        "drill-bad-spec", ["drill", "{job}", "--preempt-at", "3", "--set", "train.grad_accum=0"], r"train\.grad_accum"
    ),
    # states
    _arg_case(
        "states-unknown-policy",
        ["states", "{run}", "--policy", "no.such:Policy"],
        r"--policy.*cannot import module 'no\.such'",
    ),
    _arg_case(
        "states-best-metric-bad-mode",
        ["states", "{run}", "--policy", "best-metric", "--policy-args", '{"mode": "sideways"}'],
        r"--policy.*mode input should be 'min' or 'max'",
    ),
    _arg_case("states-policy-args-not-json", ["states", "{run}", "--policy-args", "notjson"], r"--policy-args.*JSON"),
    _arg_case(
        "states-policy-args-not-an-object",
        ["states", "{run}", "--policy-args", "[1]"],
        r"--policy-args.*(object|mapping)",
    ),
    _arg_case("states-pinned-without-state", ["states", "{run}", "--policy", "pinned"], r"--policy(-args)?.*state"),
    _arg_case("states-nonexistent-dir", ["states", "{tmp}/no-such-run"], r"no-such-run"),
    _arg_case("states-empty-dir", ["states", "{tmp}/empty"], r"empty"),
    # digest
    _arg_case("digest-nonexistent", ["digest", "{tmp}/nope"], r"not a committed state.*pass <run>/states/<name>"),
    _arg_case("digest-empty-dir", ["digest", "{tmp}/empty"], r"not a committed state.*pass <run>/states/<name>"),
    _arg_case("digest-a-run-dir", ["digest", "{run}"], r"not a committed state.*pass <run>/states/<name>"),
    _arg_case("digest-torn-state", ["digest", "{tmp}/states/torn"], r"not a committed state.*pass <run>/states/<name>"),
    _arg_case("digest-state-missing-a-file", ["digest", "{tmp}/states/missing-file"], r"not a committed state"),
    _arg_case("digest-a-plain-file", ["digest", "{tmp}/plain.txt"], r"plain\.txt.*not a committed state"),
    _arg_case("digest-manifest-not-json", ["digest", "{tmp}/states/bad-manifest"], r"bad-manifest.*manifest"),
    _arg_case(
        "digest-sha256-mismatch",
        ["digest", "{tmp}/states/bad-sha"],  # a byte appended: past its listed size
        r"bad-sha.*trainer\.json is larger than the \d+ bytes the manifest says \(changed after commit\)",
    ),
    # events
    _arg_case("events-empty-dir", ["events", "{tmp}/empty"], r"no events found; pass a run directory"),
]


def _prepare_tmp(tmp: Path, committed) -> None:
    (tmp / "empty").mkdir()
    (tmp / "plain.txt").write_text("not a state\n")
    (tmp / "binary.yaml").write_bytes(b"\xff\xfe\x00name: \x80\x81\n")
    src = _local(committed.run_url) / "states" / f"{4:012d}"
    variants = {
        "torn": lambda d: (d / "manifest.json").unlink(),
        "missing-file": lambda d: (d / "trainer.json").unlink(),
        "bad-manifest": lambda d: (d / "manifest.json").write_text("{not json"),
        "bad-sha": lambda d: (d / "trainer.json").write_text((d / "trainer.json").read_text() + " "),
    }
    for name, damage in variants.items():  # damaged copies: the committed states stay intact
        dst = tmp / "states" / name
        shutil.copytree(src, dst)
        damage(dst)


@pytest.mark.parametrize("argv,fix", ARG_CASES)
def test_bad_cli_arguments_exit_2_naming_the_argument(committed, job, tmp_path, capsys, argv, fix):
    _prepare_tmp(tmp_path, committed)
    subst = {"{job}": str(job), "{tmp}": str(tmp_path), "{run}": str(_local(committed.run_url))}
    args = []
    for a in argv:
        for k, v in subst.items():
            a = a.replace(k, v)
        args.append(a)
    rc, out, err = cli(capsys, *args)
    assert rc == 2, (rc, out, err)
    assert re.search(fix, err, re.S), err


def test_a_drills_bad_arguments_are_refused_before_the_spec_is_checked(job, capsys, monkeypatch):
    """``--preempt-at``, ``--how`` and ``--no-replacement`` read only the command line: refused before the
    import check (a child importing the task, torch among its imports) or the storage probe starts;
    with good arguments the same job is checked (a missing module: refused by that check)."""
    from syncpoint.orchestrator import import_check

    checked = []
    resolve = import_check.resolve_problems
    monkeypatch.setattr(import_check, "resolve_problems", lambda *a, **k: checked.append(a) or resolve(*a, **k))
    for flag, argv in [
        ("--preempt-at", ["--preempt-at", "abc"]),
        ("--how", ["--preempt-at", "3", "--how", "teleport"]),
        ("--no-replacement", ["--preempt-at", "3", "--no-replacement"]),
    ]:
        rc, _, err = cli(capsys, "drill", str(job), *argv)
        assert rc == 2 and f"{flag}: invalid argument" in err and checked == [], (argv, err)
    rc, _, err = cli(capsys, "drill", str(job), "--preempt-at", "3", "--set", "task.path=no_such_module_here:build")
    assert rc == 2 and "no_such_module_here" in err and len(checked) == 1, err


def test_a_metrics_port_held_by_another_process_or_on_a_local_run_exits_2(job, capsys):
    """A port something listens on would fail Ray's metrics agent after the cluster started: refused
    first, naming it; ``--local`` has no Ray to serve metrics."""
    import socket

    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        rc, _, err = cli(capsys, "run", str(job), "--metrics-port", str(port))
        assert rc == 2 and re.search(
            rf"--metrics-port.*port {port} cannot be listened on here.*pass a free port", err, re.S
        )
        assert_one_paragraph(err)
    rc, _, err = cli(capsys, "run", str(job), "--local", "--metrics-port", str(port))
    assert rc == 2 and "--metrics-port is for a run on Ray; --local runs the ranks here without Ray" in err
    assert_one_paragraph(err)


# ----------------------------------------------------------------------------- storage URLs

STORAGE_CASES = [
    pytest.param(
        ["run", "{job}", "--set", "storage=nosuch://x"],
        r"storage 'nosuch://x' is not usable: .*nosuch.*Use a local path, file://, memory://",
        id="run-unknown-scheme",
    ),
    pytest.param(
        ["drill", "{job}", "--preempt-at", "3", "--set", "storage=nosuch://x"],
        r"storage 'nosuch://x' is not usable",
        id="drill-unknown-scheme",
    ),
    pytest.param(
        ["run", "{job}", "--set", "storage={tmp}/plain.txt"],
        r"storage 'file://.*plain\.txt' is not usable: NotADirectoryError",
        id="run-storage-is-a-file",
    ),
    pytest.param(
        ["run", "{job}", "--set", "storage=http://127.0.0.1:9/x"],
        r"storage 'http://127\.0\.0\.1:9/x' is not usable",
        id="run-read-only-backend",
    ),
    pytest.param(
        ["validate", "{job}", "--set", "storage=file://"],
        r"\bstorage\b.*file://",
        id="validate-file-scheme-without-path",
    ),
    pytest.param(["states", "nosuch://x/linear"], r"nosuch", id="states-unknown-scheme"),
    pytest.param(["digest", "nosuch://x/linear/states/000000000004"], r"nosuch", id="digest-unknown-scheme"),
    pytest.param(["events", "nosuch://x/linear"], r"nosuch", id="events-unknown-scheme"),
]


@pytest.mark.parametrize("argv,fix", STORAGE_CASES)
def test_bad_storage_url_exits_2(committed, job, tmp_path, capsys, argv, fix):
    _prepare_tmp(tmp_path, committed)
    args = [a.replace("{job}", str(job)).replace("{tmp}", str(tmp_path)) for a in argv]
    rc, out, err = cli(capsys, *args)
    assert rc == 2, (rc, out, err)
    assert re.search(fix, err, re.S), err


def test_unknown_storage_scheme_in_process_names_the_protocol(committed):
    with pytest.raises(ValueError, match="Protocol not known: nosuch"):
        run(linear_spec("nosuch://x", "task.config.num_samples=8", "train.grad_accum=2"))


# ----------------------------------------------------------------------------- bad input found at run time


class _NoLength(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def no_length_task(config: dict):
    """A task whose dataset is a plain iterable (no __len__, no state):
    tests.integration.orchestrator.test_cli_bad_input:no_length_task."""
    from tests.tasks import linear

    task = linear(config)
    task.dataset = _NoLength()
    return task


NOT_A_FUNCTION = "a string, not a function"


def no_eval_length_task(config: dict):
    """A task whose eval set is not map-style: tests.integration.orchestrator.test_cli_bad_input:no_eval_length_task."""
    from tests.tasks import linear

    task = linear(config)
    task.eval_dataset = _NoLength()
    return task


# (overrides on the committed run's own spec, expected exception, message regex)
RUNTIME_CASES = [
    pytest.param(
        ("task.path=no_such_module:build",),
        TaskError,
        r"task\.path: cannot import module 'no_such_module'.*"
        r"Point it at a function 'package\.module:function'",
        id="task-module-missing",
    ),
    pytest.param(
        ("task.path=tests.tasks:no_such_function",),
        TaskError,
        r"task\.path: module 'tests\.tasks' has no attribute 'no_such_function'.*Point it at a function",
        id="task-attribute-missing",
    ),
    pytest.param(
        ("task.path=tests.integration.orchestrator.test_cli_bad_input:NOT_A_FUNCTION",),
        TaskError,
        r"task\.path: 'tests\.integration\.orchestrator\.test_cli_bad_input:NOT_A_FUNCTION' is a value of type "
        r"\w+, not a function "
        r"written in Python; it is not called.*a function 'package\.module:function' returning a Task",
        id="task-not-callable",
    ),
    pytest.param(
        ("task.path=builtins:len",),
        TaskError,
        r"task\.path: 'builtins:len' is a builtin function, not a function written in Python; it is not "
        r"called",
        id="task-builtin-not-called",
    ),
    pytest.param(
        ("task.path=json:dumps",),
        TaskError,
        r"task\.path: 'json:dumps' returned str, expected syncpoint\.Task",
        id="task-returns-no-task",
    ),
    pytest.param(
        ("task.path=tests.integration.orchestrator.test_cli_bad_input:no_length_task",),
        TaskError,
        r"task\.path: .* returned a plain iterable dataset \(_NoLength\): it has no state_dict\(\)/"
        r"load_state_dict\(\).*cannot be resumed exactly\. Return instead a map-style dataset \(__len__ and "
        r"__getitem__.*a Hugging Face datasets\.IterableDataset .*split_dataset_by_node.*an IterableDataset "
        r"with state_dict\(\)/load_state_dict\(\).*split\(rank, world_size\)",
        id="task-dataset-plain-iterable",
    ),
    pytest.param(
        ("train.eval_every=1 epochs",),
        TaskError,
        r"train\.eval_every is 1 epochs but the task \(tests\.light_tasks:linear\) returns no Task\.eval_dataset: "
        r"return one from the task function, or set train\.eval_every to 0",
        id="eval-every-without-eval-set",
    ),
    pytest.param(
        ("task.path=tests.tasks:linear_eval", "task.config.eval_samples=0", "train.eval_every=1 epochs"),
        TaskError,
        r"Task\.eval_dataset of tests\.tasks:linear_eval is empty",
        id="eval-set-empty",
    ),
    pytest.param(
        ("task.path=tests.integration.orchestrator.test_cli_bad_input:no_eval_length_task",),
        TaskError,
        r"eval_dataset without __len__/__getitem__ \(Task\.eval_dataset must be map-style",
        id="eval-set-not-map-style",
    ),
    pytest.param(
        ("task.config.num_samples=0",),
        DataLayoutError,
        r"the dataset has 0 samples, fewer than one global micro-batch .*use more samples",
        id="dataset-empty",
    ),
    pytest.param(
        ("task.config.num_samples=3", "train.micro_batch_size=4"),
        DataLayoutError,
        r"the dataset has 3 samples, fewer than one global micro-batch "
        r"\(train\.micro_batch_size 4 x 1 workers = 4\); "
        r"use more samples, a smaller micro_batch_size or fewer workers",
        id="dataset-smaller-than-one-global-batch",
    ),
    # bad input relative to the committed run: refused before a batch is trained, nothing deleted
    pytest.param(
        ("train.seed=4",),
        ResumeRefused,
        r"none is resumable; refusing to start over.*incompatible\s+sampler seed differs",
        id="resume-incompatible-seed",
    ),
    pytest.param(
        ("train.grad_accum=4",),
        ResumeRefused,
        r"none is resumable.*incompatible",
        id="resume-incompatible-accumulation",
    ),
    pytest.param(
        ("resume.policy=fresh",),
        ResumeRefused,
        r"resume\.policy fresh, but .*/linear/states already holds states; set resume\.on_existing",
        id="resume-fresh-refuses-existing-states",
    ),
    pytest.param(
        ("resume.policy=pinned", "resume.policy_args={state: 5}"),
        ResumeRefused,
        r"pinned state 5 does not exist",
        id="resume-pinned-state-missing",
    ),
    pytest.param(
        ("name=linear-finetune", "resume.init_from=file:///nonexistent/run"),
        ResumeRefused,
        r"resume\.init_from: file:///nonexistent/run holds no committed state",
        id="init-from-nothing",
    ),
    pytest.param(
        ("name=linear-finetune", "resume.init_from=@RUN@/states/000000000005"),
        ResumeRefused,
        r"resume\.init_from: .*/linear/states/000000000005 is not a committed state",
        id="init-from-missing-state",
    ),
    pytest.param(
        ("scaling.use_gpu=true",),
        JobConfigError,
        r"scaling\.use_gpu: true, but torch sees no CUDA device on this worker .*set scaling\.use_gpu: false",
        id="use-gpu-without-cuda",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU"),
    ),
    pytest.param(
        ("checkpoint.save_trigger=no.such:Trigger",),
        Exception,
        r"checkpoint\.save_trigger.*no\.such",
        id="save-trigger-missing",
    ),
    pytest.param(("resume.policy_args={bogus: 1}",), Exception, r"resume\.policy_args", id="policy-args-unexpected"),
    pytest.param(
        ("train.scheduler={type: custom, path: 'tests.tasks:no_such_schedule'}",),
        JobConfigError,
        r"train\.scheduler\.path: module 'tests\.tasks' has no attribute 'no_such_schedule'.*"
        r"fn\(position: int, total: int\) -> float",
        id="custom-schedule-missing",
    ),
    pytest.param(
        ("train.optimizer.no_decay=[]",),
        ResumeRefused,
        r"none is resumable.*parameter groups differ \(train\.optimizer\.no_decay / Task\.optimizer\).*"
        r"resume\.reset_optimizer",
        id="resume-incompatible-param-groups",
    ),
]


@pytest.mark.parametrize("overrides,error,message", RUNTIME_CASES)
def test_runtime_bad_input_raises_specific_error(committed, overrides, error, message):
    """Same storage (and, but for the init_from cases, name) as the committed run: its states stay intact."""
    overrides = [o.replace("@RUN@", committed.run_url) for o in overrides]
    spec = linear_spec(
        committed.storage,
        "task.path=tests.light_tasks:linear",
        "task.config.num_samples=8",
        "train.grad_accum=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *overrides,
    )
    assert spec.storage == committed.storage
    with pytest.raises(error) as e:
        run(spec)
    assert re.search(message, str(e.value), re.S), str(e.value)
    assert "Traceback" not in str(e.value)


def test_good_input_still_resumes_the_committed_run(committed):
    """Control for the guard: the committed run's own spec resumes from its final state and writes nothing."""
    result = run(committed)
    assert result.resumed_from == f"{8:012d}" and result.final_state == f"{8:012d}"
