"""Quiet by default (issue 50): what a user reads of a run says each thing once and says it right.

Here: the ``submitted`` event names where the submission really went (a Ray Job by its submission id,
not "embedded")."""

from __future__ import annotations

import json

from syncpoint.orchestrator.ray_runner import submitted_to


def _ray_job_environ(job_id: str, gcs: str) -> dict[str, str]:
    """A Ray Job entrypoint's environment, as the installed Ray's job supervisor builds it (its own
    constants: a Ray that renames them fails this test)."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.dashboard.modules.job.common import JOB_ID_METADATA_KEY, JOB_NAME_METADATA_KEY

    config = {"runtime_env": {}, "metadata": {JOB_ID_METADATA_KEY: job_id, JOB_NAME_METADATA_KEY: job_id}}
    return {RAY_JOB_CONFIG_JSON_ENV_VAR: json.dumps(config), "RAY_ADDRESS": gcs}


def test_a_ray_job_submission_is_named_as_one_and_a_local_run_as_embedded():
    job = _ray_job_environ("raysubmit_8RkJ", "10.0.0.7:6379")
    assert submitted_to(None, job) == "Ray job raysubmit_8RkJ on 10.0.0.7:6379"
    assert submitted_to(None, {}) == "embedded"
    assert submitted_to(None, {"RAY_ADDRESS": "10.0.0.7:6379"}) == "10.0.0.7:6379"
    assert submitted_to("ray://u:secret@head:10001", {}) == "ray://***@head:10001"
    assert submitted_to(None, {}, connected=True) == "the caller's Ray"
    assert submitted_to(None, {"RAY_JOB_CONFIG_JSON_ENV_VAR": "not json"}) == "embedded"


def test_the_timeline_says_where_a_ray_job_went():
    from syncpoint.orchestrator.timeline import _line
    from syncpoint.policies.journal import Submitted

    where = submitted_to(None, _ray_job_environ("raysubmit_8RkJ", "10.0.0.7:6379"))
    line = _line(Submitted(time=1.0, source="driver", name="nanogpt", address=where), 0.0)
    assert line is not None and "nanogpt to Ray job raysubmit_8RkJ on 10.0.0.7:6379" in line
    assert "embedded" not in line
