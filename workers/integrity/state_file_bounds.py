"""What unpickling one state file may cost, checked before and after ``torch.load``.

Why: the weights-only unpickler runs no code of the file's choosing, but what it does allow can
still allocate without bound or build structures that whatever reads them next cannot survive.
Found in torch 2.13's ``_weights_only_unpickler``: ``REDUCE`` calls any allowed global, and several
of them allocate what their arguments say (``bytearray(10**13)``, ``torch.FloatTensor(10**8, 10**8)``,
``_rebuild_qtensor``'s empty tensor, ``_codecs.encode(x, "hex")`` doubling its input, nested 34
times); ``_rebuild_from_type_v2`` calls a function it is given; a legacy (non-zip) file allocates
every storage at the size its pickle declares before reading it. Tensors are rebuilt as views
of the file's storages with the sizes and strides the pickle says, so a 774-byte file can hold a
stride-0 view of 3·10⁸ elements, or a meta tensor of 10¹² (no storage at all), that a reader then
materialises; memo references (``BINGET``) build cycles and DAGs whose expansion is exponential.

So, before ``torch.load`` (:func:`prescan`): the archive's entries are stored uncompressed within
the file, and the pickle's opcodes are read (``pickletools.genops``, nothing executed) on a small
model of the unpickler's stack, so every call it would make is known: only the constructors a
state file is made of may be called, and the storages it declares fit in the file. After it
(:func:`check_loaded`): one linear walk of the loaded objects refuses cycles, nesting deeper than
``MAX_DEPTH``, an expansion (shared parts counted each time they are reached, as a reader walks
them) beyond ``MAX_NODES`` objects or ``TENSOR_BYTES_FACTOR`` times the file's bytes of tensor
data, and every tensor that is not a plain strided tensor within its own storage. Every refusal
raises ``StateRefused`` with one line.
"""

from __future__ import annotations

import io
import os
import pickletools
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import torch
from torch._utils import IMPORT_MAPPING, NAME_MAPPING

from syncpoint.policies.contracts.errors import StateRefused

MAX_DEPTH = 100  # containers inside containers; DeepSpeed's files nest fewer than 10
MAX_NODES = 10_000_000  # objects a walk of the file reaches; a state file has a few per tensor
TENSOR_BYTES_FACTOR = 4  # tensor bytes a walk reaches, per byte of the file (tied weights reach one twice)
TENSOR_BYTES_SLACK = 1 << 20
MAX_PICKLE_BYTES = 64 << 20  # the pickle of a state file holds metadata only: ~100 bytes per tensor
_LEGACY_PICKLES = 5  # a non-zip torch file: magic number, protocol, system info, the object, storage keys

_REBUILDS = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
}
_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"  # (func, new_type, args, state): calls func(*args)
_NEW_TYPES = {"torch.Tensor", "torch.nn.parameter.Parameter"}
# What a state file calls while it is unpickled: containers, tensor views over its own storages,
# and values that allocate nothing beyond their arguments (plus the DeepSpeed classes, added by the caller).
_CALLS = _REBUILDS | {
    _FROM_TYPE,
    "collections.OrderedDict",
    "collections.Counter",
    "builtins.set",
    "builtins.complex",
    "torch.Size",
    "torch.device",
    "torch.serialization._get_layout",
    "torch.nn.parameter.Parameter",
}
_PUSHES_VALUE = {"BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"}


def prescan(source: str | bytes, name: str, classes: list[Any]) -> None:
    """Refuse (``StateRefused``) a file whose unpickling would call anything but a state file's own
    constructors (``classes``: the allowed DeepSpeed classes) or declare more storage than it holds."""
    size = len(source) if isinstance(source, (bytes, bytearray, memoryview)) else os.path.getsize(source)
    names = {f"{c.__module__}.{c.__qualname__}" for c in classes}
    calls = _Calls(_CALLS | names, _torch_allows() | names, size)
    with _opened(source) as f:
        zip_format = f.read(4) == b"PK\x03\x04"  # how torch.load tells the two formats apart
        f.seek(0)
        try:
            if zip_format:
                _check_archive(f, size, name)
                _scan(io.BytesIO(_zip_pickle(source, name)), name, calls)
            else:  # the legacy format: several pickles in a row, then the storages' bytes
                head = io.BytesIO(f.read(min(size, MAX_PICKLE_BYTES)))
                for _ in range(_LEGACY_PICKLES):
                    _scan(head, name, calls)
        except _TorchRefuses:
            return


def _opened(source: str | bytes) -> Any:
    return open(source, "rb") if isinstance(source, str) else io.BytesIO(source)


def _check_archive(f: Any, size: int, name: str) -> None:
    """torch writes every record stored (uncompressed): a compressed record, or one said to reach
    past the file, is a lie whose stated size torch's reader would allocate before reading."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise StateRefused(
            f"{name} is not a torch file syncpoint can load (not a readable zip archive: "
            f"{str(e)[:100]}): refused (corrupt)"
        ) from None
    for info in infos:
        if (
            info.compress_type != zipfile.ZIP_STORED
            or info.compress_size != info.file_size
            or info.header_offset + info.file_size > size
        ):
            raise StateRefused(
                f"{name}: its archive record {info.filename[:100]!r} is compressed or larger than "
                "the file (torch writes every record stored, within the file): refused (corrupt)"
            )
    if sum(i.file_size for i in infos) > size:
        raise StateRefused(f"{name}: its archive records add up to more than the file: refused (corrupt)")


def _zip_pickle(source: str | bytes, name: str) -> bytes:
    """The archive's ``data.pkl``, read by torch's own reader (the one ``torch.load`` uses; syncpoint
    writes its archives without CRC-32s, which Python's ``zipfile`` insists on)."""
    try:
        reader = torch._C.PyTorchFileReader(source if isinstance(source, str) else io.BytesIO(source))
        pickle = reader.get_record("data.pkl")
    except Exception as e:  # noqa: BLE001 - a damaged archive fails in torch's C++ in any way
        raise StateRefused(
            f"{name} is not a torch file syncpoint can load ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:100]}): refused (corrupt)"
        ) from None
    if len(pickle) > MAX_PICKLE_BYTES:
        raise StateRefused(
            f"{name}: its pickle is {len(pickle)} bytes, more than the {MAX_PICKLE_BYTES} a state "
            "file's metadata needs: refused (corrupt)"
        )
    return bytes(pickle)


class _Global(str):
    """A global the pickle names (``module.name``), as it sits on the modelled stack."""


class _Calls:
    """What the pickle may call (``allowed``), and every global torch itself lets it name (``named``)."""

    def __init__(self, allowed: set[str], named: set[str], size: int) -> None:
        self.allowed, self.named, self.size = allowed, named, size
        self.storages: dict[Any, int] = {}  # storage key -> bytes declared
        self.declared = 0  # their sum

    def refuses(self, func: Any) -> bool:
        return not isinstance(func, _Global) or func not in self.allowed

    def torch_refuses(self, name: str) -> bool:
        return bool(self.named) and name not in self.named and name not in self.allowed


class _TorchRefuses(Exception):
    """The pickle names a global torch refuses as soon as it is named: nothing after it runs, and
    torch's refusal (``safe_load.refusal``: "needs class ...") says what the file wanted."""


def _torch_allows() -> set[str]:
    """The globals torch's weights-only unpickler accepts (its defaults and those added process-wide);
    empty when this torch does not say, and then every call outside the allowed ones is refused here."""
    from torch import _weights_only_unpickler as unpickler

    try:
        return set(unpickler._get_allowed_globals()) | set(unpickler._get_user_allowed_globals())
    except Exception:  # noqa: BLE001 - a private API of torch: its absence only makes the scan stricter
        return set()


def _scan(stream: io.BytesIO, name: str, calls: _Calls) -> None:
    """Run one pickle's opcodes (from the stream's position to its STOP) on a model of the
    weights-only unpickler's stack: values are globals, tuples, ints and strings where they matter,
    None otherwise. Linear in the pickle's length; nothing is built but the model."""
    stack: list[Any] = []
    marks: list[list[Any]] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, _pos in pickletools.genops(stream):
            if op.name == "STOP":
                return
            stack = _step(op.name, arg, stack, marks, memo, name, calls)
    except (StateRefused, _TorchRefuses):
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle (stack underflow, a missing memo entry, a bad opcode)
        raise StateRefused(
            f"{name} is not a torch file syncpoint can load (its pickle is malformed: "
            f"{type(e).__name__} {str(e)[:80]}): refused (corrupt)"
        ) from None
    raise StateRefused(f"{name} is not a torch file syncpoint can load (its pickle has no end): refused (corrupt)")


def _step(
    op: str, arg: Any, stack: list[Any], marks: list[list[Any]], memo: dict[int, Any], name: str, calls: _Calls
) -> list[Any]:
    """One opcode on the modelled stack; returns the stack (MARK and the ops that pop to it swap it)."""
    if op == "MARK":
        marks.append(stack)
        return []
    if op in _PUSH_OPS:
        _push(op, arg, stack, calls)
    elif op in _BUILD_OPS:
        stack = _build(op, stack, marks)
    elif op in _CALL_OPS:
        _call(op, stack, name, calls)
    elif op in _MEMO_OPS:
        _memo(op, arg, stack, memo)
    elif op != "PROTO":
        raise StateRefused(
            f"{name} uses the pickle opcode {op}, which torch's weights-only loader does not read: refused (corrupt)"
        )
    return stack


_VALUE_OPS = {"BININT", "BININT1", "BININT2", "LONG1", "BINUNICODE", "SHORT_BINSTRING"}  # their value is modelled
_PUSH_OPS = {"GLOBAL"} | _VALUE_OPS | _PUSHES_VALUE
_BUILD_OPS = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "APPENDS", "SETITEMS", "APPEND", "BUILD", "SETITEM"}
_CALL_OPS = {"REDUCE", "NEWOBJ", "BINPERSID"}
_MEMO_OPS = {"BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET"}


def _push(op: str, arg: Any, stack: list[Any], calls: _Calls) -> None:
    """A global (named as torch names it, refused as soon as torch would), a value, or a placeholder."""
    if op == "GLOBAL":
        module, _, attr = str(arg).partition(" ")
        module, attr = NAME_MAPPING.get((module, attr), (IMPORT_MAPPING.get(module, module), attr))
        if calls.torch_refuses(f"{module}.{attr}"):
            raise _TorchRefuses
        stack.append(_Global(f"{module}.{attr}"))
    elif op in _VALUE_OPS:
        stack.append(arg)
    else:
        stack.append(None)


def _build(op: str, stack: list[Any], marks: list[list[Any]]) -> list[Any]:
    """Tuples are modelled; appends, items and BUILD only pop what they consume."""
    if op == "TUPLE":
        items, stack = stack, marks.pop()
        stack.append(tuple(items))
    elif op in ("TUPLE1", "TUPLE2", "TUPLE3"):
        n = int(op[-1])
        if len(stack) < n:
            raise IndexError("stack underflow")
        packed = tuple(stack[-n:])
        del stack[-n:]
        stack.append(packed)
    elif op in ("APPENDS", "SETITEMS"):
        stack = marks.pop()
        _top(stack)
    elif op in ("APPEND", "BUILD"):
        stack.pop()
        _top(stack)
    else:  # SETITEM
        del stack[-2:]
        _top(stack)
    return stack


def _call(op: str, stack: list[Any], name: str, calls: _Calls) -> None:
    """The calls the unpickler would make, checked, and the storages the file declares, counted."""
    if op == "REDUCE":
        args = stack.pop()
        _check_call(_top(stack), args, name, calls)
        stack[-1] = None
    elif op == "NEWOBJ":
        args, cls = stack.pop(), stack.pop()
        _check_call(cls, args, name, calls)
        stack.append(None)
    else:  # BINPERSID
        _note_storage(stack.pop(), name, calls)
        stack.append(None)


def _memo(op: str, arg: Any, stack: list[Any], memo: dict[int, Any]) -> None:
    if op in ("BINPUT", "LONG_BINPUT"):
        memo[arg] = _top(stack)
    else:  # BINGET, LONG_BINGET
        stack.append(memo[arg])


def _top(stack: list[Any]) -> Any:
    if not stack:
        raise IndexError("stack underflow")
    return stack[-1]


def _check_call(func: Any, args: Any, name: str, calls: _Calls) -> None:
    """A call the unpickler would make: only a state file's constructors, and ``_rebuild_from_type_v2``
    only of a tensor rebuild as a plain tensor or parameter."""
    if calls.refuses(func):
        what = f"{func[:100]}" if isinstance(func, _Global) else "a value that is not a named class or function"
        raise StateRefused(
            f"{name} calls {what} while it is unpickled, which a state file never does (its pickle "
            "calls only containers and tensor views over its own storages): refused (corrupt)"
        )
    if func == _FROM_TYPE:
        inner = args[0] if isinstance(args, tuple) and args else None
        new_type = args[1] if isinstance(args, tuple) and len(args) > 1 else None
        if not isinstance(inner, _Global) or inner not in _REBUILDS or new_type not in _NEW_TYPES:
            raise StateRefused(
                f"{name} rebuilds a tensor through {str(inner)[:100]} as {str(new_type)[:100]}, which "
                "a state file never does: refused (corrupt)"
            )


def _note_storage(pid: Any, name: str, calls: _Calls) -> None:
    """A storage the file declares: ('storage', type, key, location, numel[, view]), its bytes counted
    once per key; refused as soon as they add up to more than the file (a legacy file's storages are
    allocated at their declared size as they are named, before any byte is read)."""
    if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage" and isinstance(pid[4], int)):
        return  # torch refuses any other persistent id itself
    short = str(pid[1]).rsplit(".", 1)[-1]
    with warnings.catch_warnings():  # the legacy storage classes name their dtype with a deprecation warning
        warnings.simplefilter("ignore")
        dtype = getattr(getattr(torch, short, None), "dtype", None)
    element = dtype.itemsize if isinstance(dtype, torch.dtype) else 1  # UntypedStorage: bytes
    key = pid[2] if isinstance(pid[2], (str, int)) else id(pid)
    before = calls.storages.get(key, 0)
    calls.storages[key] = max(before, max(pid[4], 0) * element)
    calls.declared += calls.storages[key] - before
    if calls.declared > calls.size:
        raise StateRefused(
            f"{name} declares {calls.declared} bytes of tensor storage in a file of {calls.size} "
            "bytes: refused (corrupt)"
        )


# ---------------------------------------------------------------- after torch.load


def check_loaded(obj: Any, name: str, file_bytes: int) -> None:
    """One walk of what a file loaded to; refuses (``StateRefused``) what a reader could not walk or
    materialise within bounds: a cycle, nesting deeper than MAX_DEPTH, an expansion beyond MAX_NODES
    objects or TENSOR_BYTES_FACTOR x ``file_bytes`` of tensor data, and any tensor that is not a plain
    strided tensor with storage for every element it claims (meta, quantized, sparse, nested, an
    expanded or stride-0 view). Shared parts are walked once (memoised): linear in what was built."""
    budget = TENSOR_BYTES_FACTOR * file_bytes + TENSOR_BYTES_SLACK
    done: dict[int, tuple[int, int, int]] = {}  # id -> (objects, height, tensor bytes) of its expansion
    # the containers being walked, outermost first: (container, its members left, its totals so far)
    path: list[tuple[Any, Iterator[Any], list[int]]] = [(None, iter([obj]), [0, 0, 0])]
    on_path: set[int] = set()
    while path:
        node, members, totals = path[-1]
        member = next(members, _END)
        if member is _END:
            path.pop()
            on_path.discard(id(node))
            if path:
                done[id(node)] = (totals[0], totals[1], totals[2])
                _add(path[-1][2], done[id(node)], len(path), name, budget, file_bytes)
            continue
        known = _known(member, done, name)
        if known is not None:
            _add(totals, known, len(path), name, budget, file_bytes)
        elif id(member) in on_path:
            raise StateRefused(f"{name} holds a structure that contains itself: refused (corrupt)")
        else:
            on_path.add(id(member))
            path.append((member, _members(member), [1, 0, 0]))


def _known(node: Any, done: dict[int, tuple[int, int, int]], name: str) -> tuple[int, int, int] | None:
    """A node's (objects, height, tensor bytes) when known without walking it: a leaf, a tensor, or
    a container walked before (a shared part)."""
    if isinstance(node, torch.Tensor):
        if id(node) not in done:
            done[id(node)] = (1, 0, _tensor_bytes(node, name))
        return done[id(node)]
    if _is_leaf(node):
        return (1, 0, 0)
    return done.get(id(node))


def _add(totals: list[int], child: tuple[int, int, int], depth: int, name: str, budget: int, file_bytes: int) -> None:
    """Count a member's expansion into its container's (``depth``: the container's own level)."""
    totals[0] += child[0]
    totals[1] = max(totals[1], child[1] + 1)
    totals[2] += child[2]
    if depth + child[1] > MAX_DEPTH:
        raise StateRefused(
            f"{name} nests deeper than {MAX_DEPTH} levels (a state file nests fewer than 10): refused (corrupt)"
        )
    if totals[0] > MAX_NODES or totals[2] > budget:
        raise StateRefused(
            f"{name} expands to more than {MAX_NODES} objects or {budget} bytes of tensors for a "
            f"file of {file_bytes} bytes (parts shared many times over): refused (corrupt)"
        )


_END = object()
_CONTAINERS = (dict, list, tuple, set, frozenset)


def _is_leaf(node: Any) -> bool:
    return (
        isinstance(node, (str, bytes, int, float, complex, type(None), torch.dtype, torch.device, torch.Size))
        or not isinstance(node, _CONTAINERS)
        and not isinstance(getattr(node, "__dict__", None), dict)
    )


def _members(node: Any) -> Iterator[Any]:
    """A container's members: a dict's keys and values, an object's attributes."""
    if isinstance(node, dict):
        return (x for kv in node.items() for x in kv)
    if isinstance(node, _CONTAINERS):
        return iter(node)
    return iter(vars(node).values())


def _tensor_bytes(t: torch.Tensor, name: str) -> int:
    """The bytes a tensor's elements take once materialised, refused unless its storage holds them."""
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided
        or t.is_meta
        or t.is_quantized
        or t.is_nested
    ):
        kind = (
            "meta"
            if t.is_meta
            else str(t.layout).removeprefix("torch.")
            if t.layout != torch.strided
            else type(t).__name__
        )
        raise StateRefused(
            f"{name} holds a {kind} tensor of {tuple(t.shape)[:8]}, which a state file never does "
            "(only plain tensors with their data): refused (corrupt)"
        )
    need = t.numel() * t.element_size()
    have = t.untyped_storage().nbytes()
    if need > have:
        raise StateRefused(
            f"{name} holds a tensor of {t.numel()} elements over {have} bytes of storage (an expanded "
            "or overlapping view, which a state file never holds): refused (corrupt)"
        )
    return need
