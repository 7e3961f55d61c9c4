"""``syncpoint.orchestrator.worker_setup``: what the hook quiets in a job's Ray worker processes is
Ray Train's own wording at Ray Train's own loggers (read from the installed Ray), and nothing else."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from syncpoint.orchestrator import ray_internals, worker_setup


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _hooked(logger_name: str, monkeypatch) -> Iterator[tuple[logging.Logger, _Kept]]:
    """The hook run in this process (its address left alone), and what then reaches ``logger_name``'s handlers."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    logger = logging.getLogger(logger_name)
    kept = _Kept()
    logger.addHandler(kept)
    try:
        worker_setup.set_up()
        yield logger, kept
    finally:
        logger.removeHandler(kept)
        for f in list(logger.filters):
            logger.removeFilter(f)


def _ray_resource_request_warning() -> str:
    """The warning as the installed Ray Train words it (a Ray that rewords it fails this test)."""
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as client

    assert client.logger.name == ray_internals.RESOURCE_REQUEST_LOGGER
    source = inspect.getsource(client.TrainAutoscalingCoordinatorClient.send_resource_request)
    parts = re.findall(r'f?"([^"]*)"', source[source.index("Failed to send") - 3 :])
    return "".join(parts[:4]).replace("{self._requester_id}", "train-8d736963")


def test_a_transient_resource_request_warning_is_dropped_and_other_warnings_show(monkeypatch):
    with _hooked(ray_internals.RESOURCE_REQUEST_LOGGER, monkeypatch) as (logger, kept):
        warning = _ray_resource_request_warning()
        assert warning.startswith("Failed to send resource request for train-8d736963.")
        try:
            raise TimeoutError("Get timed out: some object(s) not ready.")
        except TimeoutError:
            logger.warning(warning, exc_info=True)
        logger.warning("something else went wrong")
    assert kept.messages == ["something else went wrong"]


def test_the_expected_shutdown_warning_is_dropped(monkeypatch):
    with _hooked("ray.train.v2._internal.callbacks.backend_setup", monkeypatch) as (logger, kept):
        logger.warning("Graceful shutdown of backend failed. This is expected if one of the workers has crashed.")
        logger.warning("Graceful shutdown of backend failed for another reason.")
    assert kept.messages == ["Graceful shutdown of backend failed for another reason."]
