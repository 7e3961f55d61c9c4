"""The in-place property of tests/integration/workers/supervision/test_supervisor_in_place_recovery.py (its explicit
examples run in
make test) over 12 drawn crashes: any kind of state, any micro-step, either rank, a crash or an exception."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings

from tests.integration.workers.supervision.test_supervisor_in_place_recovery import (
    CRASHES,
    check_kind_recovers_in_place,
)

DRAWN = 12


# the kinds make test's examples leave out, besides the drawn crashes
@example(kind="every rank's buffers", micro_step=1, rank=0, mode="raise")
@example(kind="user state", micro_step=7, rank=1, mode="raise")
@settings(
    max_examples=DRAWN, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(**CRASHES)
def test_any_kind_of_state_recovers_in_place_bitwise_from_a_crash_anywhere_12_drawn(
    tmp_path_factory, kind, micro_step, rank, mode
):
    check_kind_recovers_in_place(tmp_path_factory, kind, micro_step, rank, mode)
