"""Where a rank's failure happened: its rank, micro-step and the innermost frame of the user's code.

Why carried on the exception: Ray Train hands the failing rank's exception object to the controller
(the failure policy) and the driver (the last line), pickled with its attributes but without its
traceback object; only the rank itself can walk its frames, and only the loop knows its micro-step.
So the rank attaches ``{"rank", "micro_step", "where"}`` as ``syncpoint_site`` before the exception
leaves it (``syncpoint.policies.decisions.failures.failure_reason`` formats it; the failure policy compares
micro-steps).

"The user's code" is any file outside syncpoint's own packages, Python's standard library and the
installed packages; when every frame is in those (a user's package installed into site-packages),
any file outside syncpoint, the standard library, torch, DeepSpeed and Ray.
"""

from __future__ import annotations

import contextlib
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Iterable
from functools import cache
from types import TracebackType

SITE_ATTR = "syncpoint_site"
_FRAMEWORKS = ("torch", "deepspeed", "ray")


def annotate(error: BaseException, rank: int, micro_step: int | None) -> None:
    """Attach where ``error`` happened (once: the innermost handler that knows, wins)."""
    if getattr(error, SITE_ATTR, None) is not None:
        return
    try:
        setattr(error, SITE_ATTR, {"rank": rank, "micro_step": micro_step, "where": user_frame(error.__traceback__)})
    except (AttributeError, TypeError):  # an exception type that takes no attributes: the line goes without
        pass


def attach_traceback(error: BaseException) -> None:
    """Attach the traceback as Python prints it (its tail, ``TRACEBACK_LIMIT``), as ``TRACEBACK_ATTR``:
    the exception reaches Ray Train's controller pickled without its traceback, and the controller
    prints the failing rank's once (``syncpoint.orchestrator.failure_policy.print_failure``)."""
    from syncpoint.policies.decisions.failures import TRACEBACK_ATTR, TRACEBACK_LIMIT

    with contextlib.suppress(AttributeError, TypeError):  # an exception type that takes no attributes
        setattr(error, TRACEBACK_ATTR, "".join(traceback.format_exception(error))[-TRACEBACK_LIMIT:])


def user_frame(tb: TracebackType | None) -> str | None:
    """``file:line in function`` of the innermost frame in the user's code (see the module docstring)."""
    frames = traceback.extract_tb(tb)
    ours, stdlib, installed, frameworks = _dirs()
    for excluded in ((*ours, *stdlib, *installed), (*ours, *stdlib, *frameworks)):
        found = [f for f in frames if not f.filename.startswith("<") and not _under(f.filename, excluded)]
        if found:
            f = found[-1]
            return f"{_shown(f.filename)}:{f.lineno} in {f.name}"
    return None


def _under(path: str, dirs: tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + os.sep) for d in dirs)


@cache
def _dirs() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(syncpoint's packages, the standard library, the installed packages, torch/DeepSpeed/Ray)."""

    def real(paths: Iterable[str | None]) -> tuple[str, ...]:
        return tuple(sorted({os.path.realpath(p) for p in paths if p}))

    # syncpoint's three layers live side by side: in the package (site-packages/syncpoint/) or, in a
    # checkout, at the repository's top level next to syncpoint/ (its public API)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    package = root if os.path.basename(root) == "syncpoint" else os.path.join(root, "syncpoint")
    ours = real([package, *(os.path.join(root, name) for name in ("orchestrator", "policies", "workers"))])
    paths = sysconfig.get_paths()
    stdlib = real([paths.get("stdlib"), paths.get("platstdlib")])
    installed = real([paths.get("purelib"), paths.get("platlib"), *site.getsitepackages(), site.getusersitepackages()])
    frameworks = real(
        os.path.dirname(getattr(sys.modules.get(name), "__file__", None) or "")
        for name in _FRAMEWORKS
        if name in sys.modules
    )
    return ours, stdlib, installed, frameworks


def _shown(path: str) -> str:
    """A path as the user knows it: relative to the job's working directory (the first PYTHONPATH entry,
    which the driver sets to its own working directory) or to this process's, when under it."""
    for base in (os.environ.get("PYTHONPATH", "").split(os.pathsep)[0], os.getcwd()):
        if base and _under(path, (os.path.realpath(base),)):
            return os.path.relpath(os.path.realpath(path), os.path.realpath(base))
    return path
