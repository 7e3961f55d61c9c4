"""The spot reclaim of tests/ray/test_ray_start_sigterm.py through `ray job submit` (the Job API path
itself is tests/ray/test_job_submit.py's)."""

from __future__ import annotations

import subprocess

from tests.helpers import ROOT, lm_spec
from tests.ray.test_ray_start_sigterm import LM_SPEC, RUN, _assert_exact_and_cheap, _reclaim_rank_1_node, _spec
from tests.ray_processes import BIN, drain_env


def test_the_same_through_ray_job_submit(tmp_path, ray_start_cluster):
    head, nodes = ray_start_cluster
    spec = _spec(tmp_path / "run")
    assert spec == lm_spec(tmp_path / "run", *LM_SPEC, *RUN, workers=2)  # the submitted job is this spec
    cmd = [
        f"{BIN}/ray",
        "job",
        "submit",
        "--address",
        head.address,
        "--working-dir",
        str(ROOT),
        "--",
        "python",
        "-m",
        "syncpoint",
        "run",
        "examples/tiny_lm.yaml",
    ]
    for s in [*LM_SPEC, *RUN, f"storage={tmp_path / 'run'}"]:
        cmd += ["--set", s]
    env = drain_env()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _reclaim_rank_1_node(spec, head, nodes, proc)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert "syncpoint: job 'tiny-lm' finished" in out
    _assert_exact_and_cheap(tmp_path, spec)
