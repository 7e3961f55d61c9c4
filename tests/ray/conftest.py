"""What the Ray tests share: one `ray start` head (with its Job API, and token authentication, as a
production head has it) for the tests that need a head but not one of their own kind (`ray job submit`,
`syncpoint submit` and its token, a user's mistakes through `syncpoint run --address`, the spares on a
cluster).

Why one: starting a head costs about 8 s of CPU and each idles at about 0.05 of a core, and these tests
leave it as they found it (each job ends before its test does). Why last: a session-scoped head stops
only with the session, so the tests that use it run after every other Ray test in the run (in their
own order), and it never idles beside another test's cluster."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="session")
def shared_head() -> Iterator[tuple[Any, dict[str, str]]]:
    """A real Ray head (two CPUs, its own ports and temp dir, ``RAY_AUTH_MODE=token`` with a token of its
    own, stopped by its own process ids) and the environment it was started with, which its clients use
    (this venv first on PATH, the repository on PYTHONPATH, the token)."""
    from tests.ray_processes import local_head, ray_env

    env = {**ray_env(), "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with local_head(env, num_cpus=2) as head:
        yield head, env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    on_the_head = [item for item in items if "shared_head" in getattr(item, "fixturenames", ())]
    items[:] = [item for item in items if item not in on_the_head] + on_the_head
