"""Export the trained model as consolidated safetensors users load without DeepSpeed or syncpoint.

Each tensor is cloned because ZeRO keeps parameters as views into flat buffers, which
safetensors (rightly) refuses to save as shared storage.

ZeRO-3 keeps no rank's module whole: each parameter is an empty placeholder and every rank holds
``ceil(numel / world)`` elements of it in its optimizer shard. The export gathers them from the
final committed state, whose shards are the engine's partitions bit for bit (the run always
commits a state at its last micro-step, before the export): rank 0 reads every rank's shard
(checksum-verified, unpickled weights-only through ``syncpoint.workers.integrity.safe_load``) and puts each parameter
together. Why from storage rather than a live gather (``GatheredParameters``): the loop exports on
rank 0 alone while the other ranks wait at a barrier, and a live gather is a collective every rank
must enter; the committed partitions give the same bytes with no collective and also serve
``syncpoint digest``. ``syncpoint.workers.state.zero3_consolidate`` is that one reconstruction.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from syncpoint.policies.contracts.spec import JobSpec, spec_to_json
from syncpoint.policies.contracts.state_format import STATES_DIR
from syncpoint.policies.decisions.redact import redact_obj
from syncpoint.workers.state.pretrained import is_pretrained_model, upload_pretrained
from syncpoint.workers.state.zero3_consolidate import consolidate_zero3
from syncpoint.workers.storage import RunStorage

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

FINAL_FORMAT = "syncpoint-final/1"  # final/ with what rebuilds the model: spec.json, the task in info.json
SPEC_FILE = "spec.json"


def export_final(
    engine: DeepSpeedEngine, storage: RunStorage, info: dict[str, Any], spec: JobSpec | None = None
) -> None:
    """Rank 0: write ``final/model.safetensors`` (and ``final/info.json``) from the whole model. Both go
    through storage, which never writes through a planted link (it replaces it, with a warning). A
    ``transformers.PreTrainedModel`` is exported as its ``save_pretrained`` directory instead
    (``syncpoint.workers.state.pretrained``: config, weights, generation config).

    With the job's ``spec``, ``final/`` also carries what rebuilds the model (``syncpoint.load_model``):
    ``spec.json`` (the spec, credentials redacted) and, in ``info.json``, the task's path and config.

    Its buffers are rank 0's (persistent ones, as ``state_dict`` holds them): DeepSpeed does not
    sync buffers, so each rank's differ; every rank's lie in the final state's ``buffers/``."""
    if spec is not None:
        info = {**info, "format": FINAL_FORMAT, "task": spec.task.path, "task_config": _task_config(spec)}
        storage.write_bytes(spec_to_json(spec).encode(), "final", SPEC_FILE)
    if _is_zero3(engine):
        tensors = zero3_state_from_storage(storage, info["state"])
    else:
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in engine.module.state_dict().items()}
    if is_pretrained_model(engine.module):  # a transformers model: its own save_pretrained layout
        upload_pretrained(storage, engine.module, tensors)
        storage.write_bytes(json.dumps(info, indent=1).encode(), "final", "info.json")
        return
    with tempfile.TemporaryDirectory(prefix="syncpoint-export-") as d:
        path = os.path.join(d, "model.safetensors")
        save_file(tensors, path, metadata={k: str(v) for k, v in info.items()})
        storage.upload_file(path, "final", "model.safetensors")
    storage.write_bytes(json.dumps(info, indent=1).encode(), "final", "info.json")


def _task_config(spec: JobSpec) -> Any:
    """The task's config as JSON, URL credentials redacted (as ``spec.json`` holds it)."""
    return redact_obj(spec.model_dump(mode="json")["task"]["config"])


def _is_zero3(engine: DeepSpeedEngine) -> bool:
    stage = getattr(engine, "zero_optimization_stage", None)
    return callable(stage) and int(stage()) == 3


def zero3_state_from_storage(storage: RunStorage, state: str) -> dict[str, torch.Tensor]:
    """The full model of a committed ZeRO-3 state, every file checked against its manifest first."""
    from syncpoint.policies.contracts.errors import StateRefused
    from syncpoint.workers.integrity.safe_load import load_state_file
    from syncpoint.workers.state.reader import read_listed, read_manifest

    if not state:
        raise StateRefused("ZeRO-3 export needs the run's final committed state, and there is none")
    files = read_manifest(storage, (STATES_DIR, state)).files

    def load(rel: str) -> Any:
        return load_state_file(read_listed(storage, (STATES_DIR, state), rel, files[rel]), rel)

    return consolidate_zero3(list(files), load)
