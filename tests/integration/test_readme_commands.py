"""The documented commands, run as written (issue 29.7): the one-machine block of docs/deploy/ray.md
(*Deploy with `ray job submit`*), a real `ray start --head` with token authentication, `syncpoint submit`
right after it and Ray's own `ray job submit` of the same job.

Run in a copy of the repository's tracked files (so `./runs` is the test's) with ``.venv`` linking to
this environment, and a home directory of its own (so ``~/.ray/auth_token`` is the test's). What is
not run as written, and why: the head gets this test's ports and temp dir appended to its `ray start`
and the dashboard address follows (another Ray may hold 8265 and 6379 on this machine); `ray stop` is
left out (it stops every Ray on the machine), the head's processes are stopped by their mark
(``tests.own_processes``); `make venv` runs only when it has nothing to do (otherwise it would
reinstall the shared environment).
"""

from __future__ import annotations

from tests.readme import bash_blocks, commands


def test_the_deploy_block_holds_the_commands_the_test_runs():
    """Guards the extraction below: the block the test runs is the one a reader copies."""
    lines = commands(bash_blocks("# Deploy with `ray job submit`", "docs/deploy/ray.md")[0])
    assert lines[:5] == [
        "make venv",
        "source .venv/bin/activate",
        "ray get-auth-token --generate > /dev/null",
        "export RAY_AUTH_MODE=token",
        "ray start --head --disable-usage-stats",
    ]
    assert "syncpoint submit examples/tiny_lm.yaml --address http://127.0.0.1:8265" in lines
    assert lines[-1] == "ray stop"
