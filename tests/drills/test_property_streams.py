"""The property of tests/integration/workers/data/test_stream_property_streams.py over 150 compositions."""

from __future__ import annotations

from hypothesis import given, settings

from tests.integration.workers.data.test_stream_property_streams import COMMON, check_composition, compositions

SLOW_EXAMPLES = 150


@settings(max_examples=SLOW_EXAMPLES, **COMMON)
@given(compositions())
def test_every_stream_composition_resumes_exactly_or_is_refused_150_examples(composition):
    check_composition(composition)
