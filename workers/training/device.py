"""Where a rank computes: the CPU (gloo) or its own GPU (NCCL), and what keeps GPU runs bitwise.

Why a module of its own: the launchers (in-process, spawned, Ray Train) and the loop must agree on
the backend and the device, and the determinism switches must be thrown before the first CUDA
kernel runs (cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when its handle is created). CPU kernels are
already deterministic at a fixed intra-op thread count, which the loop pins.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from syncpoint.policies.contracts.errors import JobConfigError
from syncpoint.policies.contracts.spec import JobSpec


def backend(spec: JobSpec) -> str:
    """The process group's backend: NCCL on GPUs, gloo on CPUs."""
    return "nccl" if spec.scaling.use_gpu else "gloo"


def prepare_op_builds() -> None:
    """Before DeepSpeed may JIT-build an op: no stale build lock, and this environment's ninja."""
    clear_stale_build_locks()
    use_environment_ninja()


def use_environment_ninja() -> None:
    """Put this Python environment's own ``ninja`` first on ``PATH`` before DeepSpeed JIT-builds an op.

    Why: torch builds DeepSpeed's ops (``cpu_adam``, the shared-memory comm op every CPU process
    group loads) with whichever ``ninja`` comes first on ``PATH``, keeping ninja's build log in the
    shared ``~/.cache/torch_extensions``. A Ray worker started from the environment's ``ray`` finds
    the pip ``ninja`` DeepSpeed depends on (1.13 here, build log v7); a process started as
    ``.venv/bin/python`` without activating finds the system's (1.11). Each discards the other's log
    and rebuilds the op from scratch: measured on this 2-core machine, the shm comm op was rebuilt
    four times in 20 minutes, 110-280 s each, while every rank starting DeepSpeed waited on the
    build lock. One ``ninja`` per environment makes the first build the only one.
    """
    here = os.path.dirname(sys.executable)
    if not os.path.isfile(os.path.join(here, "ninja")):
        return  # no pip ninja next to this Python: whatever PATH has is all there is
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + (os.pathsep + path if path else "")


STALE_BUILD_LOCK_S = 60.0


def clear_stale_build_locks(root: str | None = None, now: float | None = None) -> list[str]:
    """Remove torch-extension build locks that no build holds any more; returns what was removed.

    Why: torch serializes the JIT build of an op with a ``lock`` file in its build directory and
    makes every other process wait, without a bound, until the file is gone. A rank killed while it
    builds (a preemption during the first DeepSpeed start of a fresh environment, which is exactly
    when builds happen) leaves the file behind, and every later DeepSpeed start on the machine waits
    forever: seen in ``tests/drills/ray/test_silent_node.py``, both restarted ranks stuck. A lock is stale when
    it is older than ``STALE_BUILD_LOCK_S`` and no process works in its directory (ninja and the
    compiler run there for the whole build). Linux only (``/proc``); elsewhere nothing is removed.
    """
    if not os.path.isdir("/proc"):
        return []
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    dirs = glob.glob(os.path.join(root, "*", "*")) + glob.glob(os.path.join(root, "*"))
    now = time.time() if now is None else now
    stale = []
    for lock in (os.path.join(d, "lock") for d in dirs):
        try:
            age = now - os.stat(lock).st_mtime
        except OSError:
            continue  # no lock here (or it just went away)
        if age < STALE_BUILD_LOCK_S or _someone_works_in(os.path.dirname(lock)):
            continue
        with contextlib.suppress(OSError):
            os.remove(lock)
            stale.append(lock)
            print(
                f"[syncpoint] removed a stale build lock {lock} ({age:.0f}s old, no build running there): a "
                "process killed while building a DeepSpeed op left it, and every DeepSpeed start on this "
                "machine would have waited on it",
                file=sys.stderr,
            )
    return stale


def _someone_works_in(directory: str) -> bool:
    """Whether any process of this machine has its working directory in ``directory``."""
    real = os.path.realpath(directory)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            cwd = os.readlink(f"/proc/{pid}/cwd")
            if cwd == real or cwd.startswith(real + os.sep):
                return True
    return False


def collective_timeout(spec: JobSpec) -> timedelta:
    """How long one collective may wait for its peers (``scaling.collective_timeout_s``).

    Why not torch's 30 minutes: a peer whose node went silent (no RST, no exit) leaves the others
    waiting inside a collective; Ray's node health check usually ends that within seconds, and this
    bound is the backstop where it cannot (a link cut between two ranks that both still reach Ray)."""
    return timedelta(seconds=spec.scaling.collective_timeout_s)


def apply_collective_timeout(spec: JobSpec) -> None:
    """Make every process group created from now on in this process wait at most
    ``collective_timeout(spec)``: the launcher passes it for the world group, but DeepSpeed clones
    the world group (``deepspeed.utils.groups._clone_world_group``) and ZeRO makes groups of its own,
    all with torch's default, which ``new_group`` reads from these two module globals at call time.
    ``tests/integration/workers/training/test_device.py`` checks both names, so a torch that moves them fails loudly."""
    import torch.distributed.distributed_c10d as c10d

    timeout = collective_timeout(spec)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


def prepare_process(spec: JobSpec) -> torch.device:
    """Select this rank's device and, on GPU, deterministic kernels; returns the device.

    The GPU is the one at ``LOCAL_RANK`` among the visible ones (what torchrun, Ray Train and
    DeepSpeed itself assume), so all three pick the same device."""
    # DeepSpeed picks its accelerator once, at import: make it follow the spec, not the host.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if spec.scaling.use_gpu else "cpu")
    if not spec.scaling.use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise JobConfigError(
            "scaling.use_gpu: true, but torch sees no CUDA device on this worker (torch "
            f"{torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). "
            "Run on GPU nodes with a CUDA build of torch, or set scaling.use_gpu: false"
        )
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    if spec.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    return torch.device("cuda", index)


def busy_core_share(world_size: int, on_gpu: bool) -> float:
    """The share of this node's usable cores that training keeps busy, at most 1: the node's ranks
    (``LOCAL_WORLD_SIZE`` where the launcher sets it, else all ``world_size``) times the threads each
    keeps busy (its intra-op threads on CPU; on a GPU, the one thread that feeds the device).

    Why: an asynchronous save's upload thread costs training only the CPU time it takes from busy
    cores; ``save_every: auto`` counts that share of it in the save's cost (``save_interval``)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    threads = 1 if on_gpu else torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(1.0, max(1, local) * threads / max(1, cores))


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a collated batch (tensors in tuples, lists, dicts) to the rank's device.

    Tasks write ``loss(model, batch)`` without caring where the model lives; the loop moves the
    batch after fetching it, so the data pipeline (and its RNG) is the same on CPU and GPU."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def check_engine_device(spec: JobSpec, device: torch.device) -> None:
    """DeepSpeed must have put the model where the spec says (its accelerator is chosen at import)."""
    if (torch.device(device).type == "cuda") != spec.scaling.use_gpu:
        raise JobConfigError(
            f"scaling.use_gpu is {str(spec.scaling.use_gpu).lower()}, but DeepSpeed placed the model on {device} "
            f"(DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', '<unset>')}). Set scaling.use_gpu to match the "
            "workers, or DS_ACCELERATOR=cpu|cuda in the workers' environment before DeepSpeed is imported"
        )
