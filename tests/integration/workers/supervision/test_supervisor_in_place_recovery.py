"""In-place recovery without Ray: each spawned rank supervises its training process, as a Ray Train
worker does with ``failure.in_place`` (``syncpoint.workers.supervision.supervisor``). A crash, an exception and a
collective timeout are recovered inside the run (no launcher restart), bitwise equal to the
uninterrupted run, classified and budgeted as Ray's failure policy would; a failure past the budget
goes to the launcher. The memory copy's reaper removes a node's copy when its supervisor dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from syncpoint.policies.contracts.journal import Failure
from syncpoint.policies.decisions.seeds import hash_seed
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.memory_copy import MEMORY_DIR_ENV, MemoryCopy
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision import zygote
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import ROOT, digest, linear_spec, state_names

pytestmark = pytest.mark.slow

SAVE = "checkpoint.save_every={value: 1, unit: optimizer_steps}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[object, str]:
    """The uninterrupted two-rank run the module's recoveries end at, run once (only read: digests, names)."""
    ref = linear_spec(tmp_path_factory.mktemp("ref"), SAVE, workers=2)
    assert run_spawned(ref) == [0, 0]
    return ref, state_names(ref)[-1]


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> object:
    """One warm server for the module's in-place runs (one each cost ~6 s of CPU to start and stop), as a
    `--local` driver starts its run's ahead of the ranks: held by this fixture, each run of its submission
    forks from it and leaves it running (``run_spawned`` stops only a server it started itself); it still
    answers at the end, then it is stopped."""
    spec = linear_spec(tmp_path_factory.mktemp("warm"), SAVE, workers=2)  # the module's runs' seed
    submission, seed = uuid.uuid4().hex, str(hash_seed(spec.train.seed))
    k = zygote.key(submission, seed)
    held, _ = zygote.ensure(k, seed, word="hold")
    try:
        yield submission
        assert zygote.answers(k), "a run stopped the warm server it did not start"
    finally:
        held.close()
        zygote.stop(k)


def _journal(spec):
    return EventLog(RunStorage(spec.run_url)).journal()


# make test: the property test below recovers each kind of state in place from a crash (exit) and an
# exception (raise) on either rank, with these checks; these two hand-picked faults run in make test-all
@pytest.mark.long
@pytest.mark.parametrize(
    "fault",
    [
        "{rank: 1, at_micro_step: 9, mode: exit}",  # the process dies (os._exit)
        "{rank: 0, at_micro_step: 11, mode: raise}",  # an exception (BaseException, never caught by user code)
    ],
)
def test_a_crash_or_an_exception_recovers_in_place_bitwise(reference, tmp_path, fault):
    ref, final = reference
    spec = linear_spec(tmp_path / "run", SAVE, "failure.max_failures=1", f"faults=[{fault}]", workers=2)
    assert run_spawned(spec, in_place=True) == [0, 0]  # no rank process of the launcher ended
    assert state_names(spec)[-1] == final and digest(spec, final) == digest(ref, final)
    journal = _journal(spec)
    [failure] = journal.of_kind(Failure)
    assert (failure.classified, failure.decision, failure.in_place) == ("application", "RETRY", True)
    assert [a.attempt for a in journal.attempts] == [1, 2]
    assert journal.attempts[1].resumed_from is not None


def test_a_collective_timeout_recovers_in_place(reference, warm, tmp_path, monkeypatch):
    """Rank 1 stops answering (held, its process alive); rank 0's collective times out after
    ``scaling.collective_timeout_s``; every rank gets a new training process."""
    monkeypatch.setenv("SYNCPOINT_FAULT_HOLD_S", "600")
    ref, final = reference
    spec = linear_spec(
        tmp_path / "run",
        SAVE,
        "failure.max_failures=1",
        "scaling.collective_timeout_s=5",
        "faults=[{rank: 1, at_micro_step: 9, mode: hold}]",
        workers=2,
    )
    started = time.monotonic()
    assert run_spawned(spec, in_place=True, submission=warm) == [0, 0]
    assert time.monotonic() - started < 300  # not the hold's 600 s: the held process was stopped
    assert digest(spec, final) == digest(ref, final)
    [failure] = _journal(spec).of_kind(Failure)
    assert failure.in_place and failure.ranks == [0]  # the rank that timed out; the held one was stopped


def test_the_first_micro_step_a_second_failure_a_save_phase_and_the_last_micro_step_each_recover_in_place(
    reference, warm, tmp_path
):
    """Six failures in one run (32 micro-steps a rank, a save every 4): after the first micro-step
    (nothing committed yet: the next generation starts fresh); after micro-step 9 (resumes from 8),
    then the recovered generation fails again inside its first save, before the manifest commits
    state 12 (the next resumes from the same state 8); inside the save at micro-step 16 after some
    shards were written (torn: the next resumes from 12); inside the final save before its manifest
    (from 28); and after the last micro-step, its save committed (from 32: the finished state, nothing
    more is trained). Every one in place, and the run ends bitwise."""
    ref, final = reference
    faults = (
        "{rank: 1, at_micro_step: 1, mode: exit}, {rank: 1, at_micro_step: 9, mode: exit}, "
        "{rank: 0, at_micro_step: 12, phase: before_manifest}, {rank: 1, at_micro_step: 16, phase: after_some_shards}, "
        "{rank: 0, at_micro_step: 32, phase: before_manifest}, {rank: 0, at_micro_step: 32, mode: exit}"
    )
    spec = linear_spec(tmp_path / "run", SAVE, "failure.max_failures=6", f"faults=[{faults}]", workers=2)
    assert run_spawned(spec, in_place=True, submission=warm) == [0, 0]
    assert state_names(spec)[-1] == final and digest(spec, final) == digest(ref, final)
    journal = _journal(spec)
    assert [(f.decision, f.in_place) for f in journal.of_kind(Failure)] == [("RETRY", True)] * 6
    resumed = [a.resumed_from for a in journal.attempts]
    assert resumed == [None, None, "000000000008", "000000000008", "000000000012", "000000000028", "000000000032"]


# state the engine does not own, each restored into a new training process by an in-place recovery
KINDS = {
    "optimizer group state": ("task.path=tests.tasks:linear_running_groups",),
    "every rank's buffers": ("task.path=tests.tasks:buffer_net",),
    "user state": ("task.path=tests.tasks:linear_user_state",),
    "collate RNG in a DataLoader worker": ("task.path=tests.tasks:linear_random_collate", "train.dataloader_workers=1"),
}
_references: dict[str, tuple[object, str]] = {}


def _kind_spec(storage, kind: str, *extra: str):
    """64 samples, 2 ranks, micro-batches of 2: 16 micro-steps a rank, a state every 4."""
    return linear_spec(storage, SAVE, "train.micro_batch_size=2", *KINDS[kind], *extra, workers=2)


# where a crash may fall: every kind of state, any micro-step of the 16, either rank, a crash or an exception
CRASHES = {
    "kind": st.sampled_from(sorted(KINDS)),
    "micro_step": st.integers(1, 16),
    "rank": st.integers(0, 1),
    "mode": st.sampled_from(["exit", "raise"]),
}


def check_kind_recovers_in_place(
    tmp_path_factory, kind: str, micro_step: int, rank: int, mode: str, submission: str | None = None
) -> None:
    """The run with that crash, recovered in place, ends bitwise the uninterrupted run of its kind
    (``submission``: the one whose warm server it forks from, default a new one)."""
    if kind not in _references:
        ref = _kind_spec(tmp_path_factory.mktemp("ref"), kind)
        assert run_spawned(ref) == [0, 0]
        _references[kind] = (ref, state_names(ref)[-1])
    ref, final = _references[kind]
    fault = f"{{rank: {rank}, at_micro_step: {micro_step}, mode: {mode}}}"
    spec = _kind_spec(tmp_path_factory.mktemp("run"), kind, "failure.max_failures=1", f"faults=[{fault}]")
    assert run_spawned(spec, in_place=True, submission=submission) == [0, 0]
    assert state_names(spec)[-1] == final and digest(spec, final) == digest(ref, final), (kind, fault)
    journal = _journal(spec)
    [failure] = journal.of_kind(Failure)
    assert (failure.classified, failure.decision, failure.in_place) == ("application", "RETRY", True)
    assert [a.attempt for a in journal.attempts] == [1, 2]  # resumed from a state, or from the start before one


# make test: the first and the last micro-step, a crash and an exception, on either rank, with the state
# of a DataLoader worker's RNG and the optimizer groups' running state; tests/drills draws 12 more and
# the other kinds (each kind's exact resume across launches: test_loop_property_state_kinds.py)
@example(kind="optimizer group state", micro_step=16, rank=1, mode="exit")  # the last micro-step
@example(kind="collate RNG in a DataLoader worker", micro_step=1, rank=0, mode="raise")  # the first
@settings(phases=[Phase.explicit], deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**CRASHES)
def test_any_kind_of_state_recovers_in_place_bitwise_from_a_crash_anywhere(
    tmp_path_factory, warm, kind, micro_step, rank, mode
):
    check_kind_recovers_in_place(tmp_path_factory, kind, micro_step, rank, mode, warm)


def test_a_failure_past_the_budget_goes_to_the_launcher(tmp_path):
    """``failure.max_failures: 1`` and two crashes: the first recovers in place, the second is not
    recovered (Ray Train's policy would decide it; here the launcher sees the failed rank)."""
    spec = linear_spec(
        tmp_path / "run",
        SAVE,
        "failure.max_failures=1",
        "faults=[{rank: 1, at_micro_step: 9, mode: exit}, {rank: 1, at_micro_step: 14, mode: exit}]",
        workers=2,
    )
    codes = run_spawned(spec, in_place=True, warm=False)  # each supervisor's own fork server: a node without a warm one
    assert codes[1] != 0
    assert [(f.decision, f.in_place) for f in _journal(spec).of_kind(Failure)] == [("RETRY", True)]


def test_a_refusal_is_never_recovered_in_place(warm, tmp_path):
    spec = linear_spec(
        tmp_path / "run",
        SAVE,
        "failure.max_failures=3",
        "train.eval_every={value: 2, unit: optimizer_steps}",
        workers=2,
    )
    codes = run_spawned(spec, in_place=True, submission=warm)
    assert codes != [0, 0]
    assert _journal(spec).of_kind(Failure) == []  # not decided in place: Ray Train's policy refuses it


# ---------------------------------------------------------------- the memory copy's reaper
STARTER = """
import sys, time
from syncpoint.workers.state import memory_reaper
reaper = memory_reaper.start(sys.argv[1])
if sys.argv[2] == "keep":
    reaper.keep()
elif sys.argv[2] == "close":
    reaper.close()
print("started", flush=True)
time.sleep(600)
"""


def _copy(tmp_path, url: str) -> MemoryCopy:
    copy = MemoryCopy(str(tmp_path / "shm"), url)
    copy.write_bytes("000000000008", "rank0.bin", b"x" * 1000)
    return copy


def _start_starter(tmp_path, url: str, word: str) -> subprocess.Popen[str]:
    env = {**os.environ, MEMORY_DIR_ENV: str(tmp_path / "shm"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", STARTER, url, word], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    return proc


def _gone_within(path: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("word", ["none", "close"])
def test_the_copy_is_removed_when_its_supervisor_is_killed_or_finishes(tmp_path, word):
    (tmp_path / "shm").mkdir()
    copy = _copy(tmp_path, "s3://bucket/run")
    proc = _start_starter(tmp_path, "s3://bucket/run", word)
    try:
        if word == "none":
            os.kill(proc.pid, signal.SIGKILL)  # no cleanup of its own can run
        assert _gone_within(copy.shown, 30)
    finally:
        proc.kill()
        proc.wait()


def test_a_copy_kept_for_ray_trains_restart_stays(tmp_path):
    (tmp_path / "shm").mkdir()
    copy = _copy(tmp_path, "s3://bucket/run")
    proc = _start_starter(tmp_path, "s3://bucket/run", "keep")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)
    assert os.path.exists(copy.shown)
