"""Generators a task owns: found by a bounded walk over the Task's objects, named by their path.

Why: NumPy recommends ``np.random.default_rng`` over the global functions, augmentation libraries
keep their own ``random.Random`` / NumPy generators, and a loss may draw from its own
``torch.Generator``. None of these is one of the global streams ``syncpoint.workers.training.rng`` captures, so
without this module they would restart from their freshly built state on every resume (and a
dataset's copy in each DataLoader worker would repeat the same draws). The walk finds them where
a task keeps them and gives each a stable name (its path from the Task field, e.g.
``dataset.aug.<locals>.rng``), which seeds it (data side) or names its state in the RNG file
(train side, ``syncpoint.workers.training.rng``).

What the walk follows, from each Task field: instance attributes (``__dict__``, ``__slots__``),
lists, tuples and dicts of at most ``MAX_CONTAINER`` items (longer ones are data), closures'
cells, functions' defaults, ``functools.partial`` parts, bound methods' ``__self__``, the module
globals a function of the task's own code names, and the class attributes and methods of the
task's own classes. Not followed: tensors, arrays, parameter and buffer storage, modules, sets
(unordered), library code's globals. At most ``MAX_OBJECTS`` objects are visited.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sys
import types
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeGuard, cast

import numpy as np
import torch

MAX_OBJECTS = 20_000
MAX_CONTAINER = 1024

# Packages whose functions' globals and whose classes' attributes are not searched (instances of
# their classes still are: an augmentation library keeps its generators on its objects).
LIBRARIES = frozenset(
    {
        "torch",
        "numpy",
        "deepspeed",
        "ray",
        "transformers",
        "tokenizers",
        "datasets",
        "accelerate",
        "safetensors",
        "pydantic",
        "pandas",
        "pyarrow",
        "scipy",
        "sklearn",
        "PIL",
        "torchvision",
        "torchaudio",
        "triton",
        "huggingface_hub",
        "albumentations",
        "cv2",
    }
) | frozenset(sys.stdlib_module_names)

_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    memoryview,
    range,
    slice,
    type,
    types.ModuleType,
    torch.Tensor,
    np.ndarray,
    np.generic,
    torch.dtype,
    torch.device,
    set,
    frozenset,
)
# nn.Module's own bookkeeping (parameters, buffers, hooks): never holds a task's generator
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"_modules"}


# What the walk finds and a state saves: the generator kinds ``is_generator`` accepts.
TaskGenerator: TypeAlias = (
    random.Random | np.random.Generator | np.random.RandomState | np.random.BitGenerator | torch.Generator
)


def is_generator(obj: Any) -> TypeGuard[TaskGenerator]:
    """Whether an object is a random generator whose state syncpoint saves and reseeds."""
    return isinstance(
        obj, (random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator, torch.Generator)
    ) and not isinstance(obj, random.SystemRandom)


def _global_streams() -> set[int]:
    """The process-wide generators ``syncpoint.workers.training.rng`` already captures (a task may hold them too)."""
    ids = {id(random._inst), id(np.random.mtrand._rand), id(torch.default_generator)}
    ids.update(id(g) for g in getattr(torch.cuda, "default_generators", ()))
    return ids


@dataclass
class Walk:
    """What a walk found: generators by path (first path wins), and what cannot be reproduced."""

    generators: dict[str, TaskGenerator] = field(default_factory=dict)
    entropy: list[str] = field(default_factory=list)  # paths that draw OS entropy (SystemRandom, secrets)
    stopped_at: str | None = None  # the first path not visited once MAX_OBJECTS were

    def warnings(self) -> list[str]:
        lines = [
            f"{p} draws OS entropy (random.SystemRandom, secrets, os.urandom): its values cannot be reproduced "
            "after a resume; draw from a seeded generator instead (random.Random, np.random.default_rng)"
            for p in self.entropy
        ]
        if self.stopped_at is not None:
            lines.append(
                f"the search for task-owned random generators stopped after {MAX_OBJECTS} objects, at "
                f"{self.stopped_at}: a generator beyond it is not reproduced after a resume; keep "
                "generators on the dataset / loss objects themselves, not deep inside large structures"
            )
        return lines


def find(roots: Mapping[str, Any], max_objects: int = MAX_OBJECTS) -> Walk:
    """Breadth first from each root (in order), so a generator's path is the shortest way to it and
    the same in every process that builds the same objects."""
    walk, skip = Walk(), _global_streams()
    seen: set[int] = set()
    pinned: list[Any] = []  # keeps every visited object alive, so an id is never reused during the walk
    queue: deque[tuple[str, Any]] = deque((name, obj) for name, obj in roots.items() if obj is not None)
    visited = 0
    while queue:
        path, obj = queue.popleft()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        if visited >= max_objects:
            walk.stopped_at = path
            break
        seen.add(id(obj))
        pinned.append(obj)
        visited += 1
        if isinstance(obj, random.SystemRandom) or _is_entropy(obj):
            walk.entropy.append(path)
        elif is_generator(obj):
            if id(obj) not in skip:
                walk.generators.setdefault(path, obj)
        else:
            try:
                queue.extend(_children(path, obj, walk))
            except Exception:  # noqa: BLE001 - an object that refuses to be looked into (a dead proxy) holds none
                continue
    return walk


def _is_entropy(obj: Any) -> bool:
    import os
    import secrets

    return obj is os.urandom or getattr(obj, "__module__", None) == secrets.__name__ or obj is secrets.SystemRandom


def _children(path: str, obj: Any, walk: Walk) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, (Mapping, list, tuple, deque)):
        yield from _container_children(path, obj)
    elif isinstance(
        obj, (functools.partial, types.MethodType, types.BuiltinMethodType, staticmethod, classmethod, property)
    ):
        yield from _callable_children(path, obj)
    elif isinstance(obj, types.FunctionType):
        yield from _function_children(path, obj, walk)
    else:
        yield from _instance_children(path, obj)


def _container_children(path: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """A mapping's values and a sequence's items, unless it is larger than the walk looks into."""
    if len(obj) > MAX_CONTAINER:
        return
    if isinstance(obj, Mapping):
        for i, (k, v) in enumerate(obj.items()):
            yield (f"{path}[{k!r}]" if isinstance(k, (str, int)) else f"{path}[#{i}]"), v
    else:
        yield from ((f"{path}[{i}]", v) for i, v in enumerate(obj))


def _callable_children(path: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """What a partial, a bound method, a static or class method or a property calls or holds."""
    if isinstance(obj, functools.partial):
        yield f"{path}.func", obj.func
        yield from ((f"{path}.args[{i}]", v) for i, v in enumerate(obj.args))
        yield from ((f"{path}.keywords[{k!r}]", v) for k, v in obj.keywords.items())
    elif isinstance(obj, (types.MethodType, types.BuiltinMethodType)):
        yield f"{path}.__self__", obj.__self__
        if isinstance(obj, types.MethodType):
            yield f"{path}.__func__", obj.__func__
    elif isinstance(obj, (staticmethod, classmethod)):
        yield f"{path}.__func__", obj.__func__
    else:
        yield from ((f"{path}.{n}", f) for n in ("fget", "fset") if (f := getattr(obj, n)) is not None)


def _function_children(path: str, fn: types.FunctionType, walk: Walk) -> Iterator[tuple[str, Any]]:
    """Closure cells, defaults, and (for the task's own code) the module globals it names."""
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"{path}.<locals>.{name}", cell.cell_contents
        except ValueError:  # an empty cell (assigned later)
            continue
    yield from ((f"{path}.__defaults__[{i}]", v) for i, v in enumerate(fn.__defaults__ or ()))
    yield from ((f"{path}.__kwdefaults__[{k!r}]", v) for k, v in (fn.__kwdefaults__ or {}).items())
    if _library(fn.__module__):
        return
    names = _names(fn.__code__)
    for name in names:
        value = fn.__globals__.get(name)
        if value is None:
            continue
        if isinstance(value, types.ModuleType):
            if value.__name__ == "secrets" or (value.__name__ == "os" and "urandom" in names):
                walk.entropy.append(f"{path}.<globals>.{name}")
            continue
        yield f"{path}.<globals>.{name}", value


def _names(code: types.CodeType) -> list[str]:
    """Every global or attribute name a function's code (nested functions included) refers to."""
    out = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out += [n for n in _names(const) if n not in out]
    return out


def _instance_children(path: str, obj: Any) -> Iterator[tuple[str, Any]]:
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        yield from _attribute_children(path, attrs, isinstance(obj, torch.nn.Module))
    for cls in type(obj).__mro__:
        for slot in _slots(cls):
            if hasattr(obj, slot):
                yield f"{path}.{slot}", getattr(obj, slot)
    for cls in type(obj).__mro__:
        if _library(cls.__module__):
            continue
        for k, v in vars(cls).items():
            if not k.startswith("__") or k in ("__getitem__", "__getitems__", "__call__", "__iter__"):
                yield f"{path}.<class {cls.__name__}>.{k}", v


def _attribute_children(path: str, attrs: dict[str, object], module: bool) -> Iterator[tuple[str, Any]]:
    """An instance's attributes; a torch module's submodules by name, without its internals."""
    for k, v in attrs.items():
        if module and k in _MODULE_INTERNALS:
            continue
        if module and k == "_modules":
            submodules = cast("dict[str, torch.nn.Module | None]", v)  # nn.Module's own registry of them
            yield from ((f"{path}.{n}", m) for n, m in submodules.items())
            continue
        yield f"{path}.{k}", v


def _slots(cls: type) -> tuple[str, ...]:
    slots = vars(cls).get("__slots__", ())
    slots = (slots,) if isinstance(slots, str) else tuple(slots)
    return tuple(s for s in slots if s not in ("__dict__", "__weakref__"))


def _library(module: str | None) -> bool:
    return not module or module.split(".", 1)[0] in LIBRARIES


# ------------------------------------------------------------------ per generator: kind, seed, state


def kind(g: Any) -> str:
    """What a generator is, as a state records it: a restore needs the same kind."""
    if isinstance(g, torch.Generator):
        return f"torch.Generator({g.device.type})"
    if isinstance(g, np.random.Generator):
        return f"numpy.random.Generator({type(g.bit_generator).__name__})"
    if isinstance(g, np.random.RandomState):
        return f"numpy.random.RandomState({g.get_state(legacy=False)['bit_generator']})"
    if isinstance(g, np.random.BitGenerator):
        return f"numpy.random.{type(g).__name__}"
    return "random.Random"


def path_salt(path: str) -> int:
    """A stable integer from a generator's path (no Python hash randomisation)."""
    return int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little") >> 1


def reseed(g: Any, seed: int) -> None:
    """Put ``g`` in the state a fresh generator of its kind seeded with ``seed`` has."""
    if isinstance(g, torch.Generator):
        g.manual_seed(seed)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = type(g.bit_generator)(seed).state
    elif isinstance(g, np.random.RandomState):
        name = g.get_state(legacy=False)["bit_generator"]
        if name == "MT19937":
            g.seed(seed % 2**32)
        else:
            g.set_state({**getattr(np.random, name)(seed).state, "has_gauss": 0, "gauss": 0.0})
    elif isinstance(g, np.random.BitGenerator):
        g.state = type(g)(seed).state
    else:
        g.seed(seed)


def get_state(g: Any) -> Any:
    """The generator's state, in the form ``set_state`` takes back (in memory, not serialized)."""
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, np.random.Generator):
        return g.bit_generator.state
    if isinstance(g, np.random.RandomState):
        return g.get_state(legacy=False)
    if isinstance(g, np.random.BitGenerator):
        return g.state
    return g.getstate()


def set_state(g: Any, state: Any) -> None:
    """Put a generator back to a state ``get_state`` took."""
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, np.random.RandomState):
        g.set_state(state)
    elif isinstance(g, np.random.BitGenerator):
        g.state = state
    else:
        g.setstate(state)


class DataGenerators:
    """The generators reachable from a data-side object (dataset, collate) *in this process*.

    Why per process: a DataLoader worker holds its own copy of the dataset (forked or unpickled),
    whose generators are other objects than the main process's; each process walks its own copy
    once and reseeds those. The found list is never pickled."""

    def __init__(self, obj: Any, root: str) -> None:
        self.obj, self.root = obj, root
        self._pid: int | None = None
        self._found: list[tuple[int, Any]] = []

    def __getstate__(self) -> dict[str, object]:
        return {"obj": self.obj, "root": self.root, "_pid": None, "_found": []}

    def found(self) -> list[tuple[int, Any]]:
        """(salt, generator) for each generator reachable from the object, by path."""
        import os

        if self._pid != os.getpid():
            walk = find({self.root: self.obj})
            self._found = [(path_salt(p), g) for p, g in walk.generators.items()]
            self._pid = os.getpid()
        return self._found


TRAIN_FIELDS = ("model", "loss", "metrics", "optimizer")  # run in the main process: saved with the rank's RNG
DATA_FIELDS = ("dataset", "collate", "eval_dataset")  # run wherever samples are fetched: reseeded per sample


def of_task(task: Any) -> tuple[dict[str, TaskGenerator], list[str]]:
    """The task's train-side generators by path, and a warning for each thing no resume reproduces
    (OS entropy, a search cut short). Data-side generators are found again in each process that
    fetches (``DataGenerators``); a generator reachable from both sides is both."""
    train = find({f: getattr(task, f, None) for f in TRAIN_FIELDS})
    data = find({f: getattr(task, f, None) for f in DATA_FIELDS})
    return train.generators, train.warnings() + data.warnings()
