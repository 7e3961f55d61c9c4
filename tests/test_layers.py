"""The layer contract: ``orchestrator`` → ``workers`` → ``policies``, never back.

Why a test and not a convention: a back-edge (a worker importing the driver, a decision importing
a worker) is one innocent line, and it silently turns the pure, Ray-free layers into ones that
need the whole stack to test. Parsing every import (including the lazy ones inside functions)
makes such a line fail the build with its file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("policies", "workers", "orchestrator")
# What each layer may import of the project (itself included).
ALLOWED = {"policies": {"policies"}, "workers": {"policies", "workers"},
           "orchestrator": {"policies", "workers", "orchestrator"}}


def _project_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            if node.module in PACKAGES:  # "from workers import loop"
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] in PACKAGES + ("tests", "bench", "examples")]


def _back_edges() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            for line, name in _project_imports(path):
                if name.split(".")[0] not in ALLOWED[package]:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


def test_layers_flow_one_way():
    assert _back_edges() == []


def test_the_checker_sees_a_planted_back_edge(tmp_path, monkeypatch):
    """The contract test itself can fail: a worker module importing the driver is reported."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "workers" / "bad.py").write_text("def f():\n    from orchestrator.cli import main\n")
    (tmp_path / "policies" / "bad.py").write_text("import workers.storage\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert _back_edges() == ["policies/bad.py:1 imports workers.storage", "workers/bad.py:2 imports orchestrator.cli"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_of_a_layer_imports_on_its_own(package):
    """No hidden order dependence: each module imports cleanly in a fresh interpreter's view of the tree."""
    modules = [p.stem for p in (ROOT / package).glob("*.py") if p.stem not in ("__init__", "__main__")]
    assert modules
    for name in modules:
        __import__(f"{package}.{name}")
