"""The wheel as a user gets it: built, installed into a fresh virtual environment, and a small job
run from a directory outside the checkout, through ``syncpoint.run`` and through the ``syncpoint`` CLI.

Why a fresh environment: the project's own one has the checkout installed editable, and a test run
from the checkout has it on ``sys.path``, where ``import workers`` still succeeds; only a separate
environment shows what the wheel itself installs. Its dependencies come from this environment by a
``.pth`` line (nothing is downloaded); ``.pth`` files in a directory added that way are not
processed, so this environment's editable install stays out of it (asserted: ``syncpoint.__file__``
lies in the fresh environment).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.own_processes import marked_env, owned

ROOT = Path(__file__).resolve().parents[2]
DEPENDENCIES = (
    "ray",
    "torch",
    "deepspeed",
    "fsspec",
    "pydantic",
    "yaml",
    "numpy",
    "safetensors",
    "xxhash",
    "matplotlib",
    "rich",
    "tensorboard",
    "psutil",
)
TASK = """
import torch

from syncpoint import Task


class Points(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def build(config):
    return Task(model=torch.nn.Linear(3, 1), dataset=Points(int(config["samples"])), loss=loss)
"""
# 8 samples, 1 per micro-batch, 2 micro-batches per optimizer step, 1 worker: 4 optimizer steps
JOB = """
name: {name}
storage: runs
task: {{path: "tinytask:build", config: {{samples: 8}}}}
train: {{micro_batch_size: 1, grad_accum: 2, epochs: 1, seed: 1, lr: 0.01, log_every: 100000}}
deepspeed: {{zero_stage: 0}}
scaling: {{num_workers: 1}}
checkpoint: {{keep_last: 1, export_final: false}}
"""
STEPS = 4


def _build_wheel(out: Path) -> Path:
    """The wheel of a copy of the checkout's tracked shape (the checkout itself gets no build/ or egg-info)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("syncpoint", "orchestrator", "workers", "policies"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    wheels = list((out / "dist").glob("syncpoint-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _fresh_venv(path: Path, wheel: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = sorted({str(Path(importlib.util.find_spec(name).origin).parents[1]) for name in DEPENDENCIES})
    (site / "syncpoint-test-deps.pth").write_text("".join(d + "\n" for d in deps))
    ninja = Path(sys.executable).parent / "ninja"  # DeepSpeed's op builds: this environment's ninja, not the system's
    if ninja.exists():
        (path / "bin" / "ninja").symlink_to(ninja)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return path


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    return env


PROBE = """
import json, sys
import syncpoint
try:
    import workers  # noqa: F401
    old = True
except ImportError:
    old = False
print(json.dumps({"file": syncpoint.__file__, "version": syncpoint.__version__, "old": old,
                  "workers": __import__("syncpoint.workers.training.loop").workers.training.loop.__file__}))
"""
API_RUN = """
import dataclasses, json
import syncpoint
result = syncpoint.run("job.yaml", ["name=wheel-api"])
print("RESULT " + json.dumps(dataclasses.asdict(result)))
"""


@pytest.mark.parametrize(
    "cli_runs",
    # make test-all only: what the installed names and sub-packages are (tests/integration/test_package.py)
    # and a job run from the checkout (every other Ray test) are make test's; here the console script
    # validates the job, or (the second) also runs it, a second embedded Ray
    [
        pytest.param(False, id="api-run-cli-validate", marks=pytest.mark.long),
        pytest.param(True, id="api-and-cli-run", marks=pytest.mark.long),
    ],
)
def test_the_wheel_installs_syncpoint_alone_and_runs_a_job(tmp_path, cli_runs):
    wheel = _build_wheel(tmp_path / "build")
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
    assert top == {"syncpoint", f"{wheel.name.split('-py3')[0]}.dist-info"}, top

    venv = _fresh_venv(tmp_path / "venv", wheel)
    job_dir = tmp_path / "job"  # outside the checkout
    job_dir.mkdir()
    (job_dir / "tinytask.py").write_text(TASK)
    (job_dir / "job.yaml").write_text(JOB.format(name="wheel-cli"))
    env, mark = marked_env(_env(venv))
    python = str(venv / "bin" / "python")

    probe = subprocess.run([python, "-c", PROBE], cwd=job_dir, env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert Path(seen["file"]).is_relative_to(venv), seen  # the wheel's syncpoint, not the checkout's
    assert Path(seen["workers"]).is_relative_to(venv), seen
    assert seen["old"] is False, "the wheel installs a top-level `workers`"
    assert seen["version"] == wheel.name.split("-")[1]

    try:
        api = subprocess.run([python, "-c", API_RUN], cwd=job_dir, env=env, capture_output=True, text=True, timeout=900)
        out = api.stdout + api.stderr
        assert api.returncode == 0, out[-4000:]
        result = json.loads(next(x for x in api.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
        assert result["name"] == "wheel-api" and result["optimizer_steps"] == STEPS, result
        assert result["micro_steps"] == 2 * STEPS and result["restarts"] == 0, result
        assert result["run_dir"] == f"file://{job_dir / 'runs' / 'wheel-api'}", result
        assert result["line"].startswith("syncpoint: job 'wheel-api' finished"), result
        assert not any(x.startswith("syncpoint: job 'wheel-api' finished") for x in api.stdout.splitlines()), (
            "run() printed its last line"
        )

        if not cli_runs:
            check = subprocess.run(
                [str(venv / "bin" / "syncpoint"), "validate", "job.yaml"],
                cwd=job_dir,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert check.returncode == 0, (check.stdout + check.stderr)[-4000:]
            assert json.loads(check.stdout)["name"] == "wheel-cli", check.stdout[-2000:]
            return
        cli = subprocess.run(
            [str(venv / "bin" / "syncpoint"), "run", "job.yaml"],
            cwd=job_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        out = cli.stdout + cli.stderr
        assert cli.returncode == 0, out[-4000:]
        last = cli.stdout.strip().splitlines()[-1]
        assert last.startswith("syncpoint: job 'wheel-cli' finished") and f"{STEPS} optimizer steps" in last, last
    finally:
        for proc in owned(mark):  # whatever of the embedded Rays outlived its driver: ours alone
            try:
                proc.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass
