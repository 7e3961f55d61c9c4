"""Render the job spec reference (docs/reference/spec.md) from the pydantic models in policies/contracts/spec/.

The page's hand-written prose stays; only the part between the two markers is generated: one section
per model (``scaling``, ``train.optimizer``, ``faults[]``, ...), one table row per field with its YAML
name, type and bounds, default and description. ``tests/integration/test_docs.py`` fails when the committed page
and the models disagree.

    python docs/gen_spec_reference.py           # rewrite the generated part of the page
    python docs/gen_spec_reference.py --check   # exit 1 if the page is out of date
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from syncpoint.policies.contracts.spec import JobSpec  # noqa: E402  (the repository root must be on sys.path first)

PAGE = ROOT / "docs" / "reference" / "spec.md"
BEGIN = "<!-- BEGIN GENERATED: python docs/gen_spec_reference.py -->"
END = "<!-- END GENERATED -->"


def _anchor(path: str) -> str:
    return "spec-" + re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _number(v: float) -> str:
    """Bounds as people read them: 2^20, 10^9, 2^63 − 1; anything else as written."""
    if isinstance(v, bool) or not float(v).is_integer() or abs(v) < 10_000:
        return f"{v:g}" if isinstance(v, float) else str(v)
    n = int(v)
    for base in (10, 2):
        k = round(math.log(n, base))
        if base**k == n:
            return f"{base}^{k}"
        if base == 2 and 2**k - 1 == n:
            return f"2^{k} − 1"
    return f"{n:,}"


def _constraints(metadata: list[Any], kind: str) -> list[str]:
    out: list[str] = []
    for m in metadata:
        if isinstance(m, FieldInfo):
            out += _constraints(m.metadata, kind)
        elif isinstance(m, at.Ge):
            out.append(f"≥ {_number(m.ge)}")  # type: ignore[arg-type]
        elif isinstance(m, at.Gt):
            out.append(f"> {_number(m.gt)}")  # type: ignore[arg-type]
        elif isinstance(m, at.Le):
            out.append(f"≤ {_number(m.le)}")  # type: ignore[arg-type]
        elif isinstance(m, at.Lt):
            out.append(f"< {_number(m.lt)}")  # type: ignore[arg-type]
        elif isinstance(m, at.MinLen):
            out.append(
                "not empty"
                if m.min_length == 1
                else f"at least {m.min_length} {'characters' if kind == 'str' else 'items'}"
            )
        elif isinstance(m, at.MaxLen):
            out.append(f"at most {_number(m.max_length)} {'characters' if kind == 'str' else 'items'}")
        elif getattr(m, "pattern", None):
            out.append(f"matching `{m.pattern}`")
    return out


def _kind(t: Any) -> str:
    """``str`` when a field's value is a string (its length bounds count characters), else ``other``."""
    return "str" if t is str or str in typing.get_args(t) else "other"


def _is_model(t: Any) -> bool:
    return inspect.isclass(t) and issubclass(t, BaseModel)


def _type(t: Any, path: str, models: dict[str, type[BaseModel]]) -> str:
    """A field's type in words, with a link to the section of a nested model (``models`` collects them)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        base = _type(args[0], path, models)
        kind = _kind(args[0])
        cons = _constraints(
            [a for a in args[1:] if isinstance(a, (FieldInfo, at.BaseMetadata)) or getattr(a, "pattern", None)], kind
        )
        return base + (f" ({', '.join(cons)})" if cons else "")
    if origin in (typing.Union, types.UnionType):
        parts = [_type(a, path, models) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or `null`" if type(None) in args else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return "list of " + _type(args[0], path + "[]", models)
    if origin is tuple:
        return "[" + ", ".join(_type(a, path, models) for a in args) + "]"
    if origin is dict or t is dict:
        return "mapping"
    if _is_model(t):
        models.setdefault(path, t)
        return f"[{path}](#{_anchor(path)})"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}.get(t, getattr(t, "__name__", str(t)))


def _scalar(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _default(f: FieldInfo) -> str:
    if f.default_factory is not None:
        v = f.default_factory()  # type: ignore[call-arg]
    elif f.default is PydanticUndefined:
        return "required"
    else:
        v = f.default
    if isinstance(v, BaseModel):
        fields = type(v).model_fields
        if any(fields[k].default is PydanticUndefined and fields[k].default_factory is None for k in fields):
            v = v.model_dump(mode="json", by_alias=True)  # a value (save_every's off), not a section
        else:
            return "see below"
    if isinstance(v, dict):
        return "`{" + ", ".join(f"{k}: {_scalar(x)}" for k, x in v.items()) + "}`"
    if isinstance(v, list | tuple):
        return "`[" + ", ".join(_scalar(x) for x in v) + "]`"
    return f"`{_scalar(v)}`"


def _cell(text: str) -> str:
    """Table-cell text: one line, pipes escaped, <placeholders> shown as text, no stray emphasis."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return "`".join(parts)


def _doc(model: type[BaseModel]) -> str:
    """The first paragraph of a model's docstring (pydantic's BaseModel docstring does not count)."""
    doc = model.__dict__.get("__doc__") or ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split()).replace("``", "`")


def _section(path: str, model: type[BaseModel], intro: str) -> list[str]:
    """A model's section, then (depth first) the sections of the models its fields hold."""
    nested: dict[str, type[BaseModel]] = {}
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    intros: dict[str, str] = {}
    for name, f in model.model_fields.items():
        key = f.alias or name
        full = f"{path}.{key}" if path else key
        typ = _type(f.annotation, full, nested)
        cons = _constraints(f.metadata, _kind(f.annotation))
        if cons:
            typ += f" ({', '.join(cons)})"
        intros[full] = intros[full + "[]"] = f.description or ""
        rows.append(f"| `{full}` | {_cell(typ)} | {_cell(_default(f))} | {_cell(f.description or '')} |")
    title = f"`{path}`" if path else "Top level"
    anchor = _anchor(path) if path else "spec-top-level"
    doc = _doc(model)
    intro = " ".join(x for x in (intro, doc if doc != intro else "") if x)
    out = ["\n".join([f"### {title} {{ #{anchor} }}", "", *([intro, ""] if intro else []), *rows])]
    for sub, m in nested.items():
        out += _section(sub, m, intros.get(sub, ""))
    return out


def render() -> str:
    """The generated part of the page (between the markers, the markers excluded)."""
    return "\n\n".join(_section("", JobSpec, "")) + "\n"


def page_with(generated: str, page: str) -> str:
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{generated}\n{END}{tail}"


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    new = page_with(render(), page)
    if "--check" in argv:
        if new != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python docs/gen_spec_reference.py", file=sys.stderr)
            return 1
        return 0
    if new != page:
        PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
