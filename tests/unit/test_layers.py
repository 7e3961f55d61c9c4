"""The layer contract: ``syncpoint.orchestrator`` → ``syncpoint.workers`` → ``syncpoint.policies``, never back;
``syncpoint`` itself (the public API, ``syncpoint/``) sits on top and may import all three.

Why a test and not a convention: a back-edge (a worker importing the driver, a decision importing
a worker) is one innocent line, and it silently turns the pure, Ray-free layers into ones that
need the whole stack to test. Parsing every import (including the lazy ones inside functions), in
every sub-package, makes such a line fail the build with its file and line.

The three layers live at the repository's top level and install as ``syncpoint.<layer>``; in a
checkout their bare directory names (``import workers``) would import too, as a second copy of
every module under another name, so no file of the project may spell them.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("policies", "workers", "orchestrator")
BARE_NAMES = LAYERS  # the layers' directory names, importable in a checkout but never to be used
# What each layer may import of the project (itself included); "syncpoint" is the public API on top.
ALLOWED = {
    "policies": {"policies"},
    "workers": {"policies", "workers"},
    "orchestrator": {"policies", "workers", "orchestrator"},
    "syncpoint": {"policies", "workers", "orchestrator", "syncpoint"},
}
# Every directory holding Python the project runs or tests, beside the layers.
OTHER_CODE = ("syncpoint", "tests", "bench", "examples")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module name) of every absolute import (``from syncpoint import y``: ``syncpoint.y``)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "syncpoint":
            out += [(node.lineno, f"syncpoint.{a.name}") for a in node.names]  # "from syncpoint import workers"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _layer_of(name: str) -> str | None:
    """The layer an import of the project names (None: not the project's)."""
    parts = name.split(".")
    if parts[0] != "syncpoint":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "syncpoint"


def _files(directory: str) -> list[Path]:
    """The directory's Python files, sub-packages included (``syncpoint/`` only its own: it links the layers)."""
    base = ROOT / directory
    return sorted(base.glob("*.py") if directory == "syncpoint" else base.rglob("*.py"))


def _back_edges() -> list[str]:
    found = []
    for layer in (*LAYERS, "syncpoint"):
        for path in _files(layer):
            for line, name in _imports(path):
                target = _layer_of(name)
                if target is not None and target not in ALLOWED[layer]:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return sorted(set(found))


def _bare_names() -> list[str]:
    found = []
    for directory in (*LAYERS, *OTHER_CODE):
        for path in _files(directory):
            found += [
                f"{path.relative_to(ROOT)}:{line} imports {name}"
                for line, name in _imports(path)
                if name.split(".")[0] in BARE_NAMES
            ]
    return sorted(set(found))


def test_layers_flow_one_way():
    assert _back_edges() == []


def test_nothing_imports_a_layer_by_its_bare_directory_name():
    """``from workers.x import ...`` must read ``from syncpoint.workers.x import ...`` everywhere."""
    assert _bare_names() == []


def test_the_checker_sees_a_planted_back_edge(tmp_path, monkeypatch):
    """The contract test itself can fail: a worker module importing the driver, in a sub-package too, is reported."""
    for package in (*LAYERS, "syncpoint"):
        (tmp_path / package).mkdir()
    (tmp_path / "workers" / "storage").mkdir()
    (tmp_path / "workers" / "bad.py").write_text("def f():\n    from syncpoint.orchestrator.cli import main\n")
    (tmp_path / "workers" / "storage" / "bad.py").write_text("from syncpoint import run\n")
    (tmp_path / "policies" / "bad.py").write_text("import syncpoint.workers.storage\nfrom syncpoint import workers\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert _back_edges() == [
        "policies/bad.py:1 imports syncpoint.workers.storage",
        "policies/bad.py:2 imports syncpoint.workers",
        "workers/bad.py:2 imports syncpoint.orchestrator.cli",
        "workers/storage/bad.py:1 imports syncpoint.run",
    ]


def test_the_checker_sees_an_old_name(tmp_path, monkeypatch):
    for directory in (*LAYERS, *OTHER_CODE):
        (tmp_path / directory).mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from workers.task import Task\nimport policies.spec\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert _bare_names() == ["tests/test_x.py:1 imports workers.task", "tests/test_x.py:2 imports policies.spec"]


def _modules(layer: str) -> list[str]:
    base = ROOT / layer
    return [
        ".".join(("syncpoint", layer, *p.relative_to(base).with_suffix("").parts)).removesuffix(".__init__")
        for p in _files(layer)
        if p.stem != "__main__"
    ]


@pytest.mark.parametrize("layer", LAYERS)
def test_every_module_of_a_layer_imports_on_its_own(layer):
    """No hidden order dependence: each module imports cleanly in a fresh interpreter's view of the tree."""
    modules = _modules(layer)
    assert len(modules) > 1
    for name in modules:
        importlib.import_module(name)


# Ray's private modules: only syncpoint.orchestrator.ray_internals names them (its test resolves each)
RAY_PRIVATE = ("ray._private", "ray.train.v2._internal", "ray.core.generated")


def test_only_ray_internals_imports_rays_private_modules():
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for layer in (*LAYERS, "syncpoint")
        for path in _files(layer)
        if path.name != "ray_internals.py"
        for line, name in _imports(path)
        if name.startswith(RAY_PRIVATE)
    ]
    assert found == []


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("syncpoint", *parts))


def _runtime_imports(path: Path) -> set[str]:
    """Every module of the project this file imports when it runs (lazy imports inside functions
    included; those under ``if TYPE_CHECKING:`` never run), as dotted names: ``from a import b``
    counts as ``a`` and, when ``b`` is a module, ``a.b``."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return out


def test_no_import_cycle_between_the_projects_modules():
    """Two modules that import each other (at once or through others, lazily or not) are one concern
    split in two, or a helper in the wrong place: each such cycle was broken by moving the helper."""
    import graphlib

    modules = {_module_name(p): p for layer in LAYERS for p in _files(layer)}
    graph = {m: {t for t in _runtime_imports(p) if t in modules and t != m} for m, p in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"an import cycle: {' -> '.join(e.args[1])}")


MAX_MODULE_LINES = 600  # issue 49: a module over this holds more than one job; split it by what each part does


def test_no_production_module_is_over_600_lines():
    """A module grows past one job one helper at a time; the bound makes the split happen when it does."""
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for layer in LAYERS
        for path in _files(layer)
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"over {MAX_MODULE_LINES} lines (split each by what its parts do): {long}"
