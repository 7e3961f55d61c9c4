"""A second local account, as an attacker on a shared node has one: created for a test, removed after.

Why a real account (``useradd``), not a changed uid in this process: what protects the node-local
services (a private directory's owner and mode, a socket's peer, a port that only the job can name)
is decided by the kernel for another user, so only another user's process shows that it holds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Stranger:
    """Another local account: its name and ids, and a way to run Python as it."""

    name: str
    uid: int
    gid: int

    def python(self, code: str, timeout: float = 120, args: tuple[str, ...] = ()) -> Any:
        """Run ``code`` as this account with the project's interpreter; what it prints last, as JSON."""
        done = self._run(code, timeout, args)
        assert done.returncode == 0, f"the stranger's script failed:\n{done.stdout}\n{done.stderr}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    def needs(self, module: str) -> None:
        """Skip the test unless this account can import ``module`` from this checkout's environment:
        a checkout under a private directory (``/root`` is 0700) is out of another account's reach."""
        done = self._run(f"import {module}", 300, ())
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            pytest.skip(f"another account cannot import {module} from this checkout's environment ({last})")

    def _run(self, code: str, timeout: float, args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        packages = os.pathsep.join([os.getcwd(), sysconfig.get_paths()["purelib"]])
        env = {"HOME": "/tmp", "PATH": "/usr/bin:/bin", "PYTHONPATH": packages, "PYTHONNOUSERSITE": "1"}
        return subprocess.run(
            [_interpreter(), "-c", code, *args],
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _interpreter() -> str:
    """A Python of this one's version that another account may run: this venv's own often lies under
    a private home (``/root`` is 0700), so the system's, with this venv's packages on its path."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        if os.path.isfile(candidate) and os.stat(candidate).st_mode & 0o001:
            return candidate
    pytest.skip(f"no {version} that another account can run")


@contextmanager
def second_account() -> Iterator[Stranger]:
    """A fresh account for the test (skipped where this process cannot create one), removed after."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second local account")
    name = f"spx{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield Stranger(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], check=False)
