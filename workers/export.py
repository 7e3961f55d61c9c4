"""Export the trained model as consolidated safetensors users load without DeepSpeed or syncpoint.

Each tensor is cloned because ZeRO keeps parameters as views into flat buffers, which
safetensors (rightly) refuses to save as shared storage.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from safetensors.torch import save_file

from workers.storage import RunStorage


def export_final(engine, storage: RunStorage, info: dict[str, Any]) -> None:
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in engine.module.state_dict().items()}
    with tempfile.TemporaryDirectory(prefix="syncpoint-export-") as d:
        path = os.path.join(d, "model.safetensors")
        save_file(tensors, path, metadata={k: str(v) for k, v in info.items()})
        storage.upload_file(path, "final", "model.safetensors")
    storage.write_bytes(json.dumps(info, indent=1).encode(), "final", "info.json")
