"""``checkpoint.save_every: auto``: the Young-Daly policy, its trigger, its spec fields, and a real
loop (bare process group, no Ray) that saves by it and resumes exactly."""

from __future__ import annotations

import math
import re

import pytest
from pydantic import ValidationError

from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Failure,
    Journal,
    PreemptionNotice,
    Progress,
    StateCommitted,
)
from syncpoint.policies.contracts.spec import CheckpointSpec
from syncpoint.policies.decisions.save_interval import (
    DEFAULT_PREEMPTIONS_PER_HOUR,
    MAX_INTERVAL_S,
    MIN_INTERVAL_S,
    AutoDecision,
    PreemptionHistory,
    decide,
    mtbf_estimate,
    preemption_history,
    save_cost,
    young_daly,
)
from syncpoint.policies.decisions.save_triggers import AutoInterval, PendingSave, Tick
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, lm_spec, run, run_until_crash, trainer_json
from tests.integration.workers.training.test_loop_exact_resume import assert_same_run

# ---------------------------------------------------------------- the policy


def test_young_daly_is_the_minimum_of_the_first_order_loss():
    c, mtbf = 0.4, 3600.0
    tau = young_daly(c, mtbf)
    assert tau == pytest.approx(math.sqrt(2 * 0.4 * 3600))

    def loss(t: float) -> float:  # saving C/t + recomputing t/(2 MTBF)
        return c / t + t / (2 * mtbf)

    assert loss(tau) < loss(tau * 0.9) and loss(tau) < loss(tau * 1.1)


@pytest.mark.parametrize("c,m", [(0, 10), (1, 0), (-1, 10), (math.inf, 10), (1, math.nan)])
def test_young_daly_refuses_meaningless_inputs(c, m):
    with pytest.raises(ValueError, match="finite positive"):
        young_daly(c, m)


def test_mtbf_is_the_prior_before_any_preemption_and_the_observation_after_many():
    assert mtbf_estimate(0, 0.0, 2.0) == 1800.0
    assert mtbf_estimate(0, 7200.0, 1.0) == 3600.0 + 7200.0  # a long quiet run lengthens it
    assert mtbf_estimate(1, 600.0, 1.0) == pytest.approx((600 + 3600) / 2)  # one early preemption: damped
    many = mtbf_estimate(1000, 1000 * 300.0, 1.0)
    assert many == pytest.approx(300.0, rel=0.02)
    with pytest.raises(ValueError):
        mtbf_estimate(0, 0.0, 0.0)


def test_save_cost_is_a_recent_median():
    assert save_cost([]) is None
    assert save_cost([10.0, 0.2, 0.3, 0.2, 0.25, 0.21]) == pytest.approx(0.21)  # the old outlier left the window
    assert save_cost([0.2, 5.0, 0.2]) == 0.2


def test_decide_waits_for_a_measurement_then_clamps():
    first = decide([], 0, 0.0, 1.0)
    assert first.interval_s is None and "no save measured yet" in first.describe()
    d = decide([0.2], 0, 0.0, 1.0)
    assert d.interval_s == pytest.approx(math.sqrt(2 * 0.2 * 3600))
    assert re.search(r"a state every 37\.9 s = sqrt\(2 x C 0\.200 s x MTBF 3600 s from 0 interruption", d.describe())
    assert decide([1e-6], 0, 0.0, 3600.0).interval_s == MIN_INTERVAL_S
    assert decide([3600.0], 0, 1e9, 1e-3).interval_s == MAX_INTERVAL_S


def _journal() -> Journal:
    """Two attempts: the first ran 100 s and was preempted, a 30 s restart gap, the second ran 50 s."""
    return Journal(
        [
            AttemptStarted(
                time=1000.0, attempt=1, world_size=2, resumed_from=None, global_micro_step=0, optimizer_step=0
            ),
            StateCommitted(
                time=1040.0,
                attempt=1,
                state="000000000008",
                global_micro_step=8,
                optimizer_step=2,
                bytes=1,
                seconds=0.5,
                blocked_seconds=0.3,
                reasons=["interval"],
            ),
            Progress(time=1100.0, attempt=1, records=[]),
            Failure(
                time=1110.0,
                classified="preemption",
                reason="node lost",
                decision="retry",
                ranks=[1],
                messages=[],
                dead_nodes=["n1"],
            ),
            Failure(
                time=1111.0,
                classified="application",
                reason="bug",
                decision="retry",
                ranks=[0],
                messages=[],
                dead_nodes=[],
            ),
            AttemptStarted(
                time=1130.0, attempt=2, world_size=2, resumed_from="000000000008", global_micro_step=8, optimizer_step=2
            ),
            StateCommitted(
                time=1180.0,
                attempt=2,
                state="000000000016",
                global_micro_step=16,
                optimizer_step=4,
                bytes=1,
                seconds=0.5,
                blocked_seconds=0.5,
                contended_seconds=0.25,  # an async save: its upload thread's CPU time that busy cores gave up
                reasons=["interval"],
            ),
        ]
    )


def test_history_from_the_event_log():
    h = preemption_history(_journal())
    assert h.preemptions == 1  # a preemption and a retried crash ending one attempt: one interruption
    assert h.exposure_s == pytest.approx(111.0 + 50.0)  # each attempt to its last event: the restart gap excluded
    assert h.costs == (0.3, 0.75)  # blocked, plus contended where a commit says (older logs lack it)
    assert preemption_history(Journal([])) == PreemptionHistory(0, 0.0, ())


def _noticed(journal: Journal, *, committed: bool, attempt: int = 1) -> Journal:
    """An attempt got a notice (the first, at 1100 s, before its preemption; the second, at 1150 s,
    a drain that was cancelled); its preemption save committed, or did not in time."""
    at = 1100.0 if attempt == 1 else 1150.0
    notice = PreemptionNotice(time=at, attempt=attempt, global_micro_step=10, optimizer_step=3, source="ray-drain")
    save = StateCommitted(
        time=at + 0.5,
        attempt=attempt,
        state="000000000012",
        global_micro_step=12,
        optimizer_step=3,
        bytes=1,
        seconds=0.5,
        blocked_seconds=0.3,
        reasons=["preemption"],
    )
    return Journal(sorted([*journal.events, notice, *([save] if committed else [])], key=lambda e: e.time))


def test_a_retried_crash_counts_as_an_interruption_a_final_one_does_not():
    """P15 found it: ranks crashing every 30 s left the interval at its notices' MTBF, minutes."""
    crashes = [
        Failure(
            time=t, classified="application", reason="rank exited", decision=d, ranks=[0], messages=[], dead_nodes=[]
        )
        for t, d in ((1190.0, "RETRY"), (1200.0, "RAISE"))
    ]
    assert preemption_history(Journal([*_journal().events, *crashes])).preemptions == 2  # attempts 1 and 2


def test_a_preemption_whose_notice_saved_its_state_lost_no_work():
    saved = preemption_history(_noticed(_journal(), committed=True))
    assert (saved.preemptions, saved.announced) == (1, 1)
    assert preemption_history(_noticed(_journal(), committed=False)).announced == 0  # the node went first
    cancelled = preemption_history(_noticed(_journal(), committed=True, attempt=2))
    assert (cancelled.preemptions, cancelled.announced) == (1, 0)  # the first attempt's preemption had no notice
    # the MTBF of work-losing preemptions: the announced one is taken out, the prior's pseudo one stays
    assert mtbf_estimate(1, 600.0, 1.0, announced=1) == pytest.approx(600 + 3600)
    assert mtbf_estimate(1, 600.0, 1.0, announced=5) == pytest.approx(600 + 3600)  # never more than happened
    assert mtbf_estimate(10, 36000.0, 1.0, announced=9) == pytest.approx((36000 + 3600) / 2)
    d = decide([0.2], 10, 36000.0, 1.0, announced=9)
    assert d.interval_s == pytest.approx(math.sqrt(2 * 0.2 * (36000 + 3600) / 2))
    assert "10 interruption(s) (9 saved by their notice)" in d.describe()
    t = AutoInterval(1.0, PreemptionHistory(10, 36000.0, (0.2,), announced=9))
    assert t.interval_s == pytest.approx(d.interval_s)


# ---------------------------------------------------------------- the trigger


def _tick(seconds: float, step: int = 1) -> Tick:
    return Tick(global_micro_step=step, optimizer_step=step, stepped=True, seconds_since_last_save=seconds)


def test_trigger_probes_once_then_follows_the_measured_interval():
    logged: list[AutoDecision] = []
    t = AutoInterval(1.0, on_decision=logged.append)
    assert t.wall_clock and t.interval_s is None
    assert t.wants_save(_tick(0.0)) and not t.wants_save(_tick(0.5))  # the probe is asked once, never twice
    d = t.observe_save(0.2, attempt_elapsed_s=5.0).interval_s
    assert d is not None and d == pytest.approx(math.sqrt(2 * 0.2 * (3600 + 5)))
    assert not t.wants_save(_tick(d - 1)) and t.wants_save(_tick(d))
    t.observe_save(0.21, attempt_elapsed_s=60.0)  # < 10% change: decided again, not logged again
    t.observe_save(2.0, attempt_elapsed_s=70.0)
    t.observe_save(2.0, attempt_elapsed_s=80.0)  # the median moved: a longer interval, logged
    assert [x.interval_s is None for x in logged] == [True, False, False]
    assert logged[-1].save_cost_s == pytest.approx((0.21 + 2.0) / 2)  # the median of 0.2, 0.21, 2, 2
    assert t.interval_s is not None and t.interval_s > d


def test_trigger_starts_from_the_run_history():
    h = PreemptionHistory(preemptions=3, exposure_s=3 * 1200.0, costs=(0.5,))
    t = AutoInterval(DEFAULT_PREEMPTIONS_PER_HOUR, h)
    assert t.interval_s == pytest.approx(math.sqrt(2 * 0.5 * (3600 + 3600) / 4))  # no probe: C is known
    assert not t.wants_save(_tick(0.0))


def test_a_request_mid_cycle_is_carried_to_the_boundary():
    """Contract rule 2 with the auto trigger: raised between boundaries, serviced at the next one."""
    t, pending = AutoInterval(1.0, PreemptionHistory(0, 0.0, (0.2,))), PendingSave()
    interval = t.interval_s
    assert interval is not None
    for micro, seconds, boundary in ((1, 1.0, False), (2, interval + 1, False), (3, interval + 2, False)):
        if t.wants_save(Tick(micro, 0, boundary, seconds)):
            pending.request("interval")
    assert pending.pending  # raised mid-cycle, still pending at the boundary
    assert pending.take() == ["interval"]


# ---------------------------------------------------------------- the spec


def test_nothing_in_checkpoint_saves_by_auto_and_0_opts_out():
    """The default is periodic (a lost node without a notice must not lose the whole run); ``0``
    (or ``"0"``) is the explicit "never periodically", and the prior needs no explicit auto."""
    assert CheckpointSpec().save_every.unit == "auto"
    assert CheckpointSpec.model_validate({"expected_preemptions_per_hour": 2}).save_every.unit == "auto"
    for never in (0, "0"):
        off = CheckpointSpec.model_validate({"save_every": never}).save_every
        assert (off.value, off.unit) == (0, "optimizer_steps")
    for wrong in (False, 1, "1"):
        with pytest.raises(ValidationError, match="save_every"):
            CheckpointSpec.model_validate({"save_every": wrong})


def test_spec_accepts_auto_and_its_prior():
    c = CheckpointSpec.model_validate({"save_every": "auto", "expected_preemptions_per_hour": 0.5})
    assert c.save_every.unit == "auto" and c.expected_preemptions_per_hour == 0.5
    again = CheckpointSpec.model_validate(c.model_dump(mode="json"))  # round trip (the workers get it as JSON)
    assert again == c


@pytest.mark.parametrize(
    "data,where,says",
    [
        ({"save_every": "auto", "expected_preemptions_per_hour": 0}, "expected_preemptions_per_hour", "greater than 0"),
        (
            {"save_every": "auto", "expected_preemptions_per_hour": -2},
            "expected_preemptions_per_hour",
            "greater than 0",
        ),
        (
            {"save_every": "auto", "expected_preemptions_per_hour": float("inf")},
            "expected_preemptions_per_hour",
            "finite",
        ),
        (
            {"save_every": "auto", "expected_preemptions_per_hour": float("nan")},
            "expected_preemptions_per_hour",
            "finite",
        ),
        (
            {"save_every": "auto", "expected_preemptions_per_hour": 1e5},
            "expected_preemptions_per_hour",
            "less than or equal to 3600",
        ),
        (
            {"save_every": "10 seconds", "expected_preemptions_per_hour": 2},
            "",
            "only read by checkpoint.save_every: auto",
        ),
        ({"save_every": {"value": 5, "unit": "auto"}}, "save_every", "takes no value"),
    ],
)
def test_spec_refuses_bad_auto_settings(data, where, says):
    with pytest.raises(ValidationError) as e:
        CheckpointSpec.model_validate(data)
    text = str(e.value)
    assert where in text and says in text


def test_cli_refuses_a_bad_rate_in_one_paragraph(tmp_path, capsys):
    from tests.helpers import cli

    spec = tmp_path / "job.yaml"
    spec.write_text(_job_text("expected_preemptions_per_hour: .nan"))
    rc, out, err = cli(capsys, "validate", str(spec))
    assert rc == 2
    assert "checkpoint.expected_preemptions_per_hour" in err and "Traceback" not in err


def _job_text(extra: str) -> str:
    return (
        "name: j\ntask: {path: tests.tasks:linear}\ntrain: {micro_batch_size: 1, epochs: 1}\n"
        f"checkpoint:\n  save_every: auto\n  {extra}\n"
    )


# ---------------------------------------------------------------- a real loop


def test_auto_saves_and_resumes_exactly(tmp_path, tmp_path_factory, capfd):
    """save_every auto in the real loop: the probe commits a state at the first boundary, the
    interval is decided from its measured cost and logged, and a crash resumes bitwise."""
    common = (
        "task.config.num_samples=20",
        "train.grad_accum=4",
        "train.epochs=2",
        "deepspeed.zero_stage=2",
        "checkpoint.save_every=auto",
        "checkpoint.expected_preemptions_per_hour=3600",
    )
    ref = lm_spec(tmp_path_factory.mktemp("ref"), *common)
    ref_final = run(ref).final_state
    spec = lm_spec(tmp_path, *common, "faults=[{at_micro_step: 13, mode: raise}]")
    assert run_until_crash(spec)
    first = capfd.readouterr().err
    assert "save_every auto: no save measured yet" in first and "save_every auto: a state every" in first
    probe = trainer_json(spec, "000000000004")  # the first boundary: the probe
    assert probe["save_reasons"] == ["interval"]
    result = run(spec)
    again = capfd.readouterr().err
    # the second attempt starts from the costs the event log holds: no probe
    assert "no save measured yet" not in again and "save_every auto: a state every" in again
    assert_same_run(ref, ref_final, spec, result.final_state)


def test_a_job_with_nothing_in_checkpoint_saves_periodically(tmp_path, capfd):
    """No ``checkpoint`` section at all: the first boundary commits a state (auto's probe) besides
    the final one, and the log says how the interval is chosen; ``save_every: 0`` commits only the end."""
    job = (
        "name: plain\ntask: {path: tests.tasks:linear, config: {num_samples: 16}}\n"
        "train: {micro_batch_size: 1, grad_accum: 2, epochs: 1, seed: 3, lr: 0.01, log_every: 100000}\n"
        "deepspeed: {zero_stage: 0}\n"
    )
    plain = resolve_storage(parse_spec(job, "plain", [f"storage={tmp_path / 'plain'}"]))
    run(plain)
    assert "save_every auto: no save measured yet" in capfd.readouterr().err
    assert committed_steps(plain)[0] == 2 and committed_steps(plain)[-1] == 16  # the probe, then the end
    assert trainer_json(plain, "000000000002")["save_reasons"] == ["interval"]
    never = resolve_storage(parse_spec(job, "never", [f"storage={tmp_path / 'never'}", "checkpoint.save_every=0"]))
    run(never)
    assert committed_steps(never) == [16]


def test_an_async_save_counts_the_cpu_its_upload_took_from_busy_cores(tmp_path, capfd, monkeypatch):
    """P13 found it: auto async saves cost 0.91x a plain loop's throughput on two busy cores, where
    the upload thread's work comes out of training, while C was the blocked time alone. An async
    commit says how much of its upload's CPU time busy cores gave up (here every core is busy: one
    rank on one core); a synchronous one has none; the interval is decided from both."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    job = (
        "name: contended\ntask: {path: tests.tasks:linear, config: {num_samples: 32}}\n"
        "train: {micro_batch_size: 1, grad_accum: 2, epochs: 1, seed: 3, lr: 0.01, log_every: 100000}\n"
        "deepspeed: {zero_stage: 0}\n"
        "checkpoint: {save_every: auto, async: true, expected_preemptions_per_hour: 3600}\n"
    )
    spec = resolve_storage(parse_spec(job, "contended", [f"storage={tmp_path}"]))
    run(spec)
    commits = EventLog(RunStorage(spec.run_url)).journal().commits
    uploaded = [c for c in commits if c.reasons == ["interval"]]
    assert uploaded and all(c.contended_seconds is not None and c.contended_seconds > 0 for c in uploaded)
    assert [c.contended_seconds for c in commits if c.reasons == ["final"]] == [0.0]  # the last save: synchronous
    costs = [c.blocked_seconds + (c.contended_seconds or 0.0) for c in uploaded]
    logged = re.findall(r"C (\d+\.\d+) s", capfd.readouterr().err)
    assert logged and float(logged[0]) == pytest.approx(costs[0], abs=1e-3)  # the probe's cost, contention in it


def test_the_busy_share_of_a_nodes_cores(monkeypatch):
    """Every rank's intra-op threads on CPU, one feeding thread a GPU rank; the launcher's
    ``LOCAL_WORLD_SIZE`` over the world size; never more than all of them."""
    import torch

    from syncpoint.workers.training.device import busy_core_share

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert busy_core_share(2, on_gpu=False) == 0.5 and busy_core_share(2, on_gpu=True) == 0.25
    assert busy_core_share(16, on_gpu=False) == 1.0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert busy_core_share(16, on_gpu=False) == 0.25


# ---------------------------------------------------------------- the simulator (bench/p8_goodput.py)


def test_simulator_accounts_saves_losses_and_notices():
    from bench.p8_goodput import Costs, simulate

    costs = Costs(save_blocked_s=1.0, restart_s=5.0, notice_to_commit_s=0.5, step_s=1.0)
    clean = simulate(100.0, 10.0, costs, [])
    assert clean.wall_s == pytest.approx(100 + 9 * 1 + 1)  # nine periodic saves and the final one
    # a crash at 25 s: the state of cycle 2 committed at 21 s (20 s of work kept), 5 s restart
    crashed = simulate(100.0, 10.0, costs, [(25.0, None)])
    assert crashed.wall_s == pytest.approx(25 + 5 + 80 + 7 + 1)
    # the same moment announced 2 s ahead: the work until the notice (23 s: 21 s of work) is kept, and
    # half of the rest of the lead after the commit and the last step (0.5 s x 1/2)
    noticed = simulate(100.0, 10.0, costs, [(25.0, 2.0)])
    kept = 21.0 + 0.5 * 0.5
    left = 100 - kept
    assert noticed.wall_s == pytest.approx(25 + 5 + left + (math.ceil(left / 10) - 1) + 1)


def test_the_restart_profile_splits_r_into_phases_that_add_up():
    """P8's R (interruption -> the next attempt's first step, less that step) is split into detection,
    the new worker group, and engine/restore/first batch: the profile a not-met goodput goal prints."""
    from bench.p8_goodput import restart_profile, restarts

    def progress(attempt, *steps):
        return {"kind": "progress", "attempt": attempt, "records": [{"time": t, "optimizer_step": n} for n, t in steps]}

    events = [
        {"kind": "attempt_started", "attempt": 1, "time": 1.0},
        {"kind": "resume_decision", "attempt": 1, "time": 0.9},
        progress(1, (1, 5.0), (2, 5.5)),
        {"kind": "fault_fired", "attempt": 1, "time": 10.0},
        {"kind": "failure", "time": 13.0},
        {"kind": "resume_decision", "attempt": 2, "time": 30.0},
        {"kind": "attempt_started", "attempt": 2, "time": 31.0},
        progress(2, (3, 35.0)),
    ]
    (r,) = restarts(events, 0.5)
    assert r["kind"] == "crash" and r["restart_s"] == 24.5
    assert r["phases"] == {"detection": 3.0, "new worker group": 17.0, "engine, restore, first batch": 4.5}
    assert sum(restart_profile([r]).values()) == r["restart_s"]
