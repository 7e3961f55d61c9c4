"""What a new user meets between `make example` and a real cluster (issue 18).

* `validate`, `run` and `drill` refuse an import path whose module cannot be found, before Ray
  starts, without running the module;
* a run's output is syncpoint's own lines (plus Ray's few start-up lines) and ends in one summary
  line: final state, steps, wall time, restarts and lost work, where the model and plot are;
* `syncpoint submit` to a head whose `python` lacks syncpoint is refused before anything is
  submitted (a real head, started by the test with such a `python` first on its PATH, stopped by
  its own process ids).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid

import pytest

from syncpoint.orchestrator.cli import main
from syncpoint.orchestrator.timeline import format_summary, summarize
from syncpoint.policies.journal import (
    AttemptStarted,
    Failure,
    FaultFired,
    Finished,
    Journal,
    Progress,
    ProgressRecord,
    StateCommitted,
    Submitted,
)
from syncpoint.workers.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import EXAMPLE, ROOT, lm_spec, state_names, step_history

# ---------------------------------------------------------------- import paths, before Ray starts


def _write_job(tmp_path, text: str = EXAMPLE) -> str:
    job = tmp_path / "job.yaml"
    job.write_text(text)
    return str(job)


@pytest.mark.parametrize(
    "field,value,missing",
    [
        ("task.path", "no.such.module:task", "no"),
        ("task.path", "examples.no_such_module:build", "examples.no_such_module"),
        ("resume.policy", "no_such_policies.mod:Policy", "no_such_policies"),
        ("checkpoint.save_trigger", "no_such_triggers:Every", "no_such_triggers"),
    ],
)
def test_validate_refuses_an_import_path_whose_module_cannot_be_found(field, value, missing, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = main(["validate", "examples/tiny_lm.yaml", "--set", f"{field}={value}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{field}: {value!r} cannot be imported: no module named {missing!r}" in err
    assert str(ROOT) in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if ln.startswith("  - ")]) == 1  # one paragraph


def test_validate_accepts_the_example_and_builtin_policies(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert (
        main(
            [
                "validate",
                "examples/tiny_lm.yaml",
                "--set",
                "resume.policy=pinned",
                "--set",
                "resume.policy_args={state: 4}",
            ]
        )
        == 0
    )
    assert '"path": "examples.tiny_lm:build"' in capsys.readouterr().out


def test_run_refuses_before_ray_starts_or_storage_is_touched(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    runs = tmp_path / "runs"
    rc = main(["run", "examples/tiny_lm.yaml", "--set", "task.path=no.such.module:task", "--set", f"storage={runs}"])
    err = capsys.readouterr().err
    assert rc == 2 and "task.path: 'no.such.module:task' cannot be imported" in err
    assert not runs.exists()  # the storage probe and the driver's first event come after the check
    assert (
        main(
            [
                "drill",
                "examples/tiny_lm.yaml",
                "--preempt-at",
                "3",
                "--set",
                "task.path=no.such.module:task",
                "--set",
                f"storage={runs}",
            ]
        )
        == 2
    )
    assert not runs.exists()


def test_the_check_finds_modules_next_to_the_job_and_imports_them_in_a_child(tmp_path, capsys, monkeypatch):
    """The check imports the task module, as every worker will, but in a child Python: the CLI's
    own process never runs it; its parent package's __init__ raising is reported, not raised."""
    pkg, broken = f"sp_task_{uuid.uuid4().hex[:8]}", f"sp_broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    ran = tmp_path / "module-ran"
    (tmp_path / pkg / "task.py").write_text(f"open({str(ran)!r}, 'w').close()\ndef build(config): ...\n")
    (tmp_path / broken).mkdir()
    (tmp_path / broken / "__init__.py").write_text("raise RuntimeError('boom in __init__')\n")
    (tmp_path / broken / "task.py").write_text("")
    job = _write_job(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", job, "--set", f"task.path={pkg}.task:build"]) == 0
    assert ran.exists() and pkg not in sys.modules  # imported by the child only
    capsys.readouterr()
    assert main(["validate", job, "--set", f"task.path={broken}.task:build"]) == 2
    err = capsys.readouterr().err
    assert (
        f"task.path: '{broken}.task:build' cannot be imported: importing '{broken}.task' raised RuntimeError: "
        f"boom in __init__ (at {broken}/__init__.py:1)" in err
    )
    assert str(tmp_path) not in sys.path and broken not in sys.modules


# ---------------------------------------------------------------- the end-of-run summary


def _attempt(t: float, attempt: int, step: int, resumed_from: str | None) -> AttemptStarted:
    return AttemptStarted(
        time=t,
        attempt=attempt,
        world_size=1,
        resumed_from=resumed_from,
        global_micro_step=step,
        optimizer_step=step // 4,
    )


def _finished(t: float, attempt: int) -> Finished:
    return Finished(time=t, attempt=attempt, state="000000000024", global_micro_step=24, optimizer_step=6)


def _events_with_a_restart() -> list:
    """Attempt 1 commits state 8 (snapshot at t=113, a 1 s save), crashes at micro-step 13 and fails
    at t=122; attempt 2 resumes from 8 and finishes at micro-step 24 (optimizer step 6)."""

    def rec(step: int, gms: int, t: float) -> ProgressRecord:
        return ProgressRecord(optimizer_step=step, global_micro_step=gms, epoch=0, loss=1.0, lr=0.1, time=t)

    return [
        Submitted(time=100.0, source="driver", name="tiny-lm", address="embedded"),
        _attempt(110.0, 1, 0, None),
        StateCommitted(
            time=114.0,
            attempt=1,
            state="000000000008",
            global_micro_step=8,
            optimizer_step=2,
            bytes=1000,
            seconds=1.0,
            blocked_seconds=1.0,
            committed_at_micro_step=8,
            reasons=["interval"],
        ),
        Progress(time=120.0, attempt=1, records=[rec(2, 8, 113.0), rec(3, 12, 120.0)]),
        FaultFired(time=121.0, attempt=1, global_micro_step=13, rank=1, mode="exit", fault="f", where="micro-step 13"),
        Failure(
            time=122.0,
            classified="application",
            decision="retry",
            reason="crash",
            ranks=[1],
            messages=["crash"],
            dead_nodes=[],
        ),
        _attempt(130.0, 2, 8, "000000000008"),
        _finished(160.5, 2),
    ]


def test_summary_counts_restarts_and_lost_work_from_the_event_log():
    s = summarize(Journal(_events_with_a_restart()))
    assert (s.state, s.optimizer_step, s.micro_step, s.restarts, s.lost_micro_steps) == ("000000000024", 6, 24, 1, 5)
    assert s.wall_seconds == pytest.approx(60.5)  # first event of the run to its finish
    assert s.lost_seconds == pytest.approx(122.0 - 113.0)  # the failure's time minus the state's snapshot time
    line = format_summary("tiny-lm", s, "runs/tiny-lm/final/model.safetensors", "runs/tiny-lm/plot.png")
    assert line == (
        "syncpoint: job 'tiny-lm' finished: state 000000000024, 6 optimizer steps (24 micro-steps) in "
        "1m00s, 1 restart (lost 5 micro-steps, 9.0 s); model runs/tiny-lm/final/model.safetensors; "
        "plot runs/tiny-lm/plot.png"
    )
    assert summarize(Journal(_events_with_a_restart()[:-1])) is None  # not finished: no summary


def test_a_finished_run_run_again_is_summarized_from_its_new_submission():
    """`make example` twice: the second run resumes the final state and finishes at once; its summary
    is that submission's, not a restart of the first."""
    again = [
        Submitted(time=900.0, source="driver", name="tiny-lm", address="embedded"),
        _attempt(910.0, 3, 24, "000000000024"),
        _finished(912.0, 3),
    ]
    s = summarize(Journal(_events_with_a_restart() + again))
    assert (s.state, s.optimizer_step, s.restarts, s.lost_micro_steps) == ("000000000024", 6, 0, 0)
    assert s.wall_seconds == pytest.approx(12.0)


# ---------------------------------------------------------------- a whole run's output (embedded Ray)

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
    r"in [\dms.h ]+, no restarts; model (\S+); plot (\S+)$"
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


@pytest.mark.slow
@pytest.mark.ray
def test_the_quick_start_runs_as_written_and_prints_its_own_lines(tmp_path):
    """The README's *Quick start* as a new user runs it: `make example` (the example: 2 Ray workers,
    ZeRO-2 on CPU, 3 epochs), then the block of "useful next commands" as written, in a copy of the
    repository (tests/readme.py; `.venv` links to this environment, and make is told not to reinstall
    it when its stamp is older than pyproject.toml). Its output is syncpoint's own lines and Ray's
    start-up lines only, it ends in one summary line, it learns; the next commands run cleanly,
    DeepSpeed's accelerator line included (digest imports DeepSpeed)."""
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
    r = subprocess.run(make, cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
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


# ---------------------------------------------------------------- submit to a head whose python lacks syncpoint


@pytest.mark.slow
@pytest.mark.ray
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


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_starts_its_own_ray_while_another_runs_on_the_machine(tmp_path):
    """`syncpoint run` without an address embeds a new local Ray even when another Ray instance runs
    on this machine (a local cluster here, which registers itself as the machine's current one); it must
    not join that one and fail on num_cpus (seen when two tests' clusters overlapped)."""
    from ray.cluster_utils import Cluster

    from tests.ray_processes import ray_env as _env

    sets = [
        "task.config.num_samples=40",
        "task.config.seq_len=8",
        "task.config.d_model=16",
        "train.micro_batch_size=2",
        "train.epochs=1",
        "checkpoint.export_final=false",
        f"storage={tmp_path}",
    ]
    cmd = [sys.executable, "-m", "syncpoint", "run", "examples/tiny_lm.yaml"]
    for s in sets:
        cmd += ["--set", s]
    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        r = subprocess.run(
            cmd,
            cwd=ROOT,
            env={k: v for k, v in _env().items() if k != "RAY_ADDRESS"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        other.shutdown()
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "Connecting to existing Ray cluster" not in r.stdout + r.stderr
    # Ray Train's placement-group cleaner asks the State API, which finds two Ray instances here unless
    # its process is told its own cluster (syncpoint.orchestrator.worker_setup): no traceback, no dead cleaner
    assert "Found multiple active Ray instances" not in r.stdout + r.stderr
    assert "PlacementGroupCleaner" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("syncpoint: job 'tiny-lm' finished")
