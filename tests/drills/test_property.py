"""The property of tests/integration/workers/training/test_loop_property.py over 200 examples."""

from __future__ import annotations

from hypothesis import given, settings

from tests.integration.workers.training.test_loop_property import (
    COMMON,
    _workdir,  # noqa: F401 - the module's work dir fixture, here too
    check_resume_equals_uninterrupted,
    scenarios,
)

SLOW_EXAMPLES = 200


@settings(max_examples=SLOW_EXAMPLES, **COMMON)
@given(scenarios())
def test_resume_equals_uninterrupted_200_examples(scenario):
    check_resume_equals_uninterrupted(scenario)
