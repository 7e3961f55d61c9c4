"""A stream's identity as ``trainer.json`` records it: its files, its ``datasets`` pipeline steps and
their functions, its shuffle buffer, or a custom stream's own description.

Why apart from reading the stream: selection compares this record with the live job's before any
tensor is read (a changed corpus or map function is refused naming it), from metadata alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from syncpoint.policies.contracts.bounded_json import JSONObject, JSONValue
from syncpoint.policies.contracts.errors import TaskError
from syncpoint.workers.data.function_identity import function_digest
from syncpoint.workers.data.stream_draws import hf_pipeline

# the step a datasets stream's .shuffle(seed, buffer_size) adds to its pipeline
HF_BUFFER_SHUFFLE = "BufferShuffledExamplesIterable"


def hf_buffer_steps(dataset: Any) -> list[Any]:
    """The ``.shuffle(...)`` steps of a ``datasets`` stream (``BufferShuffledExamplesIterable``)."""
    return [step for step in hf_pipeline(dataset) if step_name(step) == HF_BUFFER_SHUFFLE]


@dataclass(frozen=True)
class LiftedBuffer:
    """A ``datasets`` ``.shuffle(seed, buffer_size)``'s buffer, run by ``RankStream`` instead."""

    buffer_size: int
    seed: int  # drawn from the shuffle's own generator: another .shuffle(seed=...) is another order


# datasets warns at every resume that its buffer's content was not saved; the lifted buffer holds one
# example at a time (none between draws), and syncpoint's own buffer is saved
HF_EMPTY_BUFFER_NOTE = r"^Loading a state dict of a shuffle buffer of a dataset without the buffer content\."


def buffer_of(step: Any) -> int:
    """The buffer size of a pipeline's shuffle step, lifted into syncpoint's buffer or as datasets runs it."""
    lifted = getattr(step, "_syncpoint_lifted", None)
    return lifted.buffer_size if isinstance(lifted, LiftedBuffer) else int(getattr(step, "buffer_size", 0) or 0)


def generator_seed(generator: Any) -> int:
    """A 63-bit number naming a NumPy generator's state, drawn from a copy (the generator is left as it was)."""
    import copy

    import numpy as np

    if not isinstance(generator, np.random.Generator):
        return 0
    return int(copy.deepcopy(generator).integers(0, 1 << 63))


def hf_identity(dataset: Any) -> JSONObject:
    """What names a ``datasets`` stream: its builder, config and split, its shards, its data files
    (name and size, in order: a changed, added or removed file is another stream; the directory they
    lie in may move), the steps of its pipeline (a changed pipeline has another state layout), each
    ``.shuffle``'s seed (another seed reads the shards in another order), and
    what each ``.map``/``.filter`` step computes (a changed function makes other examples at the
    same position: ``syncpoint.workers.data.function_identity``)."""
    info = getattr(dataset, "info", None)
    files: list[JSONValue] = []
    for step in hf_pipeline(dataset):
        kwargs = getattr(step, "kwargs", None)
        if not isinstance(kwargs, dict):
            continue
        listed = next((kwargs[k] for k in ("original_files", "base_files", "files") if k in kwargs), None)
        files += [_file_entry(p) for p in _strings(listed)]
    return {
        "builder": getattr(info, "builder_name", None),
        "config": getattr(info, "config_name", None),
        "split": None if getattr(dataset, "split", None) is None else str(dataset.split),
        "n_shards": int(dataset.num_shards),
        "files": files,
        "pipeline": [step_name(step) for step in hf_pipeline(dataset)],
        "functions": _hf_functions(dataset),
        "shuffle": [generator_seed(step.generator) for step in hf_buffer_steps(dataset)],
    }


HF_FUNCTION_SETTINGS = ("fn_kwargs", "batched", "batch_size", "drop_last_batch", "input_columns", "remove_columns")


def _hf_functions(dataset: Any) -> list[JSONValue]:
    """Each ``.map``/``.filter`` step's function digest and settings, outermost step first."""
    out: list[JSONValue] = []
    for i, step in enumerate(hf_pipeline(dataset)):
        fn = getattr(step, "_syncpoint_function", None) or getattr(step, "function", None)  # the task's own
        if fn is None:
            continue
        settings = {k: getattr(step, k, None) for k in HF_FUNCTION_SETTINGS}
        out.append({"step": i, "kind": step_name(step), "digest": function_digest(fn, settings)})
    return out


def step_name(step: Any) -> str:
    """A step's ``datasets`` class name; a step ``stream_hf`` replaced has its original one."""
    return getattr(type(step), "REPLACES", type(step)).__name__


def _strings(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [s for item in obj[:100_000] for s in _strings(item)]
    return []


def _file_entry(path: str) -> JSONObject:
    """A data file by name and size (its size when it is a local file; None for a remote one)."""
    size = os.path.getsize(path) if "://" not in path and os.path.isfile(path) else None
    return {"name": os.path.basename(path.rstrip("/")), "size": size}


def custom_identity(dataset: Any, task_path: str) -> JSONObject:
    """A custom stream by its class and, when it has one, its own ``stream_identity()``."""
    cls = type(dataset)
    identity: JSONObject = {"class": f"{cls.__module__}.{cls.__qualname__}"}
    own = getattr(dataset, "stream_identity", None)
    if callable(own):
        value = own()
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise TaskError(
                f"task.path: {task_path!r}: the dataset's stream_identity() returned "
                f"{type(value).__name__}, not a JSON value (str, number, list, dict)"
            ) from None
        identity["stream_identity"] = value
    return identity
