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
(``fork_context.start_method``). A job that compiles its model has its server do a compiled first
step's per-process work too (``warm_compile``).
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
    of loaded ops (its build line is not printed); for a compiled model, ``warm_compile``; never raises."""
    import importlib

    from syncpoint.workers.supervision.zygote import WARM_COMPILE_ENV

    for name in LAZY_IMPORTS:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if os.environ.get(WARM_COMPILE_ENV) == "1":
        with contextlib.suppress(Exception):
            warm_compile()
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return
    with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


def warm_compile() -> None:
    """What a compiled model's first step does once per process before it traces, done here for a job
    with ``train.compile`` (``zygote.server_env``): inductor's import (1.2 s), the probe of this CPU's
    vector instructions (2 s: ten compiler and loader subprocesses; torch caches the answer per
    process) and the hash of torch's sources that keys inductor's caches (0.2 s). Measured on the
    example's model with its graphs in the compile cache: a forked process's first compiled step
    3.25 s without, 0.85 s with; what is left is Dynamo's trace of the model and its cached graphs'
    load. (Compiling a small kernel here too saved another 0.2 s in that measure and nothing in bench
    P4's in-place recovery, so it is not done.)

    The probe compiles into inductor's cache, so the job's private one is set first
    (``compile_cache.private_compile_cache``, which refuses a hostile directory: then nothing is
    warmed here and the training process refuses it itself); the environment is put back after, so
    each training process still makes and checks its own."""
    from syncpoint.workers.supervision.fork_context import environ_kept
    from syncpoint.workers.training.compile_cache import INDUCTOR, TRITON, private_compile_cache

    with environ_kept(INDUCTOR, TRITON):
        private_compile_cache()
        import torch._inductor.compile_fx  # noqa: F401 - the import is the warm-up
        from torch._inductor import codecache, cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
        codecache.torch_key()


warm()
