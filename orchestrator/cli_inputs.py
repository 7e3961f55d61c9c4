"""What the command line reads: the job file with its ``--set`` overrides, storage URLs and run directories.

Why apart: every command reads one of these, and each must refuse bad input the same way (exit 2, a
paragraph naming the argument and the fix), so the readers live once, below the commands.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from syncpoint.orchestrator.spec_file import (
    load_spec,
    resolve_storage,
)
from syncpoint.policies.contracts.errors import SpecError, UsageError
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions.redact import redact_text

if TYPE_CHECKING:
    from syncpoint.workers.storage import RunStorage


def load_job(args: argparse.Namespace) -> JobSpec:
    """The job file with its ``--set`` overrides, storage made absolute (bad input: ``SpecError``, exit 2)."""
    return resolve_storage(load_spec(args.job, args.set))


def storage_arg(arg: str, what: str) -> RunStorage:
    """A storage URL or path given on the command line, opened; one that cannot be is a usage error naming it."""
    from syncpoint.workers.storage import RunStorage

    try:
        return RunStorage(as_url(arg))
    except (ValueError, ImportError) as e:
        raise SpecError(
            what, [redact_text(f"{arg}: {e}; pass a local path or an fsspec URL whose backend is installed", arg)]
        ) from None


def directory_arg(arg: str, what: str, kind: str, example: str) -> RunStorage:
    """The storage of a directory the command reads (a run, a state), refused (exit 2) when it is a
    local file rather than a directory, or when the storage cannot be listed at all (an unreachable
    endpoint, missing credentials): one paragraph, before anything is read."""
    storage = storage_arg(arg, what)
    local = storage.local_path()
    if local is not None:
        if os.path.exists(local) and not os.path.isdir(local):
            raise UsageError(what, [f"{arg}: not a directory, so not {kind}; pass {example}"])
        return storage
    try:
        storage.list_names()
    except Exception as e:  # noqa: BLE001 - every backend raises its own types when it cannot be reached
        raise UsageError(
            what,
            [
                redact_text(
                    f"{arg}: the storage cannot be read ({type(e).__name__}: "
                    f"{first_line(e)}); check the URL, the endpoint and the credentials, "
                    f"and pass {kind}, {example}",
                    arg,
                )
            ],
        ) from None
    return storage


def metrics_port_arg(arg: str) -> int:
    """``--metrics-port``: a TCP port from 1 to 65535 that this machine can listen on now (Ray's metrics
    agent binds it on every interface and would otherwise fail after the cluster started); else exit 2."""
    import socket

    try:
        port = int(arg)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise UsageError(
            "--metrics-port", [f"{arg!r} is not a TCP port; pass a number from 1 to 65535, e.g. --metrics-port 9090"]
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Ray's HTTP server binds it
        try:
            s.bind(("", port))
        except OSError as e:
            raise UsageError(
                "--metrics-port",
                [
                    f"port {port} cannot be listened on here ({e.strerror or e}): another process holds it, or it "
                    "needs privileges; pass a free port, e.g. --metrics-port 9090"
                ],
            ) from None
    return port


def first_line(e: BaseException, limit: int = 200) -> str:
    """An error's message on one line, cut at ``limit`` characters (for a one-paragraph refusal)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def as_url(path: str) -> str:
    """A path as a ``file://`` URL (a URL stays as it is)."""
    return path if "://" in path else "file://" + os.path.abspath(path)
