"""The property of tests/integration/policies/decisions/test_candidates_property_changes.py over 150 examples."""

from __future__ import annotations

from hypothesis import given, settings

from tests.integration.policies.decisions.test_candidates_property_changes import COMMON, check, scenarios

SLOW_EXAMPLES = 150


@settings(max_examples=SLOW_EXAMPLES, **COMMON)
@given(scenarios())
def test_changed_spec_resumes_exactly_or_is_refused_150_examples(workdir, scenario):
    check(scenario, workdir)
