"""Reading a job spec: bounded YAML, line numbers for every field, ``--set`` overrides.

Why bounds while parsing: a job file is input, sometimes hostile. Its size, nesting and alias
expansion are refused *while it is composed* (an alias bomb or a 10,000-deep list is never
built), and every error names the YAML path and line and is capped in length (``SpecError``).
The models themselves live in ``syncpoint.policies.contracts.spec`` so that every layer can import them.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from syncpoint.policies.contracts.errors import SpecError, UsageError
from syncpoint.policies.contracts.spec import MAX_SPEC_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, JobSpec

_TOO_DEEP = (
    f"nested deeper than {MAX_YAML_DEPTH} levels (aliases expanded); a job spec needs a handful: flatten "
    "task.config, or let the task read deep structures from its own files"
)


class _YamlBound(yaml.YAMLError):
    """The document exceeds a parse bound (depth, expanded size, a recursive alias)."""

    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        line = f"line {mark.line + 1}: " if mark is not None else ""
        super().__init__(line + message)


class _BoundedComposer(yaml.composer.Composer):
    """A YAML composer that refuses, while composing, what would be too big or too deep to build.

    Why during composition: an alias bomb is a few hundred bytes whose *expansion* is billions of
    nodes (PyYAML shares the aliased node, but everything that walks the result — line mapping,
    validation, JSON output — expands it); a 10,000-deep list overflows the recursive composer.
    Counting here stops both after at most MAX_YAML_NODES steps. An alias counts as a full copy of
    its target's subtree; an alias to a node still being composed (a cycle) is refused outright.
    """

    def __init__(self, base_depth: int = 0) -> None:
        super().__init__()
        self._depth = base_depth  # of the node being composed (the root is base_depth + 1)
        self._deepest = 0  # deepest level reached so far, aliases expanded
        self._nodes = 0  # nodes composed so far, aliases expanded
        self._sizes: dict[str, tuple[int, int]] = {}  # anchor -> (expanded node count, height) of its subtree
        self._open: set[str] = set()  # anchors whose node is being composed

    def _count(self, n: int, mark: yaml.Mark) -> None:
        self._nodes += n
        if self._nodes > MAX_YAML_NODES:
            raise _YamlBound(
                f"more than {MAX_YAML_NODES} YAML nodes once aliases are expanded (an alias bomb?); "
                "a job spec is small: let the task read large data from its own files",
                mark,
            )

    def _reach(self, level: int, mark: yaml.Mark) -> None:
        if level > MAX_YAML_DEPTH:
            raise _YamlBound(_TOO_DEEP, mark)
        self._deepest = max(self._deepest, level)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise _YamlBound(
                    f"alias *{event.anchor} refers to a node that contains it (a recursive structure); "
                    "a job spec must be a tree: copy the values instead",
                    event.start_mark,
                )
            node = super().compose_node(parent, index)  # an undefined alias raises ComposerError here
            size, height = self._sizes.get(event.anchor, (1, 1))
            self._reach(self._depth + height, event.start_mark)
            self._count(size, event.start_mark)
            return node
        self._depth += 1
        self._reach(self._depth, event.start_mark)
        nodes_before, deepest_before, anchor = self._nodes, self._deepest, event.anchor
        self._deepest = self._depth
        self._count(1, event.start_mark)
        if anchor is not None:
            self._open.add(anchor)
        node = super().compose_node(parent, index)
        if anchor is not None:
            self._open.discard(anchor)
            self._sizes[anchor] = (self._nodes - nodes_before, self._deepest - self._depth + 1)
        self._deepest = max(self._deepest, deepest_before)
        self._depth -= 1
        return node


class _PyLoader(
    yaml.reader.Reader,
    yaml.scanner.Scanner,
    yaml.parser.Parser,
    _BoundedComposer,
    yaml.constructor.SafeConstructor,
    yaml.resolver.Resolver,
):
    """yaml.SafeLoader with the bounded composer (pure Python events)."""

    def __init__(self, stream: str, base_depth: int = 0) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        _BoundedComposer.__init__(self, base_depth)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)


def _construct_int(loader: Any, node: yaml.ScalarNode) -> int:
    """Python refuses int() of more than 4300 digits with a bare ValueError; refuse far earlier, with the line."""
    if len(node.value) > 64:
        raise _YamlBound(
            f"an integer of {len(node.value)} characters; integers in a job spec have at most 19 digits",
            node.start_mark,
        )
    return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)


_PyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_BoundedLoader: Any = _PyLoader
if getattr(yaml, "__with_libyaml__", False):
    from yaml._yaml import CParser

    class _CLoader(_BoundedComposer, yaml.constructor.SafeConstructor, yaml.resolver.Resolver, CParser):
        """The same with libyaml's parser producing the events: scanning is ~8x faster than in Python,
        and composition (where the bounds are checked) stays in Python."""

        def __init__(self, stream: str, base_depth: int = 0) -> None:
            CParser.__init__(self, stream)
            _BoundedComposer.__init__(self, base_depth)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    _CLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
    _BoundedLoader = _CLoader


def _bounded_yaml(text: str, base_depth: int = 0) -> tuple[yaml.Node | None, Any]:
    """(root node, constructed data) of one YAML document, within the parse bounds (``base_depth``:
    levels above the document's root, e.g. the dotted key of a ``--set``).

    Raises ``yaml.YAMLError`` (``_YamlBound`` for a bound) or ``ValueError`` (an integer literal
    longer than Python converts, 4300 digits).
    """
    loader = _BoundedLoader(text, base_depth)
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    finally:
        loader.dispose()


def _line_index(
    node: yaml.Node, path: tuple = (), duplicates: list[str] | None = None, out: dict[tuple, int] | None = None
) -> dict[tuple, int]:
    """Map every YAML path to its 1-based line so errors can point at it (and note duplicate keys).

    One shared ``out`` dict (not a merge per level): linear in the (bounded) expanded size.
    """
    out = {} if out is None else out
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else f"<{k.tag}>"
            if key in seen and duplicates is not None:
                dotted = ".".join(str(p) for p in (*path, key))
                duplicates.append(
                    f"{dotted}: duplicate key (lines {seen[key]} and {k.start_mark.line + 1}); "
                    "YAML would "
                    "silently keep the last one. Merge them into one"
                )
            seen[key] = k.start_mark.line + 1
            out[path + (key,)] = k.start_mark.line + 1
            _line_index(v, path + (key,), duplicates, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _line_index(v, path + (i,), duplicates, out)
    return out


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = JobSpec
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_in(field.annotation)
        if model is None:
            return []
    return sorted((f.alias or name) for name, f in getattr(model, "model_fields", {}).items())


def _model_in(ann: Any, depth: int = 0) -> Any:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``Annotated[Union[int, X], ...]``)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if depth > 4:
        return None
    return next((m for a in getattr(ann, "__args__", ()) if (m := _model_in(a, depth + 1)) is not None), None)


def _format_errors(err: ValidationError, lines: dict[tuple, int]) -> list[str]:
    out = []
    errors = err.errors(include_url=False)
    for e in errors[:20]:  # the message shows fewer anyway (SpecError caps it)
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-"))))
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        line = lines.get(loc) or lines.get(loc[:-1]) if loc else None
        where = f"{dotted}" + (f" (line {line})" if line else "")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; allowed keys here are: " + ", ".join(_allowed_keys(loc))
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] == "finite_number":
            msg = "must be a finite number; .inf and .nan are not allowed"
        elif (
            "input" in e
            and e["type"] not in ("model_type",)
            and not isinstance(e["input"], dict)
            and loc[:2] != ("scaling", "env")  # a variable's value may be a credential: never echoed
        ):
            msg += f" (got {_short_repr(e['input'])})"
        out.append(f"{where}: {msg}")
    if len(errors) > 20:
        out.append(f"... and {len(errors) - 20} more problem(s); fix these first")
    return out


def _short_repr(value: Any, limit: int = 80) -> str:
    """repr() of user input, cut: a megabyte-long value must not become a megabyte-long message."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 4000 else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _yaml_problem(e: Exception) -> str:
    """One line for a YAML (or YAML-bound, or oversized-integer) failure, with its line when known."""
    if isinstance(e, _YamlBound):
        return str(e)
    if "nesting depth" in str(getattr(e, "problem", "")):  # libyaml's own limit (1000 flow levels)
        return _YamlBound(_TOO_DEEP, getattr(e, "problem_mark", None)).args[0]
    if isinstance(e, ValueError):  # int("9" * 5000): Python's 4300-digit conversion limit
        return "a number is too long to be read; integers here are at most 19 digits"
    mark = getattr(e, "problem_mark", None)
    line = f" (line {mark.line + 1})" if mark else ""
    return f"not valid YAML{line}: {getattr(e, 'problem', None) or e}"


def apply_overrides(raw: dict[str, object], overrides: list[str]) -> dict[str, object]:
    """Apply ``--set a.b=value`` (value parsed as YAML, within the same bounds as a job file) to a
    job file's mapping: YAML's values, which are not only JSON's (a timestamp, a byte string)."""
    if sum(len(o) for o in overrides) > MAX_SPEC_BYTES:
        raise UsageError(
            "--set",
            [
                f"the overrides are longer than {MAX_SPEC_BYTES} characters together; put large "
                "values in the job file or in files the task reads"
            ],
        )
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError("--set", [f"{_short_repr(item)}: write overrides as a.b=value"])
        parts = key.split(".")
        if len(parts) >= MAX_YAML_DEPTH:
            raise UsageError(
                "--set", [f"{_short_repr(key)}: nested deeper than {MAX_YAML_DEPTH} levels; a job spec needs a handful"]
            )
        node = raw
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise UsageError(
                    "--set",
                    [
                        f"{key}: {p} is not a mapping, cannot set a key inside it (set the whole "
                        f"value instead, e.g. --set '{p}=[...]')"
                    ],
                )
            node = nxt
        try:
            node[parts[-1]] = _bounded_yaml(value, base_depth=len(parts))[1]
        except (yaml.YAMLError, ValueError) as e:
            raise UsageError(
                "--set",
                [
                    f"{_short_repr(key)}={_short_repr(value, 60)}: {_yaml_problem(e)}; quote "
                    "strings and close brackets, e.g. --set 'faults=[]'"
                ],
            ) from None
    return raw


def read_spec_file(path: str | os.PathLike[str]) -> str:
    """The job file's text: a regular file, of which at most MAX_SPEC_BYTES + 1 bytes are read.

    Why opened non-blocking and checked on the descriptor: opening a FIFO blocks until someone
    writes to it, and reading a device (``/dev/zero``) never ends, so ``run``, ``validate``, ``drill``
    and ``submit`` would hang on a job path that is not a file; the check is on what was opened, not
    on a name that could be swapped in between."""
    source = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SpecError(source, [f"cannot read the job file: {e.strerror or e}; check the path"]) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SpecError(
                source,
                [
                    "cannot read the job file: not a regular file (a directory, a FIFO or a device); "
                    "check the path: it must name the job spec YAML file"
                ],
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError(source, [f"cannot read the job file: {e.strerror or e}; check the path"]) from None
    finally:
        os.close(fd)
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(
            source,
            [
                f"the job file is larger than {MAX_SPEC_BYTES} bytes (a job spec is a few hundred): "
                "check the path, and let the task read large data from its own files"
            ],
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(source, ["the job file is not UTF-8 text; save it as UTF-8 YAML"]) from None


# `syncpoint run --fresh`, after the user's own --set: the run starts over from step 0, and the states the run
# directory holds are moved to archive/ (never deleted); a Ray restart inside the submission still resumes
# what this submission committed, and the next `syncpoint run` without --fresh resumes it as usual.
START_OVER = ("resume.policy=fresh", "resume.policy_args={}", "resume.on_existing=archive")


def load_spec(path: str | os.PathLike[str], overrides: list[str] | None = None) -> JobSpec:
    """Load, override and validate a job file; every failure is a ``SpecError``.

    Args:
        path: the YAML job spec.
        overrides: ``dotted.field=value`` strings applied in order, each value parsed as YAML
            (``train.lr=0.001``, ``"checkpoint.save_every={value: 1, unit: optimizer_steps}"``), as
            the CLI's ``--set`` takes them.
    """
    return parse_spec(read_spec_file(path), str(path), overrides)


def parse_spec(text: str, source: str = "<spec>", overrides: list[str] | None = None) -> JobSpec:
    """Parse (within the size, depth and alias bounds), override and validate a job spec."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(
            source,
            [
                f"the job spec is larger than {MAX_SPEC_BYTES} characters (a job spec is a few "
                "hundred); let the task read large data from its own files"
            ],
        )
    try:
        node, raw = _bounded_yaml(text)
    except (yaml.YAMLError, ValueError) as e:
        raise SpecError(source, [_yaml_problem(e)]) from None
    if not isinstance(raw, dict):
        raise SpecError(source, ["the top level must be a mapping with at least name, task and train"])
    duplicates: list[str] = []
    lines = _line_index(node, (), duplicates) if node is not None else {}
    if duplicates:
        raise SpecError(source, duplicates)
    raw = apply_overrides(raw, overrides or [])
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(source, _format_errors(e, lines)) from None


def overridden_mapping(text: str, overrides: list[str] | None = None) -> dict[str, object]:
    """The job file's top-level mapping with ``--set`` applied: what ``parse_spec`` validates, as data (for
    writing the spec out again, e.g. into a ConfigMap). Call ``parse_spec`` first: this assumes valid input."""
    raw = _bounded_yaml(text)[1]
    if not isinstance(raw, dict):
        raise SpecError("<spec>", ["the top level must be a mapping with at least name, task and train"])
    return apply_overrides(raw, overrides or [])


def resolve_storage(spec: JobSpec, base_dir: str | None = None) -> JobSpec:
    """Make ``storage`` an absolute URL (and a relative ``resume.init_from`` an absolute path) on the
    driver: Ray workers run in another directory."""
    s = spec.storage
    scheme, sep, rest = s.partition("://")
    if sep and not rest.strip("/"):
        raise SpecError(
            "storage",
            [
                f"storage {s!r} names no location; write an absolute path (/data/runs), "
                "file:///data/runs, or an object-store URL such as s3://bucket/prefix"
            ],
        )
    if "://" not in s and not os.path.isabs(os.path.expanduser(s)) and "runtime_resources" in os.getcwd():
        raise SpecError(
            "storage",
            [
                f"storage {s!r} is relative, and this driver runs in a Ray job's temporary working directory "
                f"({os.getcwd()}): states would vanish with the job. Set storage to an absolute path every node "
                "shares or an object-store URL (s3://...), e.g. --set storage=s3://bucket/syncpoint"
            ],
        )
    if "://" not in s:
        s = "file://" + os.path.abspath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(s)))
    update: dict[str, object] = {"storage": s.rstrip("/")}
    init = spec.resume.init_from
    if init and "://" not in init and not os.path.isabs(os.path.expanduser(init)):
        # a relative resume.init_from (runs/pretrain/final) means the driver's directory, as storage does
        init = os.path.abspath(os.path.join(base_dir or os.getcwd(), os.path.expanduser(init)))
        update["resume"] = spec.resume.model_copy(update={"init_from": init})
    return spec.model_copy(update=update)
