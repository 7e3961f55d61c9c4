"""A drill the driver's signal stopped (``syncpoint.orchestrator.drill.drill_stopped``): its report says
during which run, compares nothing, and ends with the shell's code for the signal; the command that
starts the drill over is the one given (``syncpoint.orchestrator.cli_jobs.drill_command``). The whole
path on Ray: tests/ray/test_driver_signals.py."""

from __future__ import annotations

import argparse
import signal

from syncpoint.orchestrator.cli_jobs import drill_command
from syncpoint.orchestrator.drill import DrillReport, drill_stopped, stopped_report
from syncpoint.orchestrator.driver_signals import DriverSignals
from syncpoint.orchestrator.interruptions import InterruptionKind


def _signals(signum: int, rerun: str) -> DriverSignals:
    signals = DriverSignals(None, lambda line: None, rerun, rerun_resumes=False)
    signals.received = signum
    return signals


def test_a_stopped_drill_says_during_which_run_and_exits_with_the_signals_code():
    report = drill_stopped(
        [13, 40],
        [InterruptionKind.CRASH, InterruptionKind.NODE],
        _signals(signal.SIGTERM, "syncpoint drill j.yaml"),
        "its reference run",
    )
    assert report.table.splitlines() == [
        "drill: crash at micro-step 13, node lost after micro-step 40",
        "the drill stopped on SIGTERM during its reference run: nothing compared",
        "RESULT: STOPPED (`syncpoint drill j.yaml` starts the drill over)",
    ]
    assert (report.ok, report.code) == (False, 143)
    assert drill_stopped([5], [InterruptionKind.CRASH], _signals(signal.SIGINT, "x"), "its interrupted run").code == 130


def test_a_drills_code_is_its_verdict_unless_a_signal_stopped_it():
    assert DrillReport("t", True).code == 0
    assert DrillReport("t", False).code == 1


def test_the_command_that_starts_a_drill_over_keeps_its_options_quoted_and_its_address_redacted():
    args = argparse.Namespace(
        job="job.yaml",
        preempt_at="13,40",
        how="crash,node",
        no_replacement=True,
        set=["checkpoint.save_every={value: 3, unit: optimizer_steps}"],
        address="ray://user:secret@head:10001",
    )
    command = drill_command(args)
    assert command.startswith(
        "syncpoint drill job.yaml --preempt-at 13,40 --how crash,node --no-replacement "
        "--set 'checkpoint.save_every={value: 3, unit: optimizer_steps}' --address "
    )
    assert "secret" not in command
    plain = argparse.Namespace(job="j.yaml", preempt_at="9", how=None, no_replacement=False, set=[], address=None)
    assert drill_command(plain) == "syncpoint drill j.yaml --preempt-at 9"


def test_a_stopped_storm_says_so_and_names_its_seed_to_start_over():
    again = "syncpoint drill j.yaml --storm 2 --seed 7"
    report = stopped_report(
        "storm: 2 interruptions, seed 7", "storm", _signals(signal.SIGINT, again), "its reference run"
    )
    assert report.table.splitlines() == [
        "storm: 2 interruptions, seed 7",
        "the storm stopped on SIGINT during its reference run: nothing compared",
        f"RESULT: STOPPED (`{again}` starts the storm over)",
    ]
    assert (report.ok, report.code) == (False, 130)
