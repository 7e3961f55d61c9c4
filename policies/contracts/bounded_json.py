"""JSON from storage or a command line, parsed within bounds: its size, its nesting, its integers.

Why: whoever can write the run's storage (or type a command line) chooses the bytes. Python's
parser recurses once per nesting level, so a 10⁵-deep array raises ``RecursionError``, which no
``except ValueError`` catches; a 400-digit integer parses, and then ``float()`` of it raises
``OverflowError`` wherever it is sorted, subtracted or plotted. Here every such input is one
``BoundedJsonError`` (a ``ValueError``) that says what is wrong, and what parses is small, shallow
and holds integers any later arithmetic can take.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, TypeAlias

# JSON as parsed or about to be written, for documents syncpoint passes through without a fixed
# shape (an event's record, a spec's free-form ``config``); a record whose keys are fixed has its own type.
JSONValue: TypeAlias = "str | int | float | bool | None | list[JSONValue] | dict[str, JSONValue]"
JSONObject: TypeAlias = "dict[str, JSONValue]"

MAX_INT_DIGITS = 20  # 2**64 has 20 digits: every counter, size and seed syncpoint writes fits


class BoundedJsonError(ValueError):
    """The input is not JSON, or not JSON within the bounds asked for; the message says which."""


def loads_bounded(data: bytes | str, *, max_bytes: int, max_depth: int, max_int_digits: int = MAX_INT_DIGITS) -> Any:
    """Parse ``data`` as JSON: at most ``max_bytes`` long, nested at most ``max_depth`` levels (a
    scalar is level 0), integers of at most ``max_int_digits`` digits (MAX_INT_DIGITS unless a
    format's writer holds its integers to another bound and says so: the state-tree codec's
    ``syncpoint.workers.data.stream_state.MAX_INT_DIGITS``). NaN and Infinity parse (a training
    loss can be NaN); callers that need finite numbers check them in their models."""
    if len(data) > max_bytes:
        raise BoundedJsonError(f"larger than {max_bytes} bytes")
    try:
        value = json.loads(data, parse_int=partial(_bounded_int, max_digits=max_int_digits))
    except RecursionError:
        raise BoundedJsonError(f"nested deeper than {max_depth} levels") from None
    except BoundedJsonError:
        raise
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise BoundedJsonError(f"not JSON ({_short(str(e))})") from None
    if depth_exceeds(value, max_depth):
        raise BoundedJsonError(f"nested deeper than {max_depth} levels")
    return value


def _bounded_int(text: str, *, max_digits: int) -> int:
    if len(text.lstrip("-")) > max_digits:
        raise BoundedJsonError(f"an integer of {len(text)} characters (at most {max_digits} digits)")
    return int(text)


def depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether parsed JSON nests deeper than ``max_depth``; iterative, linear in its size."""
    todo: list[tuple[Any, int]] = [(value, 0)]
    while todo:
        node, depth = todo.pop()
        members = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if members is None:
            continue
        if depth + 1 > max_depth:
            return True
        todo.extend((m, depth + 1) for m in members)
    return False


def _short(text: str, limit: int = 120) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
