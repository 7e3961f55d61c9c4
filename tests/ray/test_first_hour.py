"""What a new user meets with Ray: the quick start as written (while another Ray runs on the machine), a
head that cannot import syncpoint (the rest of the first hour:
tests/integration/orchestrator/test_cli_first_hour.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import ROOT, lm_spec, state_names, step_history

# Ray's own lines a successful run still shows: its start-up and the worker group it started.
RAY_LINES = [
    r"Started a local Ray instance",
    r"Generated new authentication token and saved to",
    r"Requesting resources: ",
    r"Attempting to start training worker group of size \d+",
    r"Started training worker group of size \d+",
    r"- \(ip=\S+, pid=\d+\) world_rank=\d+",
    r"Setting up process group for: ",
]


SUMMARY = re.compile(
    r"^syncpoint: job 'tiny-lm' finished: state (\d{12}), (\d+) optimizer steps \((\d+) micro-steps\) "
    r"in [\dms.h ]+, goodput [\d.]+%, no restarts; model (\S+); plot (\S+)$"
)


def _without_load_warnings(lines: list[str]) -> list[str]:
    """Drop Ray Train's warning (and its traceback) that a resource request timed out, which it prints
    when the machine's CPUs are overloaded (this test shares two cores with others) and calls safe to
    ignore when transient; the run shows it, the test does not count it."""
    out, skipping = [], False
    for ln in lines:
        if ln.startswith("Failed to send resource request for "):
            skipping = True
        elif skipping and (ln.startswith(("Traceback ", "  ")) or ln.startswith("ray.exceptions.GetTimeoutError")):
            skipping = not ln.startswith("ray.exceptions.GetTimeoutError")
        else:
            skipping = False
            out.append(ln)
    return out


def _plain(line: str) -> str:
    """A printed line without colours and without Ray's `(Actor pid=N) ` prefix."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    return re.sub(r"^\((?:[\w:.]+) pid=\d+(?:, ip=[\d.]+)?\) ", "", line)


def test_the_quick_start_runs_as_written_and_prints_its_own_lines(tmp_path):
    """The README's *Quick start* as a new user runs it: `make example` (the example: 2 Ray workers,
    ZeRO-2 on CPU, 3 epochs), then the block of "useful next commands" as written, in a copy of the
    repository (tests/readme.py; `.venv` links to this environment, and make is told not to reinstall
    it when its stamp is older than pyproject.toml). Its output is syncpoint's own lines and Ray's
    start-up lines only, it ends in one summary line, it learns; the next commands run cleanly,
    DeepSpeed's accelerator line included (digest imports DeepSpeed)."""
    from ray.cluster_utils import Cluster

    from tests.readme import bash_blocks, commands, copy_of_repository, venv_is_up_to_date

    repo = tmp_path / "repo"
    copy_of_repository(repo)
    assert "make example" in commands(bash_blocks("## Quick start")[0])
    make = ["make", "example"] if venv_is_up_to_date(repo) else ["make", "-o", ".venv/.installed", "example"]
    # a new user's shell: no Ray address, and no make of ours around it (under `make test` MAKELEVEL and
    # MAKEFLAGS would make the inner make print "Entering directory" lines a user never sees)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "DS_ACCELERATOR", "MAKELEVEL", "MAKEFLAGS", "MFLAGS")
    }
    env["PYTHONPATH"] = str(repo)
    # What Ray Train's controller received from ray.train.report (issue 17.3), recorded by a callback
    reports = tmp_path / "ray-reports.jsonl"
    env.update(RAY_TRAIN_CALLBACKS="tests.ray_report_probe.RecordReports", SYNCPOINT_TEST_REPORTS=str(reports))
    # another Ray instance on the machine (a local cluster, which registers itself as the machine's current
    # one): `syncpoint run` without an address embeds its own and must not join that one and fail on num_cpus
    # (seen when two tests' clusters overlapped), nor leave Ray Train's helpers asking the State API, which
    # finds two instances (syncpoint.orchestrator.worker_setup tells each process its own cluster)
    # (without its dashboard, which this test does not ask: 2 s of CPU to start and 0.04 of a core while up)
    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        r = subprocess.run(make, cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
    finally:
        other.shutdown()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Connecting to existing Ray cluster" not in out and "Found multiple active Ray instances" not in out
    lines = _without_load_warnings([_plain(ln) for ln in out.splitlines() if ln.strip()])
    assert lines[0] == ".venv/bin/syncpoint run examples/tiny_lm.yaml"  # make's echo, as the README shows it
    for noise in [
        "PreemptionWatcher",
        "Setting accelerator to CPU",
        "FutureWarning",
        "all_gather_into_tensor",
        "built successfully",
        "Token authentication is enabled",
        "PlacementGroupCleaner",
    ]:
        assert not [ln for ln in lines if noise in ln], f"{noise!r} in the output:\n{out}"
    strangers = [
        ln
        for ln in lines[1:]
        if not ln.startswith(("[syncpoint] ", "syncpoint: ")) and not any(re.search(p, ln) for p in RAY_LINES)
    ]
    assert not strangers, "\n".join(strangers)  # anything else is a problem worth showing: here there is none
    assert len(lines) <= 24, out
    m = SUMMARY.match(lines[-1] if lines[-1].startswith("syncpoint: job") else r.stdout.strip().splitlines()[-1])
    assert m, out[-2000:]
    state, opt_steps, micro_steps, model, plot = m.groups()
    finished = EventLog(RunStorage(f"file://{repo}/runs/tiny-lm")).journal().last_finish
    assert finished is not None
    assert (state, int(opt_steps), int(micro_steps)) == (
        finished.state,
        finished.optimizer_step,
        finished.global_micro_step,
    )
    assert (model, plot) == ("runs/tiny-lm/final/model.safetensors", "runs/tiny-lm/plot.png")
    assert os.path.isfile(repo / model)
    with open(repo / plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    spec = lm_spec(repo / "runs")  # same name and storage: read the run back
    history = step_history(spec)
    assert sorted(history) == list(range(1, 49))
    first, last = (sum(history[s].loss for s in steps) / 4 for steps in ([1, 2, 3, 4], [45, 46, 47, 48]))
    assert last < first - 0.3, (first, last)  # it learns
    assert state == state_names(spec)[-1] == f"{192:012d}"  # 1024 samples / (8 x 2) x 3 epochs
    # Ray Train saw logged steps (log_every 8) from both ranks, metrics only (no checkpoint): the first, every
    # evaluation (16, 32, 48: eval_every 16) and the last; 24 and 40 only if Ray's 2 s collection interval had passed
    delivered = [json.loads(ln) for ln in reports.read_text().splitlines()]
    steps = [d["per_rank"][0]["optimizer_step"] for d in delivered]
    assert all([m["optimizer_step"] for m in d["per_rank"]] == [s, s] for d, s in zip(delivered, steps, strict=True))
    assert {8, 16, 32, 48} <= set(steps) <= {8, 16, 24, 32, 40, 48} and steps == sorted(steps), steps
    assert [d["per_rank"][0]["optimizer_step"] for d in delivered if "eval_loss" in d["per_rank"][0]] == [16, 32, 48]
    assert not any(d["checkpoint"] for d in delivered)
    # an embedded Ray starts none of a long-lived cluster's helpers (syncpoint.orchestrator.embedded_ray)
    assert {"TrainController", "RayTrainWorker", "BeatBoard"} <= set(delivered[0]["actor_classes"])
    assert not {"PlacementGroupCleaner", "_AutoscalingCoordinatorActor", "PreemptionWatcher"} & set(
        delivered[0]["actor_classes"]
    )
    for d in delivered:
        rank0 = d["per_rank"][0]
        step = history[rank0["optimizer_step"]]
        assert (rank0["loss"], rank0["lr"]) == (step.loss, step.lr)
        assert rank0["samples_per_s"] > 0
    # TensorBoard: rank 0's event file of the one attempt, uploaded into the run directory
    assert os.listdir(repo / "runs" / "tiny-lm" / "tensorboard") == ["events.out.tfevents.attempt-000001.syncpoint"]
    # the README's next commands, as written, from the same directory
    (block,) = [b for b in bash_blocks("## Quick start") if "syncpoint states runs/tiny-lm" in b]
    after = subprocess.run(["bash", "-e", "-c", block], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert after.returncode == 0, (after.stdout + after.stderr)[-3000:]
    assert not after.stderr.strip(), after.stderr  # nothing but the commands' own output
    assert "Setting accelerator to CPU" not in after.stdout  # DeepSpeed logs it to stdout, when not quieted
    assert "policy newest-resumable: resume from 000000000192" in after.stdout
    assert re.search(r"^[0-9a-f]{64}$", after.stdout, re.MULTILINE)  # the digest
    assert "finished at micro-step 192" in after.stdout  # the timeline


# make test: submit's preflight on a head, refusing a task path the cluster cannot import, in one
# paragraph and before anything is submitted (tests/ray/test_job_submit.py)
@pytest.mark.long
def test_submit_refuses_a_head_whose_python_cannot_import_syncpoint(tmp_path):
    """`ray start --head` run from a shell whose first `python` is not syncpoint's: the head itself
    runs (its `ray` script is the venv's), but job entrypoints get that `python`."""
    from tests.ray_processes import local_head
    from tests.ray_processes import ray_env as _env

    bare = tmp_path / "bare"  # a real Python 3.11 with nothing installed: no syncpoint, no fsspec
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    head_env = _env()
    head_env["PATH"] = str(bare / "bin") + os.pathsep + head_env["PATH"]
    client_env = {k: v for k, v in _env().items() if k != "RAY_AUTH_MODE"}
    runs = tmp_path / "runs"
    with local_head(head_env, num_cpus=1) as head:
        address = head.address
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "syncpoint",
                "submit",
                "examples/tiny_lm.yaml",
                "--address",
                address,
                "--set",
                f"storage={runs}",
            ],
            cwd=ROOT,
            env=client_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        from ray.job_submission import JobSubmissionClient

        from syncpoint.orchestrator.submit import auth_headers

        jobs = JobSubmissionClient(address, headers=auth_headers(address) or None).list_jobs()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "the cluster cannot run syncpoint" in r.stderr
    assert f"{bare / 'bin' / 'python'} (Python 3.11" in r.stderr  # the probe saw the head's `python`
    assert "syncpoint is not installed in it" in r.stderr and "fsspec" in r.stderr
    assert "source .venv/bin/activate && ray start --head" in r.stderr
    assert "Traceback" not in out and "as Ray job" not in r.stdout  # nothing but the probe was submitted
    assert [j.metadata for j in jobs] == [{"syncpoint": "preflight"}]
    assert all(j.entrypoint.startswith("python -c ") for j in jobs)
    assert not (runs / "tiny-lm" / "events").exists()
