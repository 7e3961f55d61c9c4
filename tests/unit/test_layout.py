"""Where a test lives (issue 48, "Findable"): the tests of a module are where you look for them.

A test module under ``tests/unit/`` or ``tests/integration/`` sits at
``tests/<layer>/<package path>/test_<module>[_<topic>].py``: ``<package path>`` mirrors a production
package (``policies``, ``workers``, ``workers/data``, ``workers/state``, ``orchestrator``, ...) and
``<module>`` is a module of that package, or the package's own name for what its ``__init__.py``
holds (``workers/storage/test_storage_backends.py``: ``RunStorage``). Whole-job drills and Ray paths
have folders of their own (``tests/drills/``, ``tests/ray/``) and are not checked here. The few modules
that test the repository rather than one module stay at the top of their layer: ``ALLOW``, each with
its reason; keep it short, and a module that tests one module goes under that module's package.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
LAYERS = ("unit", "integration")
PACKAGES = ("policies", "workers", "orchestrator")

ALLOW: dict[str, dict[str, str]] = {
    "unit": {
        "test_layers": "the layer contract between the three packages, over every import of the tree",
        "test_layout": "this module: where every test module lives",
    },
    "integration": {
        "test_bench_contract": "every bench/ module's command line and --quick contract (bench/ is not syncpoint)",
        "test_bench_peers": "the peer benchmarks' harnesses under bench/",
        "test_docs": "the documentation site under docs/ and its generated spec reference",
        "test_own_processes": "the suite's own guard (tests/own_processes.py): a test ends only what it started",
        "test_own_training_example": "examples/own_training.yaml, run as a user runs it",
        "test_package": "the installed shape: the syncpoint/ import name and its public surface",
        "test_readme_commands": "the documented commands of the README and docs/deploy, run as written",
    },
}


def production_packages() -> dict[str, set[str]]:
    """Package path (``workers/data``) -> the names a test module there may start with (after ``test_``):
    the package's modules and its own name."""
    out: dict[str, set[str]] = {}
    for top in PACKAGES:
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            pkg = init.parent
            names = {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"} | {pkg.name}
            out[pkg.relative_to(ROOT).as_posix()] = names
    return out


def misplaced(layer: str, packages: dict[str, set[str]]) -> list[str]:
    """Each test module of a layer that is not where the layout says, with where it should go."""
    base = TESTS / layer
    problems: list[str] = []
    for path in sorted(base.rglob("test_*.py")):
        rel = path.relative_to(base)
        pkg = rel.parent.as_posix()
        if pkg == ".":
            if path.stem not in ALLOW[layer]:
                problems.append(
                    f"tests/{layer}/{rel}: move it to tests/{layer}/<package>/test_<module>[_<topic>].py, "
                    "the package and module it tests (or, if it tests the repository as a whole, add it to "
                    "ALLOW with its reason)"
                )
        elif pkg not in packages:
            problems.append(f"tests/{layer}/{rel}: {pkg}/ is no production package (those: {sorted(packages)})")
        elif not any(path.stem.startswith(f"test_{name}") for name in packages[pkg]):
            problems.append(
                f"tests/{layer}/{rel}: its name starts with no module of {pkg}/; name it "
                f"test_<module>[_<topic>].py, one of: {', '.join(sorted(packages[pkg]))}"
            )
    return problems


def test_every_unit_and_integration_test_sits_under_the_package_and_module_it_tests() -> None:
    packages = production_packages()
    assert {"policies", "workers", "workers/data", "workers/state", "orchestrator"} <= set(packages)
    problems = [p for layer in LAYERS for p in misplaced(layer, packages)]
    assert not problems, "test modules off the layout (docs/testing.md, 'Where a test lives'):\n" + "\n".join(problems)


def test_every_directory_of_a_layer_is_a_package() -> None:
    # without __init__.py pytest imports a module by its bare name, so two test_x.py in different
    # packages collide, and `from tests.integration.<package>.test_x import ...` does not resolve
    missing = [
        d.relative_to(ROOT).as_posix()
        for layer in LAYERS
        for d in [TESTS / layer, *(TESTS / layer).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").is_file()
    ]
    assert not missing, f"add an empty __init__.py to: {missing}"


def test_the_allow_list_names_only_modules_that_exist() -> None:
    stale = [
        f"tests/{layer}/{name}.py"
        for layer in LAYERS
        for name in ALLOW[layer]
        if not (TESTS / layer / f"{name}.py").is_file()
    ]
    assert not stale, f"ALLOW names modules that are gone; drop them: {stale}"


def test_a_ray_test_outside_tests_ray_is_one_make_test_would_miss():
    """make test's Ray half collects tests/ray/ alone; the conftest refuses a short Ray test elsewhere."""
    from tests.conftest import ray_test_make_test_would_miss

    assert ray_test_make_test_would_miss(TESTS / "integration" / "test_x.py", {"ray", "integration"})
    assert not ray_test_make_test_would_miss(TESTS / "integration" / "test_x.py", {"ray", "long"})
    assert not ray_test_make_test_would_miss(TESTS / "ray" / "test_x.py", {"ray", "slow"})
    assert not ray_test_make_test_would_miss(TESTS / "drills" / "ray" / "test_x.py", {"ray", "long", "drills"})
    assert not ray_test_make_test_would_miss(TESTS / "unit" / "test_x.py", {"unit"})
