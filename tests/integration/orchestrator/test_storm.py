"""The storm drill: its seeded plan and the fault schema it relies on (the real storms on Ray:
tests/drills/ray/test_storm.py).

The plan tests are plain data (a reference trajectory as the drill reads it from the event log);
the fault tests drive ``syncpoint.workers.supervision.faults.Faults`` on real fsspec memory storage.
"""

from __future__ import annotations

import os
import uuid

import pytest
from pydantic import ValidationError

from syncpoint.orchestrator.cli import main
from syncpoint.orchestrator.storm import (
    CRASH_THEN_NODE,
    NODE_GONE,
    NODE_KINDS,
    RANK0_PHASES,
    SAVE_CRASH,
    SIGTERM,
    TWO_NODES,
    StormTooShort,
    Trajectory,
    plan_storm,
    storm_kinds,
    storm_variant,
)
from syncpoint.policies.contracts.spec import CrashFault, JobSpec
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.faults import Faults, InjectedCrash
from tests.helpers import ROOT, lm_spec


def _trajectory(total: int = 256, accum: int = 4, save_every: int = 8) -> Trajectory:
    return Trajectory(total, list(range(accum, total + 1, accum)), list(range(save_every, total, save_every)))


def _fixed(tmp, workers: int = 2, *extra: str) -> JobSpec:
    return lm_spec(tmp, "checkpoint.save_every={value: 8, unit: micro_steps}", *extra, workers=workers)


def _check_plan(spec: JobSpec, plan, t: Trajectory) -> None:
    entries = plan.interruptions
    allowed = set(storm_kinds(spec)) | ({NODE_GONE} if spec.scaling.elastic else set())
    assert {e.kind for e in entries} <= allowed
    points = [e.point for e in entries]
    assert points == sorted(set(points)) and points[0] >= 1
    for e, nxt in zip(entries, entries[1:], strict=False):
        # each interruption has struck, and the other ranks reached the next boundary, before the next one's point
        assert nxt.point > t.next_boundary(e.end), (e, nxt)
    for e in entries:
        assert e.point <= e.end < t.total
        assert 0 <= e.rank < spec.scaling.max_workers
        if e.kind == SIGTERM:
            assert e.end == t.next_boundary(e.point)
        if e.kind == SAVE_CRASH:
            assert e.save_at == e.end and e.save_at in t.saves and e.save_at >= e.point
            assert e.rank == 0 or e.phase not in RANK0_PHASES
        if e.kind == TWO_NODES:
            assert e.other_rank is not None and e.other_rank != e.rank
        if e.kind in NODE_KINDS and not spec.scaling.elastic:
            assert e.replacement_delay_s is not None and 0.5 <= e.replacement_delay_s <= 2.5
    assert all(e.kind != NODE_GONE for e in entries[:-1])  # another world size renumbers micro-steps: last only
    # the interrupted run's spec is a valid spec: every fault passes the schema and the rank check
    run = storm_variant(spec, plan)
    JobSpec.model_validate(run.model_dump(mode="json"))
    assert len({f.fault_id for f in run.faults}) == len(run.faults)
    assert [CrashFault.model_validate(f.model_dump(mode="json")) for f in run.faults] == run.faults  # as workers read


def test_the_plan_is_seeded_and_valid_for_a_fixed_size_job(tmp_path):
    spec, t = _fixed(tmp_path), _trajectory()
    plan = plan_storm(spec, 20, 7, t)
    assert len(plan.interruptions) == 20
    _check_plan(spec, plan, t)
    assert plan_storm(spec, 20, 7, t).table() == plan.table()  # replayable from its seed
    assert plan_storm(spec, 20, 8, t).table() != plan.table()
    assert "seed 7 (replay with --seed 7)" in plan.table()
    kinds = {e.kind for seed in range(30) for e in plan_storm(spec, 20, seed, t).interruptions}
    assert kinds == set(storm_kinds(spec)) and NODE_GONE not in kinds  # a fixed-size job gets its node back


def test_budgets_cover_the_plan(tmp_path):
    spec = _fixed(tmp_path, 2, "failure.max_failures=1", "failure.max_preemptions=2")
    plan = plan_storm(spec, 12, 3, _trajectory())
    run = storm_variant(spec, plan)
    crashes = plan.count("crash", SAVE_CRASH, CRASH_THEN_NODE)
    assert run.failure.max_failures == 1 + crashes
    assert run.failure.max_preemptions == 2 + plan.count(SIGTERM, *NODE_KINDS)
    assert run.name == f"{spec.name}-drill"


def test_kinds_follow_the_spec(tmp_path):
    one = _fixed(tmp_path, 1)
    assert TWO_NODES not in storm_kinds(one)  # two nodes at once needs two workers
    seconds = _fixed(tmp_path, 2, "checkpoint.save_every={value: 30, unit: seconds}")
    assert SAVE_CRASH not in storm_kinds(seconds)  # where its save falls is not known in advance
    auto = _fixed(tmp_path, 2, "checkpoint.save_every=auto")
    assert SAVE_CRASH not in storm_kinds(auto)  # auto's interval is a wall clock too
    elastic = lm_spec(
        tmp_path,
        "scaling.num_workers={min: 1, max: 2}",
        "train.grad_accum=4",
        "checkpoint.save_every={value: 8, unit: micro_steps}",
        workers=2,
    )
    t = _trajectory()
    plans = [plan_storm(elastic, 6, seed, t) for seed in range(40)]
    for plan in plans:
        _check_plan(elastic, plan, t)
    gone = [p for p in plans if p.interruptions[-1].kind == NODE_GONE]
    assert gone and all(p.interruptions[-1].replacement_delay_s is None for p in gone)
    # an elastic job's replacement joins before the loss: the restart keeps its world size
    assert all(
        e.replacement_delay_s == 0
        for p in plans
        for e in p.interruptions
        if e.kind in NODE_KINDS and e.kind != NODE_GONE
    )


def test_a_job_too_short_for_the_storm_is_refused_naming_storm(tmp_path):
    spec = _fixed(tmp_path)
    with pytest.raises(StormTooShort, match=r"^--storm 20: the job is too short .* 40 micro-steps"):
        plan_storm(spec, 20, 0, _trajectory(total=40))
    with pytest.raises(StormTooShort, match="ask for fewer interruptions"):
        plan_storm(spec, 30, 0, _trajectory(total=100))
    plan_storm(spec, 3, 0, _trajectory(total=40))  # a few fit


def test_storm_arguments_are_checked_before_anything_runs(tmp_path, capsys):
    job = os.path.join(ROOT, "examples", "tiny_lm.yaml")
    store = f"storage={tmp_path}"
    assert main(["drill", job, "--set", store]) == 2
    assert "--preempt-at P[,Q...]" in capsys.readouterr().err
    assert main(["drill", job, "--set", store, "--storm", "3", "--preempt-at", "5"]) == 2
    assert main(["drill", job, "--set", store, "--storm", "3", "--how", "node"]) == 2
    assert "--how does not apply to --storm" in capsys.readouterr().err
    assert main(["drill", job, "--set", store, "--storm", "0"]) == 2
    assert "between 1 and 1000" in capsys.readouterr().err


# ------------------------------------------------------------------ the fault schema


def test_a_save_phase_fault_may_name_a_micro_step_and_old_forms_stay_valid():
    f = CrashFault(rank=1, phase="after_some_shards", at_micro_step=40)
    assert f.fault_id == "rank1-after_some_shards-from-step40"
    # the forms earlier specs use keep their meaning and their ids (their .fired files stay valid)
    assert CrashFault(rank=0, phase="before_manifest", at_save=2).fault_id == "rank0-before_manifest-save2"
    assert CrashFault(rank=1, at_micro_step=13).fault_id == "rank1-step13"
    assert CrashFault(rank=0, at_micro_step=13, mode="hold").fault_id == "rank0-step13"
    with pytest.raises(ValidationError, match="not both"):
        CrashFault(phase="before_shards", at_micro_step=4, at_save=2)
    with pytest.raises(ValidationError, match="at_micro_step, phase, or both"):
        CrashFault()
    with pytest.raises(ValidationError, match="mode hold needs at_micro_step and no phase"):
        CrashFault(phase="before_shards", at_micro_step=4, mode="hold")
    with pytest.raises(ValidationError, match="rank 0 only"):
        CrashFault(rank=1, phase="during_manifest", at_micro_step=4)


def test_a_save_phase_fault_at_a_micro_step_fires_in_the_first_save_at_or_after_it():
    storage = RunStorage(f"memory://storm-{uuid.uuid4().hex}/run")
    fault = CrashFault(rank=0, phase="before_shards", at_micro_step=10, mode="raise")
    faults = Faults([fault], storage, 0)
    for step in (9, 10, 11):  # the micro-step only picks the save: passing it crashes nothing
        faults.at_micro_step(step)
    for step in (4, 8):  # saves before the micro-step: not this one
        faults.at_boundary(step)
        faults.save_started()
        faults.at_phase("before_shards")
    faults.at_boundary(12)
    faults.save_started()
    faults.at_phase("after_some_shards")  # another phase of the same save
    with pytest.raises(InjectedCrash, match="micro-step 12"):
        faults.at_phase("before_shards")
    again = Faults([fault], storage, 0)  # the next attempt: fired once per run
    again.at_boundary(16)
    again.save_started()
    again.at_phase("before_shards")


def test_during_manifest_at_a_micro_step_tears_the_manifest_of_that_save():
    storage = RunStorage(f"memory://storm-{uuid.uuid4().hex}/run")
    faults = Faults([CrashFault(rank=0, phase="during_manifest", at_micro_step=5, mode="raise")], storage, 0)
    faults.at_boundary(4)
    faults.save_started()
    faults.during_manifest(storage, b"0123456789", "states", "000000000004", "manifest.json")
    assert not storage.exists("states", "000000000004", "manifest.json.tmp")
    faults.at_boundary(8)
    faults.save_started()
    with pytest.raises(InjectedCrash):
        faults.during_manifest(storage, b"0123456789", "states", "000000000008", "manifest.json")
    assert storage.read_bytes("states", "000000000008", "manifest.json.tmp", limit=1 << 30) == b"01234"


# ------------------------------------------------------------------ a real storm


def _waited(controller, what: str) -> list[str]:
    """The controller's problems after one wait for ``what`` that nothing ever answers, while a run's
    thread stays alive: each wait ends only by its own rule."""
    import threading

    release = threading.Event()
    run = threading.Thread(target=release.wait, args=(60,), daemon=True)
    run.start()
    try:
        assert controller._wait(what, run, lambda journal: None) is None
    finally:
        release.set()
    return controller.problems


def test_a_storm_wait_ends_at_the_storms_bound_with_a_message(tmp_path):
    """Every wait of the storm's controller (for a fault to fire, for the next attempt) polls against
    the storm's bound: past it the wait ends, and the problem says what it was waiting for."""
    from syncpoint.orchestrator.storm import Controller

    controller = Controller(None, [], 1, lm_spec(tmp_path), None, budget_s=0.2)  # type: ignore[arg-type]
    assert _waited(controller, "interruption 3's crash at micro-step 40") == [
        "the storm's bound (0.2 s) was hit while waiting for the interrupted run; "
        "stopping (waiting for interruption 3's crash at micro-step 40)"
    ]


def test_a_storm_strikes_nothing_after_the_drivers_signal(tmp_path):
    """The driver's signal is the run's notice: the controller's wait for the next interruption's
    point ends at once, saying why, so nothing strikes the run while it saves and stops."""
    import signal

    from syncpoint.orchestrator.driver_signals import DriverSignals
    from syncpoint.orchestrator.storm import Controller

    signals = DriverSignals(None, lambda line: None, "syncpoint drill j.yaml --storm 2 --seed 7", rerun_resumes=False)
    signals.received = signal.SIGTERM
    controller = Controller(None, [], 1, lm_spec(tmp_path), None, budget_s=60, signals=signals)  # type: ignore[arg-type]
    assert _waited(controller, "interruption 1 (node) at micro-step 40") == [
        "the storm stopped on SIGTERM (waiting for interruption 1 (node) at micro-step 40)"
    ]


# the example job shrunk to a tiny model (its steps take milliseconds: a storm's time is its restarts),
# a state every 2 optimizer steps, no evaluations, no final export
SHRUNK = (
    "task.config.seq_len=8",
    "task.config.d_model=16",
    "task.config.eval_samples=8",
    "train.eval_every=0",
    "checkpoint.save_every={value: 2, unit: optimizer_steps}",
    "checkpoint.export_final=false",
    "train.log_every=1000",
)
