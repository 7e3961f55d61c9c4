"""What a warm server does ahead for the processes it forks (``syncpoint.workers.supervision.warm_ops``):
for a job with ``train.compile`` (its server's environment says so: ``zygote.server_env``), a compiled
first step's per-process work (inductor's import, the CPU's vector-instruction probe, the hash that keys
inductor's caches), with the job's private compile cache, and the environment left as it was.
(The whole path, bitwise: make test-all's compiled in-place recovery,
tests/integration/workers/training/test_engine_compile.py; its time: bench P4.)"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from syncpoint.workers.supervision import warm_ops, zygote
from syncpoint.workers.training.compile_cache import INDUCTOR, TRITON
from tests.helpers import linear_spec


def test_only_a_compiled_jobs_server_is_asked_to_warm_the_compiler():
    assert zygote.server_env(linear_spec("memory://w", "train.compile=true")) == {zygote.WARM_COMPILE_ENV: "1"}
    assert zygote.server_env(linear_spec("memory://w")) == {}


@pytest.mark.parametrize("asked", [True, False])
def test_warm_compiles_ahead_only_when_asked(monkeypatch, asked):
    done: list[bool] = []
    monkeypatch.setattr(warm_ops, "warm_compile", lambda: done.append(True))
    monkeypatch.setattr(warm_ops, "LAZY_IMPORTS", ())
    monkeypatch.setenv("DS_ACCELERATOR", "none")  # no op loaded: this test is about the compiler
    if asked:
        monkeypatch.setenv(zygote.WARM_COMPILE_ENV, "1")
    else:
        monkeypatch.delenv(zygote.WARM_COMPILE_ENV, raising=False)
    warm_ops.warm()
    assert done == ([True] if asked else [])


def test_the_compile_warm_up_probes_once_in_the_private_cache_and_leaves_the_environment(monkeypatch):
    """In the node's own private cache, as a server does (a new directory would have the probe compile
    its programs again: 10 s here instead of 2)."""
    from torch._inductor import async_compile, cpu_vec_isa
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config, "compile_threads", 4)  # as on a larger machine: a pool would be asked for
    for name in (INDUCTOR, TRITON):
        monkeypatch.delenv(name, raising=False)
    cpu_vec_isa.valid_vec_isa_list.cache_clear()  # as in a process that has not probed yet
    pools = set(async_compile._pool_set)
    warm_ops.warm_compile()
    assert "torch._inductor.compile_fx" in sys.modules
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize == 1  # probed, and kept for the forked processes
    assert set(async_compile._pool_set) == pools  # no compile workers started (they would be the server's children)
    cache = Path(tempfile.gettempdir()) / f"syncpoint-compile-{os.getuid()}"
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700 and any(cache.iterdir())  # the probe's builds are there
    assert INDUCTOR not in os.environ and TRITON not in os.environ  # each training process checks its own


def test_a_hostile_compile_cache_warms_nothing_and_leaves_the_environment(monkeypatch, tmp_path):
    from syncpoint.policies.contracts.errors import JobConfigError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in (INDUCTOR, TRITON):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / f"syncpoint-compile-{os.getuid()}")  # planted
    with pytest.raises(JobConfigError, match="not a private directory"):
        warm_ops.warm_compile()  # warm() suppresses it: the training process refuses the cache itself
    assert INDUCTOR not in os.environ and not any((tmp_path / "elsewhere").iterdir())
