"""Device placement helpers: batches follow the model, the backend follows the spec."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from syncpoint.workers.training.device import apply_collective_timeout, backend, collective_timeout, to_device
from tests.helpers import linear_spec

Pair = namedtuple("Pair", "x y")


def test_to_device_moves_every_tensor_and_keeps_the_structure():
    meta = torch.device("meta")  # a non-CPU device that needs no GPU
    batch = {"a": (torch.ones(2), [torch.zeros(1), 3]), "b": Pair(torch.ones(1), "label")}
    moved = to_device(batch, meta)
    assert moved["a"][0].device == meta and moved["a"][1][0].device == meta and moved["a"][1][1] == 3
    assert isinstance(moved["b"], Pair) and moved["b"].x.device == meta and moved["b"].y == "label"
    assert isinstance(moved["a"], tuple) and isinstance(moved["a"][1], list)


def test_cpu_batches_are_not_copied(tmp_path):
    t = torch.ones(3)
    assert to_device(t, torch.device("cpu")) is t


def test_backend_follows_use_gpu(tmp_path):
    assert backend(linear_spec(tmp_path)) == "gloo"
    assert backend(linear_spec(tmp_path, "scaling.use_gpu=true")) == "nccl"


def test_deepspeed_ops_are_built_with_this_environments_ninja(tmp_path):
    """Whichever way a process was started (a Ray worker from the venv's ``ray``, or ``.venv/bin/python``
    with the system's ``ninja`` first on PATH), the ops are built by the environment's own ``ninja``:
    two ninja versions alternating on one build directory discard each other's log and rebuild every
    op from scratch (minutes each, seen in this suite). Once, and only once, first on PATH."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(sys.executable)
    if not os.path.isfile(os.path.join(here, "ninja")):
        pytest.skip("no pip ninja next to this Python")
    decoy = tmp_path / "ninja"
    decoy.write_text("#!/bin/sh\necho 1.0.0-decoy\n")
    decoy.chmod(0o755)
    path = os.pathsep.join([str(tmp_path), *(p for p in os.environ["PATH"].split(os.pathsep) if p != here)])
    code = (
        "import os, shutil; from syncpoint.workers.training.device import use_environment_ninja as u; u(); u(); "
        "print(shutil.which('ninja')); print(os.environ['PATH'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[0] == os.path.join(here, "ninja")
    assert out[1].split(os.pathsep)[:2] == [here, str(tmp_path)]  # prepended once, the rest kept in order


def test_collective_timeout_reaches_the_groups_deepspeed_makes(tmp_path, monkeypatch):
    """The world group gets scaling.collective_timeout_s from the launcher; DeepSpeed's clones and ZeRO's
    groups come from ``new_group``, which reads torch's default at call time: the two globals set here."""
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import Backend

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):  # restored after the test
        monkeypatch.setattr(c10d, name, getattr(c10d, name))
    spec = linear_spec(tmp_path, "scaling.collective_timeout_s=7")
    assert collective_timeout(spec).total_seconds() == 7
    assert linear_spec(tmp_path).scaling.collective_timeout_s == 600  # the default: not torch's 1800
    apply_collective_timeout(spec)
    assert c10d._get_default_timeout(Backend.GLOO).total_seconds() == 7  # what new_group(timeout=None) uses
    assert c10d.default_pg_nccl_timeout is not None and c10d.default_pg_nccl_timeout.total_seconds() == 7


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_one_kept(tmp_path, capsys):
    """torch makes every process wait without bound while an op's build lock exists; a rank killed while
    building leaves it. Cleared: a lock over a minute old with no process working in its directory.
    Kept: a fresh lock (its builder may not have started ninja yet) and one whose directory a process
    works in (ninja and the compiler run there for the whole build)."""
    import os
    import subprocess
    import time

    from syncpoint.workers.training.device import STALE_BUILD_LOCK_S, clear_stale_build_locks

    now = time.time()
    dirs = {name: tmp_path / "py311_cpu" / name for name in ("left", "fresh", "building")}
    for d in dirs.values():
        d.mkdir(parents=True)
        (d / "lock").write_text("")
    for name in ("left", "building"):
        os.utime(dirs[name] / "lock", (now - STALE_BUILD_LOCK_S - 5,) * 2)
    (tmp_path / "py311_cpu" / "nolock").mkdir()
    builder = subprocess.Popen(["sleep", "60"], cwd=dirs["building"])  # a build working in its directory
    try:
        removed = clear_stale_build_locks(str(tmp_path), now=now)
    finally:
        builder.kill()
        builder.wait()
    assert removed == [str(dirs["left"] / "lock")]
    assert not (dirs["left"] / "lock").exists()
    assert (dirs["fresh"] / "lock").exists() and (dirs["building"] / "lock").exists()
    assert "removed a stale build lock" in capsys.readouterr().err
