"""Imported by the fork server that starts training processes (``syncpoint.workers.supervision.launch.PRELOAD``):
what building an engine imports or loads lazily, done once there, so every process forked from it
finds it done.

Why: with torch and DeepSpeed imported, building the example's engine still took 2.8 s here, all
of it lazy loading (profiled): torch's optimizers import ``torch._dynamo`` on first construction
(1.7 s), DeepSpeed's ZeRO optimizer check imports its Muon module (1.1 s), and on CPU its
communication backend loads the shared-memory op (the JIT extension's up-to-date check and
import); the loop's metric sinks then import TensorBoard's writer and the trackers module (0.6 s,
more where Python writes no bytecode cache). An in-place recovery (``syncpoint.workers.supervision.supervisor``)
forks new training processes from this server at every failure, so each of those seconds is a
second of every restart. The op only on CPU: a server preloaded for CPU never forks GPU ranks
(``fork_context.start_method``).
"""

from __future__ import annotations

import contextlib
import io
import os

LAZY_IMPORTS = (
    "torch._dynamo",  # torch's optimizers import it on first construction
    "deepspeed.runtime.zero.muon.muon_optimizer",  # DeepSpeed's ZeRO optimizer check
    "torch.utils.tensorboard",  # the loop's TensorBoard sink (it brings boto3, through tensorboard's gfile)
    # the loop's trackers (MLflow, W&B: imported only when the spec names them)
    "syncpoint.workers.observation.trackers",
)


def warm() -> None:
    """Import what an engine's construction imports late, and load the CPU op into DeepSpeed's cache
    of loaded ops (its build line is not printed); never raises."""
    import importlib

    for name in LAZY_IMPORTS:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return
    with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


warm()
