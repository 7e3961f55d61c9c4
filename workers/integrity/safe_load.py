"""The one way syncpoint unpickles a state file: ``torch.load(weights_only=True)`` and one allowlist.

Why: DeepSpeed's checkpoint files are pickles, and a pickle can name any importable callable
(``os.system``, ``pathlib.Path.touch``) and have the unpickler call it. Whoever can write the
run's storage can replace a shard and re-commit the manifest to match, so a checksum proves
nothing about what the bytes do; ``resume.init_from`` even reads another party's states. PyTorch's
weights-only unpickler builds tensors, containers and primitives, and beyond those only the
classes named here. Everything that reads a DeepSpeed file (resume, ``init_from``, elastic resume
through the checkpoint engine, the fetch-time check, ``syncpoint digest``, ``drill``) goes
through :func:`load_state_file`, so there is one allowlist to review.

The allowlist is what DeepSpeed 0.19's files hold beyond torch's own safe types, found by
scanning the files fp32 and bf16 runs at ZeRO 0, 1 and 2 write (fp16 adds the dynamic loss
scaler, a plain attribute bag): the static and dynamic loss scalers, the ZeRO stage enum and the
fragment addresses of ZeRO/bf16 optimizer shards. None of them runs code when it is rebuilt.

Running no code is not enough: what torch's weights-only unpickler does allow can still allocate
without bound or build what no reader survives (``bytearray(10**13)``, a meta tensor of 10¹²
elements, a stride-0 view of 3·10⁸ elements in a 774-byte file, a cycle). Every load is bounded by
``syncpoint.workers.integrity.state_file_bounds``: the pickle's opcodes are checked before ``torch.load`` and what it
built is checked after, so resume, ``digest`` and every other reader refuse the same files.
"""

from __future__ import annotations

import io
import os
import re
import threading
import zipfile
from typing import Any, BinaryIO

import torch

from syncpoint.policies.contracts.errors import StateRefused
from syncpoint.workers.integrity.state_file_bounds import check_loaded, prescan

# torch's ``safe_globals`` adds to one process-wide set and puts back what it found on exit, so a
# thread leaving the block would take the allowlist from another thread still unpickling (a restore
# unpickles on a second thread, ``syncpoint.workers.state.preload``): one unpickling at a time.
_ALLOWLIST_IN_USE = threading.RLock()
# A refusal quotes the file's own content (global names, torch's error): bounded, one line.
_REASON_CHARS = 200
_NAMED_GLOBALS = 5


def allowed_classes() -> list[Any]:
    """The classes (beyond torch's weights-only defaults) DeepSpeed's state files may contain.

    Imported lazily: DeepSpeed takes seconds to import, and the CLI (``digest``) imports this
    module before it knows it has a file to read."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_state_file(source: str | bytes, name: str, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """Unpickle one DeepSpeed file (a local path or its bytes) without running any code from it.

    ``name`` is how the refusal names the file (its path inside the state). Raises
    :class:`StateRefused` when the file needs a class outside the allowlist, is not a torch file
    at all, or exceeds a bound of ``syncpoint.workers.integrity.state_file_bounds`` (checked before and after the
    unpickling); ``OSError`` (the disk, not the content) and ``MemoryError`` (within those bounds:
    the machine, not the file) pass through unchanged. ``mmap`` maps tensor storages instead of
    reading them (zip-format files): a cheap full check.
    """
    try:
        classes = allowed_classes()
        prescan(source, name, classes)
        with _ALLOWLIST_IN_USE, torch.serialization.safe_globals(classes):
            loaded = torch.load(
                _file(source),
                map_location=map_location,
                weights_only=True,
                mmap=mmap and isinstance(source, str) and zipfile.is_zipfile(source),
            )
        check_loaded(loaded, name, _size(source))
        return loaded
    except (OSError, MemoryError, StateRefused):
        raise
    except Exception as e:  # noqa: BLE001 - unpickling hostile bytes fails in any way (RecursionError too)
        raise StateRefused(refusal(name, source, e)) from None


def check_state_file(path: str, name: str) -> None:
    """Refuse (``StateRefused``) a local file that :func:`load_state_file` would refuse, cheaply:
    storages are memory-mapped, not read, so this costs one unpickling of the file's metadata."""
    load_state_file(path, name, mmap=True)


def refusal(name: str, source: str | bytes, error: BaseException) -> str:
    """One paragraph: which classes the file wanted (when it wanted any), and that it is corrupt."""
    wanted = disallowed_globals(source) or _globals_in_message(str(error))
    if wanted:
        noun = "class" if len(wanted) == 1 else "classes"
        more = f" and {len(wanted) - _NAMED_GLOBALS} more" if len(wanted) > _NAMED_GLOBALS else ""
        named = ", ".join(_printable(w, 100) for w in wanted[:_NAMED_GLOBALS]) + more
        return (
            f"{name} needs {noun} {named}, which a state never contains: refused (corrupt); state files "
            "are loaded weights-only with DeepSpeed's own classes, so a state cannot run code"
        )
    return f"{name} is not a torch file syncpoint can load ({_reason(error)}): refused (corrupt)"


def _printable(text: str, limit: int) -> str:
    """Content quoted from a hostile file: no control characters, bounded length."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def disallowed_globals(source: str | bytes) -> list[str]:
    """The globals a zip-format torch file names beyond the allowlist, found by reading the pickle's
    opcodes (nothing is executed); empty when the file is not a readable zip-format torch file."""
    try:
        with _ALLOWLIST_IN_USE, torch.serialization.safe_globals(allowed_classes()):
            return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(_file(source)))
    except Exception:  # noqa: BLE001 - an unreadable file names no globals; the refusal says why it failed
        return []


def _globals_in_message(message: str) -> list[str]:
    """Torch's weights-only error names the first global it refused ("GLOBAL os.system was not")."""
    return sorted(set(re.findall(r"GLOBAL (\S+) was not an allowed global", message)))


def _reason(error: BaseException) -> str:
    """The useful part of torch's error on one short line (its advice to drop weights_only is not)."""
    text = str(error)
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|Check the documentation|$)", text, re.S)
    text = _printable(" ".join((m.group(1) if m else text).split()), _REASON_CHARS)
    if m is not None and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _size(source: str | bytes) -> int:
    return len(source) if isinstance(source, (bytes, bytearray, memoryview)) else os.path.getsize(source)


def _file(source: str | bytes) -> BinaryIO | str:
    """What torch.load takes: bytes wrapped in a buffer, a path as is (mmap needs the path)."""
    return io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else os.fspath(source)
