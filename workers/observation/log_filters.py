"""Dropping a third-party log message at its logger, by its exact text.

Why its own leaf, in the workers layer: the CLI, the driver, every Ray worker process of a job
(``syncpoint.orchestrator.quiet`` and ``worker_setup``) and the workers' own code (a stream's
``datasets`` note) quiet messages that say nothing about the run; each filter drops only the records
whose message matches, so anything else from the same logger still shows.
"""

from __future__ import annotations

import logging
import re


class DropMessages(logging.Filter):
    """Drops log records whose message contains any of the given texts (known noise, never errors)."""

    def __init__(self, *patterns: str) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p.search(record.getMessage()) for p in self.patterns)


def drop(logger_name: str, *patterns: str) -> None:
    """Add the filter to the logger, once per set of patterns (every call site may run again)."""
    logger = logging.getLogger(logger_name)
    if not any(
        isinstance(f, DropMessages) and [p.pattern for p in f.patterns] == list(patterns) for f in logger.filters
    ):
        logger.addFilter(DropMessages(*patterns))
