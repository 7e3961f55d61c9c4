"""Parameter groups: which parameters share hyper-parameters, what each group's are, and their layout.

Why one module: three rules meet here. The spec's built-in optimizer splits the model into a
decaying and a non-decaying group (``train.optimizer.no_decay``), a ``Task.optimizer`` brings any
groups it likes; either way (1) the schedule multiplies each group's *own* base learning rate,
(2) after a load every group's hyper-parameters come back from the live task/spec, not the state
("config wins", per group), and (3) the layout (how many groups, which parameters) is part of a
state's identity, because DeepSpeed flattens and partitions the moments per group.

Rules (2) and (1) need each group's live values as built, before a state's param groups overwrite
them: ``GroupSettings`` snapshots every key of every group except ``params`` right after the
engine is built (the snapshot lives beside the engine, never in the saved optimizer state, so the
state files do not change).

Config wins only for what the user sets. Some optimizers keep running state in their groups
(Prodigy's ``d``, ``d_max``, ``d_numerator``, ``k``; D-Adaptation; schedule-free's counters), often
under keys their constructor also puts in ``defaults``, so a key's name cannot tell. What can: a
key is *running state* once the optimizer itself changed it since it was built. Every save
records, per group, the snapshot keys whose value differs from the as-built one (``lr`` and
``initial_lr`` follow the schedule and never count), with each one's as-built value
(``OptimizerRecord.running``); after a load those keys keep the state's value and every other
snapshot key takes the live one. Keys absent at build (added at the first step) are no snapshot
key: they always keep the state's value. A state without the record takes every snapshot key
from the live run.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import JobConfigError
from syncpoint.policies.contracts.state_identity import ParamGroupRecord

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

_NORM_TYPES: tuple[type, ...] = (
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.modules.batchnorm._NormBase,
    *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
)
# keys that follow the schedule, not the config: never logged as a config change
_SCHEDULED = ("lr", "initial_lr")
# the built-in optimizer's keys the spec decides (each change is logged under train.optimizer.<key>)
_SPEC_KEYS = ("weight_decay", "betas", "eps", "momentum")
ATTRIBUTE = "syncpoint_groups"  # where build_engine keeps the settings on the engine


def is_norm(module: torch.nn.Module) -> bool:
    """A normalization module: torch's own, or any class named like one (HF's LlamaRMSNorm, T5LayerNorm...)."""
    return isinstance(module, _NORM_TYPES) or "Norm" in type(module).__name__


def default_no_decay(model: torch.nn.Module) -> set[str]:
    """Names kept out of weight decay by default: biases (a name whose last part ends in ``bias``:
    ``bias``, attention's ``in_proj_bias``), and every parameter a normalization module owns
    directly (as HF Trainer and nanoGPT-style code do)."""
    excluded = {name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1].endswith("bias")}
    norm_params = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(recurse=False)}
    excluded |= {name for name, p in model.named_parameters() if id(p) in norm_params}
    return excluded


def decay_split(
    model: torch.nn.Module, patterns: list[str] | None
) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    """(decaying, not decaying) trainable parameters in ``named_parameters`` order.

    ``patterns`` None: ``default_no_decay``; otherwise a name matched by any fnmatch pattern."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if patterns is None:
        excluded = default_no_decay(model)
    else:
        excluded = {n for n, _ in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)}
    return [(n, p) for n, p in named if n not in excluded], [(n, p) for n, p in named if n in excluded]


# A torch optimizer's param group: ``params`` and the optimizer's own settings, of whatever types it
# takes. Only copied, compared and (``lr``) set here, so each value is an ``object``.
ParamGroup: TypeAlias = "dict[str, object]"


def builtin_groups(model: torch.nn.Module, weight_decay: float, patterns: list[str] | None) -> list[ParamGroup]:
    """The built-in optimizer's param groups: decaying parameters first, then the others with
    ``weight_decay`` 0; one group when either side is empty (``no_decay: []``: one group).

    Why the split does not look at ``weight_decay``: editing it between attempts must stay a
    hyper-parameter change (config wins), not a change of the group layout (refused)."""
    decay, no_decay = decay_split(model, patterns)
    groups = [
        {"params": [p for _, p in decay], "weight_decay": weight_decay},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]] or [{"params": [], "weight_decay": weight_decay}]


@dataclass(frozen=True)
class GroupLayout:
    """One group as a state's moments are laid out: parameter count, elements, a hash of the names."""

    params: int
    numel: int
    names: str | None

    def record(self) -> ParamGroupRecord:
        return ParamGroupRecord(params=self.params, numel=self.numel, names=self.names)


def layout_of(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> tuple[GroupLayout, ...]:
    """Each param group's layout, read from the optimizer as the task or the spec built it (before
    DeepSpeed replaces its params by flat partitions). A parameter the model does not name hashes as
    '?'. Refuses (``JobConfigError``) an empty group, a parameter in two groups, or one not in the model."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    out = []
    for i, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        if not params:
            raise JobConfigError(
                f"the optimizer's param group {i} holds no parameters; DeepSpeed cannot flatten an "
                "empty group: leave it out (Task.optimizer) or check train.optimizer.no_decay"
            )
        h = hashlib.sha256()
        for p in params:
            if id(p) in seen:
                raise JobConfigError(
                    f"a parameter ({names.get(id(p), '?')}) is in more than one param group of "
                    "the optimizer; each parameter belongs to exactly one group (Task.optimizer)"
                )
            seen.add(id(p))
            h.update(f"{names.get(id(p), '?')};".encode())
        out.append(
            GroupLayout(
                params=len(params),
                numel=sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
                names=h.hexdigest()[:16],
            )
        )
    return tuple(out)


@dataclass
class Restored:
    """What a restore did, for the log: ``changes`` (warnings) one per hyper-parameter the user
    changed, ``kept`` (info) one per running value kept although its initial value changed."""

    changes: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


@dataclass
class GroupSettings:
    """Every param group's live hyper-parameters as built, the layout, and who decided them.

    ``task_class``: the optimizer's class name when ``Task.optimizer`` built it (the optimizer
    type a state records), None for the spec's built-in optimizer. ``running``: per group, the
    snapshot keys known to be running state (the optimizer changed them in this attempt, or the
    loaded state recorded them), each with the as-built value the state records."""

    base: list[ParamGroup]
    layout: tuple[GroupLayout, ...]
    task_class: str | None = None
    _lrs: list[Any] = field(default_factory=list)
    running: list[JSONObject] = field(default_factory=list)

    @classmethod
    def snapshot(
        cls, param_groups: Iterable[ParamGroup], layout: tuple[GroupLayout, ...], task_class: str | None
    ) -> GroupSettings:
        base = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in param_groups]
        return cls(
            base=base,
            layout=layout,
            task_class=task_class,
            _lrs=[g.get("initial_lr", g["lr"]) for g in base],
            running=[{} for _ in base],
        )

    @property
    def layout_record(self) -> list[ParamGroupRecord]:
        return [g.record() for g in self.layout]

    def lrs(self, factor: float) -> list[float]:
        """Each group's learning rate at this schedule factor: its own base rate times the factor."""
        return [float(lr * factor) for lr in self._lrs]

    def set_factor(self, param_groups: list[ParamGroup], factor: float) -> list[float]:
        for group, lr in zip(param_groups, self._lrs, strict=True):
            group["lr"] = lr * factor
        return self.lrs(factor)

    def running_record(self, param_groups: list[ParamGroup]) -> list[JSONObject]:
        """At a save (every rank, together): per group, each snapshot key the optimizer changed
        so far, with its as-built value (``None`` where JSON cannot hold it) for ``trainer.json``.

        Once changed, a key stays running state. The ranks' findings are united (one small
        collective per save): at ZeRO 1/2 each rank's optimizer sees only its own partition, and
        every rank must restore the same keys the same way."""
        for i, (group, base) in enumerate(zip(param_groups, self.base, strict=True)):
            for key, built in base.items():
                if key not in _SCHEDULED and key in group and not _same(group[key], built):
                    self.running[i].setdefault(key, _json_value(built))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            found: list[list[JSONObject] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(found, self.running)
            for other in found:
                for mine, theirs in zip(self.running, other or [], strict=False):
                    for key, built in theirs.items():
                        mine.setdefault(key, built)
        return [dict(sorted(g.items())) for g in self.running]

    def restore(
        self,
        param_groups: list[ParamGroup],
        spec_keys: Callable[[str], bool],
        running: list[JSONObject] | None = None,
    ) -> Restored:
        """After a load, per group: the running keys (``running``, the state's record) keep the
        state's value; every other snapshot key comes back from the live run (config wins), with
        one line per setting the user changed."""
        if len(param_groups) != len(self.base):
            raise JobConfigError(
                f"the loaded optimizer has {len(param_groups)} param group(s), this run builds "
                f"{len(self.base)}: the state's group layout does not fit (resume.reset_optimizer)"
            )
        for mine, recorded in zip(self.running, running or [], strict=False):
            for key, built in recorded.items():
                mine.setdefault(key, built)
        out = Restored()
        many = len(self.base) > 1
        for i, (group, base) in enumerate(zip(param_groups, self.base, strict=True)):
            for key, want in base.items():
                have = group.get(key)
                if key in self.running[i] and key in group:
                    before = self.running[i][key]  # the state's as-built value (None: not known)
                    if spec_keys(key) and before is not None and not _same(_json_value(want), before):
                        out.kept.append(self._kept_line(i, key, have, before, want, many))
                    continue
                if key not in _SCHEDULED and have is not None and spec_keys(key) and not _same(have, want):
                    out.changes.append(self._change_line(i, key, have, want, many))
                group[key] = copy.deepcopy(want)
        return out

    def _where(self, i: int, key: str, many: bool) -> str:
        if self.task_class is None:
            return f"train.optimizer.{key}" + (f" (param group {i})" if many else "")
        return f"Task.optimizer param group {i} {key}"

    def _change_line(self, i: int, key: str, have: Any, want: Any, many: bool) -> str:
        have, want = _norm(have), _norm(want)
        if self.task_class is None:
            return f"{self._where(i, key, many)}: the state had {have!r}, the spec says {want!r}; the spec wins"
        return f"{self._where(i, key, many)}: the state had {have!r}, the task says {want!r}; the task wins"

    def _kept_line(self, i: int, key: str, have: Any, before: Any, want: Any, many: bool) -> str:
        return (
            f"{self._where(i, key, many)}: running state (the optimizer changes it as it trains): the state's "
            f"value {_norm(have)!r} is kept; its initial value changed from {before!r} to {_norm(want)!r}, "
            "which only a fresh optimizer state starts from (resume.reset_optimizer: true)"
        )


def _norm(v: Any) -> Any:
    """Compare betas saved as a list (after a load) with the tuple the optimizer was built with."""
    return tuple(v) if isinstance(v, list) else v


def _same(a: Any, b: Any) -> bool:
    """Whether two group values are equal: tensors by value (shape and dtype included), NaN equal
    to NaN, a list equal to the tuple it was saved from; never raises."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    a, b = _norm(a), _norm(b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == does not give a bool: not known equal
        return False


def _json_value(v: Any) -> Any:
    """A group value as ``trainer.json`` can hold it exactly (finite numbers, strings, booleans,
    None, lists of those; a tuple as a list), else None: not known."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (list, tuple)):
        items = [_json_value(x) for x in v]
        return None if any(x is None for x in items) else items
    return None


def portable_values(group: ParamGroup) -> JSONObject:
    """A param group's values that JSON holds exactly (every key but ``params``; a tensor or any
    other object is left out): what the world-size-independent optimizer state carries."""
    out = {}
    for key, value in group.items():
        if key != "params" and (value is None or _json_value(value) is not None):
            out[key] = _json_value(value)
    return out


def settings_of(engine: DeepSpeedEngine) -> GroupSettings:
    """The param-group settings recorded on the engine when it was built."""
    settings = getattr(engine, ATTRIBUTE, None)
    if settings is None:
        raise RuntimeError(
            "the engine was not built by syncpoint.workers.training.engine.build_engine (no param-group snapshot)"
        )
    return settings


def spec_key(task_built: bool) -> Callable[[str], bool]:
    """Which keys a change is logged for: every one a task's optimizer has, the spec's own for the built-in."""
    return (lambda key: True) if task_built else (lambda key: key in _SPEC_KEYS)
