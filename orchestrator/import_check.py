"""Resolving the spec's import paths to their objects before anything starts (``validate``, ``run``,
``drill``, ``submit``'s preflight on the cluster).

Why a subprocess: resolving ``pkg.mod:name`` means importing the module, which runs it: it may
hang (a download, a lock, ``input()``), exit, crash the interpreter, or print. The CLI imports
nothing of the user's; a child Python does, with the job's working directory first on its path (as
on every worker), and reports each path as one JSON line. Each path has its own time bound
(``SYNCPOINT_IMPORT_CHECK_TIMEOUT_S``, default 60 s: importing what a task imports, torch and
transformers, takes tens of seconds on a loaded machine); a path that hangs is reported and the
rest are checked in a fresh child.

What it tells apart, because the fix differs: the path's own module (or a parent package) missing
(spelling, working directory), a module whose import raises (the line in the user's file), a module
that imports a package that is not installed ("install X"), a missing attribute (with close
matches), an object of the wrong kind (a class where a function belongs: never called), a hang.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from syncpoint.policies.contracts.import_path import moved_hint
from syncpoint.policies.contracts.spec import JobSpec

TIMEOUT_ENV = "SYNCPOINT_IMPORT_CHECK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
MARK = "\x1eSYNCPOINT-IMPORT-CHECK "
# What each field's object must be: a Python function, or a class with this method.
KINDS = {
    "task.path": "function",
    "train.scheduler.path": "function",
    "resume.policy": "choose",
    "checkpoint.save_trigger": "wants_save",
}

# The child: argv[1] the base directory, argv[2] JSON [[field, path, kind], ...]. Self-contained
# (it must not import syncpoint before the user's module: a user's package may shadow nothing of ours).
CHILD = r"""
import difflib, importlib, inspect, json, os, sys, traceback
base, paths, mark = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
sys.path.insert(0, base)
out = os.fdopen(os.dup(1), "w")
def emit(**r):
    out.write(mark + json.dumps(r) + "\n"); out.flush()
def where(tb):
    root = os.path.realpath(base) + os.sep
    frames = [f for f in traceback.extract_tb(tb) if os.path.realpath(f.filename).startswith(root)]
    if not frames:
        return None
    f = frames[-1]
    return f"{os.path.relpath(f.filename, base)}:{f.lineno}"
def kind_of(obj):
    if inspect.isbuiltin(obj): return "a builtin function"
    if isinstance(obj, type): return f"the class {obj.__qualname__[:80]}"
    if inspect.isfunction(obj): return "a function"
    return f"a value of type {type(obj).__name__[:80]}"
for i, (field, path, kind) in enumerate(paths):
    emit(i=i, begin=True)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        name = e.name or ""
        if name and (module_name == name or module_name.startswith(name + ".")):
            emit(i=i, missing_module=name)
        else:
            emit(i=i, dependency=name, error=f"{type(e).__name__}: {e}", where=where(e.__traceback__))
        continue
    except BaseException as e:
        emit(i=i, error=f"{type(e).__name__}: {e}"[:300], where=where(e.__traceback__))
        continue
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        emit(i=i, no_attribute=attr, close=difflib.get_close_matches(attr, names, n=3, cutoff=0.6))
        continue
    obj = getattr(module, attr)
    if kind == "function":
        ok = inspect.isfunction(obj)
    else:
        ok = isinstance(obj, type) and inspect.isfunction(getattr(obj, kind, None))
    if not ok:
        emit(i=i, wrong_kind=kind_of(obj))
    elif field == "task.path":
        emit(i=i, ok=True, optimizer=optimizer_site(obj))
    else:
        emit(i=i, ok=True)
"""

# Whether a task builder sets Task.optimizer, read from its source (validate builds nothing): "at
# file:line" where it passes optimizer= to Task(...) or assigns .optimizer; "none" where it builds a
# Task(...) without one; "unknown" where its source does not tell (no source, the Task built elsewhere).
CHILD_OPTIMIZER_SITE = r"""
import ast, textwrap
def optimizer_site(fn):
    try:
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        name = os.path.relpath(inspect.getsourcefile(fn) or "?", base)
    except (OSError, TypeError, SyntaxError, ValueError):
        return "unknown"
    builds = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            builds = builds or callee == "Task"
            for kw in node.keywords:
                if kw.arg == "optimizer" and not (isinstance(kw.value, ast.Constant) and kw.value.value is None):
                    return f"at {name}:{first + kw.value.lineno - 1}"
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == "optimizer":
                return f"at {name}:{first + t.lineno - 1}"
    return "none" if builds else "unknown"
"""


@dataclass
class _Child:
    proc: subprocess.Popen[str]
    lines: queue.Queue[str | None]
    tail: list[str]


def timeout_s() -> float:
    """The bound on the child process that imports the task (its environment variable, else the default)."""
    try:
        value = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def resolve_problems(
    paths: list[tuple[str, str]], base: str, bound_s: float | None = None, facts: dict[str, dict] | None = None
) -> list[str]:
    """One paragraph per path that does not resolve to an object of its field's kind (see the module
    docstring), in the order given; empty when every path resolves. ``facts``, when given, receives
    each field's result (``task.path``'s ``optimizer``: where its builder sets ``Task.optimizer``)."""
    bound = timeout_s() if bound_s is None else bound_s
    results: dict[int, dict] = {}
    todo = list(range(len(paths)))
    while todo:
        child = _start([(paths[i][0], paths[i][1], KINDS.get(paths[i][0], "function")) for i in todo], base)
        try:
            done = _collect(child, len(todo), bound)
        finally:
            _stop(child)
        if not done:  # nothing came back at all: the child Python itself did not start
            results.update({i: {"no_start": " | ".join(child.tail[-3:])} for i in todo})
            break
        for j, result in done.items():
            results[todo[j]] = result
        todo = [i for j, i in enumerate(todo) if j not in done]  # those after a hang, in a fresh child
    if facts is not None:
        facts.update({field: results[i] for i, (field, _) in enumerate(paths)})
    return [p for i, (field, path) in enumerate(paths) if (p := _problem(field, path, base, bound, results[i]))]


def _start(paths: list[tuple[str, str, str]], base: str) -> _Child:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD_OPTIMIZER_SITE + CHILD, base, json.dumps(paths), MARK],
        cwd=base,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(MARK):
                lines.put(line[len(MARK) :])
            else:  # the module's own output: only its last lines are kept, to explain a crash
                tail.append(line.strip()[:200])
                del tail[:-5]
        lines.put(None)

    threading.Thread(target=read, name="syncpoint-import-check", daemon=True).start()
    return _Child(proc, lines, tail)


def _collect(child: _Child, count: int, bound: float) -> dict[int, dict]:
    """The results the child reports, until it has reported ``count``, exits, or spends ``bound``
    seconds on one path (that path is then reported as a hang: ``{"timeout": True}``)."""
    done: dict[int, dict] = {}
    current: int | None = None
    deadline = time.monotonic() + bound
    while len(done) < count:
        try:
            line = child.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            if current is not None:
                done[current] = {"timeout": True}
            return done
        if line is None:  # the child exited before reporting everything
            if current is not None and current not in done:
                child.proc.wait(timeout=10)
                done[current] = {"exited": child.proc.returncode, "tail": child.tail[-2:]}
            return done
        record = json.loads(line)
        if record.get("begin"):
            current, deadline = record["i"], time.monotonic() + bound
        else:
            done[record["i"]] = record
    return done


def _stop(child: _Child) -> None:
    if child.proc.poll() is None:
        child.proc.kill()
    try:
        child.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _problem(field: str, path: str, base: str, bound: float, r: dict) -> str | None:
    module, _, attr = path.partition(":")
    at = f" (at {r['where']})" if r.get("where") else ""
    if r.get("ok"):
        return None
    if "missing_module" in r:
        return (
            f"{field}: {path!r} cannot be imported: no module named {r['missing_module']!r}. The workers import "
            f"it from {base} (the working directory; `syncpoint submit` ships it with the job) and the installed "
            "packages; check the spelling, run from the directory that holds the package, or install it"
            + moved_hint(path)
        )
    if "dependency" in r and moved_hint(r["dependency"]):
        return (
            f"{field}: {path!r} cannot be imported: importing {module!r} raised {r['error']}{at}"
            f"{moved_hint(r['dependency'])}: import syncpoint's objects from syncpoint (`from syncpoint import "
            "Task`) or its modules under syncpoint."
        )
    if "dependency" in r:
        return (
            f"{field}: {path!r} cannot be imported: importing {module!r} raised {r['error']}{at}: "
            f"{r['dependency']!r} is not installed in this Python ({sys.executable}); install it (e.g. `pip "
            f"install {r['dependency'].split('.')[0]}`; the package may have another name) where the workers run"
        )
    if "error" in r:
        return (
            f"{field}: {path!r} cannot be imported: importing {module!r} raised {r['error']}{at}; fix the module "
            "(every worker imports it the same way)"
        )
    if "no_attribute" in r:
        close = r.get("close") or []
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"{field}: {path!r}: module {module!r} has no attribute {attr!r}{hint}"
    if "wrong_kind" in r:
        kind = KINDS.get(field, "function")
        wanted = "a function written in Python" if kind == "function" else f"a class with a {kind}() method"
        return f"{field}: {path!r} is {r['wrong_kind']}, not {wanted}; it is not called"
    if r.get("timeout"):
        return (
            f"{field}: importing {module!r} (for {path!r}) did not finish within {bound:g} s ({TIMEOUT_ENV}): the "
            "module does something at import that does not end (a download, a lock, a prompt); move that into "
            "the function, or raise the bound"
        )
    if "exited" in r:
        tail = " | ".join(r.get("tail") or []) or "no output"
        return (
            f"{field}: importing {module!r} (for {path!r}) ended the process that imported it (exit status "
            f"{r['exited']}; last output: {tail}); a module must not exit or crash when imported"
        )
    return (
        f"{field}: {path!r} could not be checked: the checking Python did not start "
        f"({r.get('no_start') or 'no output'}); run `{sys.executable} -c 'import {module}'` to see why"
    )


def import_paths(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, 'package.module:Name') of every user import path in the spec."""
    from syncpoint.policies.contracts.spec import BUILTIN_POLICIES

    paths = [("task.path", spec.task.path)]
    if spec.resume.policy not in BUILTIN_POLICIES:
        paths.append(("resume.policy", spec.resume.policy))
    if spec.checkpoint.save_trigger:
        paths.append(("checkpoint.save_trigger", spec.checkpoint.save_trigger))
    if spec.train.scheduler.path:
        paths.append(("train.scheduler.path", spec.train.scheduler.path))
    return paths
