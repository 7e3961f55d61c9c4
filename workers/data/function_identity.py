"""A digest of what a user function computes, the same in every process that loads the same code.

A stream's ``.map``/``.filter`` functions decide its examples: a state written through one function
and resumed through a changed one continues the same position over other data, silently. The
digest is compared at selection, so it must be stable across processes and restarts and change
when the computation does. Neither pickling nor ``datasets``' own ``Hasher`` does that: both name a
module-level function (and, in ``datasets`` 5.2, a lambda) by reference, so a changed body hashes
the same. This hashes by value: the function's source text (its bytecode when there is no source;
bytecode changes with the Python version, source does not), its defaults, the values of the
globals and closure cells it reads when they are plain data, and, for the functions those name in
the same module (the task's helpers), their own digest, to a bounded depth. A partial, a bound
method and a callable object of that module are walked through to the function they run. A
function or object from another module (a library's, a tokenizer) is named, not walked: walking
library code would refuse a resume after every library upgrade, and a changed library is the
environment's business, not the stream's.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from typing import Any

__all__ = ["function_digest"]

MAX_DEPTH = 4  # functions calling functions: deep enough for helpers, bounded for recursion
MAX_ITEMS = 1_000  # of a container's items, hashed (a larger constant is named by its type and length)
PLAIN = (int, float, complex, str, bytes, bool, type(None))


def function_digest(fn: Any, settings: dict[str, object] | None = None) -> str:
    """16 hex digits naming what ``fn`` computes (``__doc__``'s rules), or its type when it is not
    callable; ``settings`` (the arguments it is called with, say) are hashed by the same rules."""
    h = hashlib.sha256()
    home = _home(fn)
    _feed(h, fn, MAX_DEPTH, set(), home)
    _feed(h, settings or {}, MAX_DEPTH, set(), home)
    return h.hexdigest()[:16]


def _home(fn: Any) -> str | None:
    """The module whose functions are walked: ``fn``'s own (through a partial or a bound method)."""
    while isinstance(fn, (functools.partial, types.MethodType)):
        fn = fn.func if isinstance(fn, functools.partial) else fn.__func__
    if not isinstance(fn, types.FunctionType):
        fn = type(fn)
    return getattr(fn, "__module__", None)


def _feed(h: Any, obj: Any, depth: int, seen: set[int], home: str | None) -> None:
    """Hash ``obj`` into ``h``: plain data by value, functions by their code, anything else by type."""
    if isinstance(obj, PLAIN):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
        return
    if isinstance(obj, (tuple, list, frozenset, set, dict)):
        _feed_container(h, obj, depth, seen, home)
        return
    if id(obj) in seen or depth <= 0 or not _walked(obj, home):
        h.update(f"<{_qualname(obj)}>;".encode())
        return
    seen.add(id(obj))
    if isinstance(obj, functools.partial):
        h.update(b"partial(")
        _feed(h, obj.func, depth, seen, home)
        _feed(h, obj.args, depth, seen, home)
        _feed(h, obj.keywords, depth, seen, home)
        h.update(b");")
    elif isinstance(obj, types.MethodType):
        _feed(h, obj.__func__, depth, seen, home)
    elif isinstance(obj, types.FunctionType):
        _feed_function(h, obj, depth, seen, home)
    elif isinstance(obj, type) or isinstance(obj, types.ModuleType) or inspect.isbuiltin(obj):
        h.update(f"<{_qualname(obj)}>;".encode())
    elif isinstance(call := inspect.getattr_static(type(obj), "__call__", None), types.FunctionType):
        h.update(f"instance<{_qualname(type(obj))}>(".encode())
        _feed_function(h, call, depth, seen, home)
        h.update(b");")
    else:
        h.update(f"<{_qualname(type(obj))}>;".encode())


def _walked(obj: Any, home: str | None) -> bool:
    """Whether ``obj`` is walked into: a partial or bound method always (to what it wraps), a
    function or object only when it comes from ``home``."""
    if isinstance(obj, (functools.partial, types.MethodType)):
        return True
    owner = obj if isinstance(obj, (types.FunctionType, type)) else type(obj)
    return getattr(owner, "__module__", None) == home


def _feed_container(h: Any, obj: Any, depth: int, seen: set[int], home: str | None) -> None:
    items = list(obj.items()) if isinstance(obj, dict) else list(obj)
    if isinstance(obj, (set, frozenset, dict)):
        items.sort(key=repr)
    h.update(f"{type(obj).__name__}[{len(items)}](".encode())
    for item in items[:MAX_ITEMS]:
        _feed(h, item, depth, seen, home)
    h.update(b");")


def _feed_function(h: Any, fn: types.FunctionType, depth: int, seen: set[int], home: str | None) -> None:
    """A Python function: its code, its defaults, and what it reads (globals by name, closure cells)."""
    code = fn.__code__
    h.update(f"def {fn.__qualname__}:".encode())
    try:
        h.update(inspect.getsource(fn).encode())
    except (OSError, TypeError):
        h.update(code.co_code)
        _feed(h, [c for c in code.co_consts if isinstance(c, PLAIN)], depth, seen, home)
    _feed(h, fn.__defaults__, depth - 1, seen, home)
    _feed(h, fn.__kwdefaults__, depth - 1, seen, home)
    for name in sorted(_global_names(code)):
        if name in fn.__globals__:
            h.update(f"global {name}=".encode())
            _feed(h, fn.__globals__[name], depth - 1, seen, home)
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        h.update(f"cell {name}=".encode())
        try:
            _feed(h, cell.cell_contents, depth - 1, seen, home)
        except ValueError:  # an empty cell (a name not yet bound)
            h.update(b"<empty>;")


def _global_names(code: types.CodeType) -> set[str]:
    """The global names a code object (and the functions and comprehensions nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
