"""Shared test helpers: specs from the example job, run/crash/resume, state inspection."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
from syncpoint.policies.contracts.journal import Step
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.contracts.state_format import TRAINER_MAX_BYTES, json_bytes
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.integrity.digest import state_digest
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.faults import InjectedCrash
from syncpoint.workers.supervision.launch import run_in_process

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = (ROOT / "examples" / "tiny_lm.yaml").read_text()


# what lm_spec sets on the example (also given as --set to a job that runs examples/tiny_lm.yaml itself);
# the example evaluates (train.eval_every): a small eval set keeps it cheap
LM_SHRUNK = [
    "task.config.seq_len=8",
    "task.config.d_model=16",
    "train.micro_batch_size=2",
    "train.log_every=1000",
    "checkpoint.keep_last=0",
    "checkpoint.export_final=false",
    "task.config.eval_samples=8",
]


def needs(*modules: str) -> Any:
    """A module-wide skip (``pytestmark = needs("datasets")``) where an optional package is missing, found
    without importing it: ``pytest.importorskip`` at a module's top imports the package in every process that
    collects the tree (transformers, datasets and MLflow cost each collection seconds of CPU)."""
    import pytest

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def interrupted_twice(storage: os.PathLike | str) -> JobSpec:
    """A linear run with an eval set and a state at every optimizer step, crashed at micro-steps 7 and
    15 (each resumed from its newest state), then run to its end: a real journal with two restarts."""
    spec = linear_spec(
        storage,
        "task.path=tests.tasks:linear_eval",
        "task.config.num_samples=10",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "train.eval_every={value: 2, unit: optimizer_steps}",
        "faults=[{at_micro_step: 7, mode: raise}]",
    )
    assert run_until_crash(spec)
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 15, mode: raise}]"))
    run(with_overrides(spec, "faults=[]"))
    return spec


def lm_spec(storage: os.PathLike | str, *overrides: str, workers: int = 1) -> JobSpec:
    """The example job shrunk for tests (small model, short sequences)."""
    base = [f"storage={storage}", f"scaling.num_workers={workers}", *LM_SHRUNK]
    return resolve_storage(parse_spec(EXAMPLE, "examples/tiny_lm.yaml", [*base, *overrides]))


def linear_spec(storage: os.PathLike | str, *overrides: str, workers: int = 1) -> JobSpec:
    text = """
name: linear
task: {path: tests.tasks:linear, config: {num_samples: 64}}
train: {micro_batch_size: 1, grad_accum: 4, epochs: 1, seed: 3, lr: 0.01, log_every: 100000}
deepspeed: {zero_stage: 0}
checkpoint: {keep_last: 0, export_final: false, save_every: 0}
"""  # save_every 0: the tests count states; the default (auto) saves on a wall clock
    return resolve_storage(
        parse_spec(text, "linear", [f"storage={storage}", f"scaling.num_workers={workers}", *overrides])
    )


def with_overrides(spec: JobSpec, *overrides: str) -> JobSpec:
    from syncpoint.orchestrator.spec_file import apply_overrides

    raw = apply_overrides(spec.model_dump(mode="json"), list(overrides))
    return JobSpec.model_validate(raw)


def run(spec: JobSpec):
    return run_in_process(spec, print_progress=False)


def run_until_crash(spec: JobSpec) -> bool:
    try:
        run(spec)
    except InjectedCrash:
        return True
    return False


def state_names(spec: JobSpec) -> list[str]:
    return RunStorage(spec.run_url).list_dirs("states")


def committed_steps(spec: JobSpec) -> list[int]:
    s = RunStorage(spec.run_url)
    return [int(n) for n in s.list_dirs("states") if s.exists("states", n, "manifest.json")]


def digest(spec: JobSpec, name: str) -> str:
    return state_digest(spec.run_url + "/states/" + name)["digest"]


def step_history(spec: JobSpec) -> dict[int, Step]:
    """Per optimizer step records of a run (later attempts overwrite recomputed steps)."""
    return EventLog(RunStorage(spec.run_url)).journal().steps()


def trainer_json(spec: JobSpec, name: str) -> dict[str, Any]:
    return json.loads(RunStorage(spec.run_url).read_bytes("states", name, "trainer.json", limit=TRAINER_MAX_BYTES))


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``syncpoint ARGV`` in-process: (exit code, stdout, stderr); argparse's SystemExit is an exit code."""
    from syncpoint.orchestrator.cli import main

    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out, err


def stop_processes(ours, freeze_first: bool = False, timeout: float = 30, mark: str | None = None) -> list:
    """Kill these processes and everything they started (a test's own Ray head; never `ray stop`,
    which would stop every cluster on the machine); returns those still alive after ``timeout``.
    ``freeze_first``: SIGSTOP them all before any is killed, so none acts on another's death (a
    lost machine: nothing says goodbye). ``mark``: the test's environment marker
    (``tests.own_processes``): a kill list holding any process without it is refused whole, before
    anything is signalled (a test ends only what it started)."""
    import psutil

    from tests.own_processes import not_marked

    procs = set(ours)
    for p in ours:
        try:
            procs.update(p.children(recursive=True))
        except psutil.Error:
            pass
    if mark is not None:
        foreign = not_marked(list(procs), mark)
        if foreign:
            raise AssertionError(f"refusing to kill processes this test did not start: {foreign}")
    for signal_them in ([lambda p: p.suspend()] if freeze_first else []) + [lambda p: p.kill()]:
        for p in procs:
            try:
                signal_them(p)
            except psutil.Error:
                pass
    _, alive = psutil.wait_procs(list(procs), timeout=timeout)
    return alive


GPT2_EXAMPLE = (ROOT / "examples" / "hf_gpt2.yaml").read_text()


def gpt2_spec(storage: os.PathLike | str, *overrides: str, workers: int = 1) -> JobSpec:
    """The Hugging Face GPT-2 example shrunk for tests (one block, short sequences, few samples);
    still ZeRO-3, dropout, activation checkpointing, AdamW with decay and a warmup + cosine schedule."""
    base = [
        f"storage={storage}",
        f"scaling.num_workers={workers}",
        "task.config.num_samples=40",
        "task.config.seq_len=16",
        "task.config.n_layer=2",
        "task.config.n_embd=32",
        "task.config.n_head=2",
        "train.micro_batch_size=2",
        "train.log_every=1000",
        "checkpoint.keep_last=0",
        "checkpoint.export_final=false",
    ]
    return resolve_storage(parse_spec(GPT2_EXAMPLE, "examples/hf_gpt2.yaml", [*base, *overrides]))


STREAM_EXAMPLE = (ROOT / "examples" / "stream_lm.yaml").read_text()


def stream_spec(storage: os.PathLike | str, corpus: os.PathLike | str, *overrides: str, workers: int = 1) -> JobSpec:
    """The datasets streaming example shrunk for tests: 4 JSONL shards of 12 documents in ``corpus``,
    a tiny model, 14 optimizer steps of accumulation 2 (one pass is 24 micro-batches on one rank,
    12 on two), a state every 3 optimizer steps and a shuffle buffer of 5."""
    base = [
        f"storage={storage}",
        f"scaling.num_workers={workers}",
        f"task.config.corpus_dir={corpus}",
        "task.config.seq_len=8",
        "task.config.d_model=16",
        "task.config.docs_per_shard=12",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.max_steps=14",
        "train.stream_shuffle_buffer=5",
        "train.log_every=1000",
        "checkpoint.keep_last=0",
        "checkpoint.export_final=false",
        "checkpoint.save_every={value: 3, unit: optimizer_steps}",
    ]
    return resolve_storage(parse_spec(STREAM_EXAMPLE, "examples/stream_lm.yaml", [*base, *overrides]))


def rewrite_state_file(store: RunStorage, name: str, rel: str, data: bytes) -> None:
    """Replace one file of a committed state and re-commit its manifest entry (as a writer could):
    only the file's content is wrong, its manifest entry matches it."""
    manifest = json.loads(store.read_bytes("states", name, "manifest.json", limit=1 << 30))
    algo = manifest["checksum"]
    store.write_bytes(data, "states", name, rel)
    manifest["files"][rel] = {"size": len(data), algo: checksum_bytes(data, algo)}
    store.commit_bytes(json_bytes(manifest), "states", name, "manifest.json")


def write_job(spec: JobSpec, job: Path) -> Path:
    """The spec as a job file a user would write (what ``syncpoint run``/``submit`` are given)."""
    import yaml

    job.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return job


def syncpoint_run(spec: JobSpec, job: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``syncpoint run JOB`` as a user runs it (its own embedded Ray: no ``RAY_ADDRESS``), the spec
    written to ``job`` first; ``env`` adds to the environment."""
    write_job(spec, job)
    environ = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "syncpoint", "run", str(job)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


@contextlib.contextmanager
def sigint_set(handler) -> Iterator[None]:
    """SIGINT set to ``handler`` in this (pytest's main) thread for the block."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        if previous is not None:  # None: installed outside Python, which cannot put it back
            signal.signal(signal.SIGINT, previous)


def start_as_in_a_terminal(args: list[str], **kw) -> subprocess.Popen:
    """Start a command with SIGINT at its default, as a terminal starts its foreground command, whatever
    this pytest inherited. ``make test`` started by a script in the background (``make test &``, a CI
    runner, ``nohup``) runs with SIGINT ignored, a child inherits an ignored signal and Python keeps
    ignoring it; exec resets only a *caught* signal to its default, so SIGINT is caught here while the
    child starts."""
    with sigint_set(signal.default_int_handler):
        return subprocess.Popen(args, **kw)


def saved_on_the_drivers_notice(events, signal_name: str, signalled_at: float) -> dict:
    """The one state committed, at the driver's notice (its ``preemption_notice`` with the signal's
    name) and after the signal: asserted; returned. ``events(kind)``: the run's events of a kind."""
    (notice,) = events("preemption_notice")
    assert notice["source"] == "driver" and notice["signal"] == signal_name
    (saved,) = events("state_committed")
    assert saved["reasons"] == ["preemption"] and saved["time"] > signalled_at
    return saved
