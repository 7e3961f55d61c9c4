"""Build the DeepSpeed engine from the spec: DeepSpeed itself is the engine, on the CPU (gloo) or
on this rank's GPU (NCCL), as ``scaling.use_gpu`` says (``syncpoint.workers.training.device`` picks the device)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import JobConfigError
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.contracts.state_identity import BufferRecord, ParameterDtypes
from syncpoint.workers.training.compile_cache import private_compile_cache
from syncpoint.workers.training.device import prepare_op_builds
from syncpoint.workers.training.param_groups import (
    ATTRIBUTE,
    GroupSettings,
    ParamGroup,
    Restored,
    builtin_groups,
    layout_of,
    settings_of,
    spec_key,
)
from syncpoint.workers.training.position import TrainingPosition

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


def zero_config(spec: JobSpec) -> JSONObject:
    """``zero_optimization``: the stage and the offload targets, nothing that changes the arithmetic.

    Why ``stage3_param_persistence_threshold: 0`` at stage 3: DeepSpeed otherwise keeps small
    parameters whole on every rank ("persistent"), so which tensors are partitioned would depend on
    their size; with 0 every parameter is partitioned and the state files have one layout. The
    16-bit gather on save stays off: the final export gathers the partitions itself (one collective
    at the end instead of one per save).
    """
    d = spec.deepspeed
    zero: JSONObject = {"stage": d.zero_stage}
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": d.offload_optimizer}
    if d.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_gather_16bit_weights_on_model_save"] = False
        if d.offload_params != "none":
            zero["offload_param"] = {"device": d.offload_params}
    return zero


def deepspeed_config(spec: JobSpec, grad_accum: int | None = None, *, task_optimizer: bool = False) -> JSONObject:
    """The DeepSpeed config the spec describes (``grad_accum``: the layout's, when elastic)."""
    t, d = spec.train, spec.deepspeed
    zero = zero_config(spec)
    cfg: JSONObject = {  # DeepSpeed reads its config as a JSON document
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum or t.grad_accum,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "gradient_clipping": t.gradient_clipping,
        "bf16": {"enabled": d.precision == "bf16"},
        "fp16": {"enabled": d.precision == "fp16"},
        # DeepSpeed checks that every rank saves under the same tag with two all-reduces per save, on
        # the loop; syncpoint's tag is one constant (ENGINE_TAG), the state's name its directory
        "checkpoint": {"tag_validation": "Ignore"},
    }
    if d.offload_optimizer != "none" and (task_optimizer or t.optimizer.type == "sgd"):
        # DeepSpeed insists on its CPU Adam for offload unless told otherwise; SGD has no CPU
        # counterpart there, and torch's SGD steps the offloaded fp32 partitions on the CPU as well.
        # A Task.optimizer is the user's choice: it steps the offloaded partitions on the CPU as it
        # is (return DeepSpeedCPUAdam from Task.optimizer for DeepSpeed's fast CPU kernel).
        cfg["zero_force_ds_cpu_optimizer"] = False
    cfg.update(d.config)
    return cfg


def make_optimizer(spec: JobSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The spec's built-in optimizer over the param groups ``train.optimizer.no_decay`` makes
    (``syncpoint.workers.training.param_groups.builtin_groups``: decaying parameters, then the rest with no decay)."""
    o, lr = spec.train.optimizer, spec.train.lr
    groups = builtin_groups(model, o.weight_decay, o.no_decay)
    if spec.deepspeed.offload_optimizer != "none" and o.type in ("adamw", "adam"):
        return _cpu_adam(spec, groups)
    if o.type == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.type == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)


def _cpu_adam(spec: JobSpec, groups: list[ParamGroup]) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam, which ZeRO-Offload requires (a JIT-built op, cached in
    ``~/.cache/torch_extensions``). ``adamw_mode`` keeps AdamW's decoupled weight decay; Adam's
    L2 decay otherwise. Same hyper-parameters and groups as the torch optimizer it replaces."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    o = spec.train.optimizer
    return DeepSpeedCPUAdam(
        groups,
        lr=spec.train.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        adamw_mode=o.type == "adamw",
    )


def build_engine(
    spec: JobSpec,
    model: torch.nn.Module,
    grad_accum: int | None = None,
    task_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
) -> DeepSpeedEngine:
    """DeepSpeed over the task's optimizer (``Task.optimizer``) or the spec's built-in one.

    The param groups' layout is read before DeepSpeed flattens them, and every group's
    hyper-parameters are snapshotted right after, before any state is loaded
    (``syncpoint.workers.training.param_groups.GroupSettings``, kept on the engine as ``syncpoint_groups``)."""
    import deepspeed

    prepare_op_builds()  # before the optimizer: DeepSpeedCPUAdam JIT-builds its op

    if task_optimizer is not None:
        optimizer = task_optimizer(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise JobConfigError(
                f"Task.optimizer returned {type(optimizer).__name__}; it must return a "
                "torch.optim.Optimizer built over the model's parameters (any param groups)"
            )
    else:
        optimizer = make_optimizer(spec, model)
    layout = layout_of(optimizer, model)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        dist_init_required=False,
        config=deepspeed_config(spec, grad_accum, task_optimizer=task_optimizer is not None),
    )
    settings = GroupSettings.snapshot(
        engine.optimizer.param_groups, layout, type(optimizer).__name__ if task_optimizer is not None else None
    )
    setattr(engine, ATTRIBUTE, settings)
    if spec.train.compile:  # in place (the state dict's names unchanged): compiled at the first micro-step
        private_compile_cache()
        engine.compile()
    return engine


def model_fingerprint(model: torch.nn.Module) -> str:
    """Names, shapes and ``requires_grad`` of every parameter: what a state's weights must match to
    load at all (dtypes and buffers are recorded beside it: ``parameter_dtypes``, ``model_buffers``)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        # ZeRO-3 replaces each parameter by an empty placeholder and keeps its shape in ds_shape
        h.update(f"{name}:{tuple(getattr(p, 'ds_shape', p.shape))}:{p.requires_grad};".encode())
    return h.hexdigest()[:16]


def model_buffers(model: torch.nn.Module) -> list[BufferRecord]:
    """(name, shape, dtype) of every buffer the module's state dict holds (persistent ones: the
    rest are rebuilt by the model and never saved), in ``named_buffers`` order.

    Why beside the fingerprint: a buffer of another shape cannot load (a BatchNorm's running
    statistics), and one of another dtype loads cast, not exactly; recorded per buffer, so
    selection names the one that changed before any tensor is read."""
    return [
        BufferRecord(name=name, shape=[int(n) for n in b.shape], dtype=str(b.dtype).removeprefix("torch."))
        for name, b in persistent_buffers(model).items()
    ]


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers the module's state dict holds, by name, in ``named_buffers`` order (a buffer
    registered ``persistent=False`` is rebuilt by the model and never saved)."""
    modules = dict(model.named_modules())
    out = {}
    for name, b in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in getattr(modules.get(owner), "_non_persistent_buffers_set", ()):
            out[name] = b
    return out


def parameter_dtypes(model: torch.nn.Module) -> ParameterDtypes:
    """The parameters' dtype (the most common one) and every parameter of another dtype, by name:
    a parameter whose dtype changed loads cast, not exactly; the fingerprint covers names and
    shapes only (it is compared as computed for states written before dtypes were recorded)."""
    dtypes = [(name, str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]
    counts: dict[str, int] = {}
    for _, d in dtypes:
        counts[d] = counts.get(d, 0) + 1
    common = max(counts, key=lambda d: counts[d]) if counts else ""
    return ParameterDtypes(common=common, others={name: d for name, d in dtypes if d != common})


def apply_hyperparameters(engine: DeepSpeedEngine, spec: JobSpec, running: list[JSONObject] | None = None) -> Restored:
    """Config wins for what the user sets; the state supplies running state. After a load, every
    param group's hyper-parameters come back from the live task/spec (the snapshot taken when the
    engine was built), group by group, except the keys the state records as running state
    (``running``: the optimizer itself changed them; ``syncpoint.workers.training.param_groups``).

    DeepSpeed's (and torch's) optimizer load restores the saved param groups, so without this an
    edited weight decay, beta or a group's base rate would silently keep the state's value.
    Returns the lines for the log: each changed setting (the state's value and the live one), and
    each running value kept although its initial value changed.
    """
    settings = settings_of(engine)
    restored = settings.restore(engine.optimizer.param_groups, spec_key(settings.task_class is not None), running)
    resync_cpu_adam(engine)  # also a post-load step: the loop calls this right after every load
    return Restored(list(dict.fromkeys(restored.changes)), list(dict.fromkeys(restored.kept)))


def set_counters(engine: DeepSpeedEngine, at: TrainingPosition, *, resumed: bool) -> None:
    """Put DeepSpeed's step counters where the uninterrupted run has them at this position.

    Why: a loss may read them (``engine.micro_steps``, ``global_steps``, ``global_samples``,
    ``skipped_steps``: curricula, warm-ups, logging), and DeepSpeed's load restores only some,
    only sometimes: never ``micro_steps``, and none on a module-only load (``resume.reset_optimizer``,
    another world size), while ``init_from`` with its optimizer brings the other run's. The
    position decides them all: one ``engine.step()`` per micro-batch, ``global_steps`` per
    optimizer step, ``global_samples`` a global batch per step (DeepSpeed's managed accumulation;
    the micro-batches' samples in its unmanaged mode). ``skipped_steps`` (fp16 overflows) is only
    in DeepSpeed's files: a full load restores it, a module-only load leaves it at 0, and a fresh
    start or ``init_from`` starts it at 0."""
    engine.micro_steps = at.global_micro_step
    engine.global_steps = at.optimizer_step
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    engine.global_samples = at.optimizer_step * engine.train_batch_size() if managed else at.global_samples
    if not resumed:
        engine.skipped_steps = 0


def resync_cpu_adam(engine: DeepSpeedEngine) -> int:
    """Bring DeepSpeed's CPU Adam kernel to the loaded step the way the uninterrupted run got there.

    Why: the C++ op (ops/csrc/includes/cpu_adam.h ``IncrementStep``) keeps beta1^t and beta2^t as
    float products, multiplied once per step, and recomputes them with ``pow`` when the step it
    is handed is not its last + 1, i.e. on the first step after a load. ``pow`` rounds
    differently from the product, so the first resumed update differs in the last bits (measured:
    losses from the second resumed step on). Replaying steps 1..t on a one-element scratch tensor
    (lr 0, no decay) leaves the kernel holding the same products; nothing else is touched. Costs
    one tiny kernel call per optimizer step so far. Returns the step replayed to (0: nothing to do).
    """
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if type(base).__name__ != "DeepSpeedCPUAdam":
        return 0
    steps = [int(st["step"]) for st in base.state.values() if "step" in st]
    if not steps or max(steps) <= 0:
        return 0
    # One kernel call per group and step, with each group's betas, as DeepSpeedCPUAdam.step makes
    # them (the kernel recomputes with pow whenever the betas differ from the previous call's, so
    # groups with other betas must be replayed in their order too; equal betas: one product per step).
    groups = [g for g in base.param_groups if g["params"]] or base.param_groups[:1]
    if int(engine.zero_optimization_stage()) == 3:
        groups = base.param_groups  # stage 3 fills the groups only for a step: every group steps each time
    scratch = [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    for t in range(1, max(steps) + 1):
        for group in groups:
            beta1, beta2 = group["betas"]
            base.ds_opt_adam.adam_update(
                base.opt_id, t, 0.0, beta1, beta2, group["eps"], 0.0, group["bias_correction"], *scratch
            )
    return max(steps)


def set_lr(engine: DeepSpeedEngine, factor: float) -> list[float]:
    """The schedule's factor on each param group's own base learning rate; returns the rates set."""
    return settings_of(engine).set_factor(engine.optimizer.param_groups, factor)
