"""The bench contract, kept by tests so a bench cannot rot unnoticed: every module in ``bench/`` that
runs as a bench exposes its command line as ``parser()``, takes ``--quick`` and answers ``--help``
(checked in ``make test``, without running anything); and every ``--quick`` run, started as a user
starts it, exits 0 and prints ``goal <name>: <measured> vs <target>: met|not met`` lines (``long``:
in ``make test-all``). Whether a goal is met is the bench's report, never a test's verdict: no time
is asserted. The modules are found in ``bench/``, so a new one is checked without being listed."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from syncpoint.workers.storage import RunStorage

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
GOAL = re.compile(r"^goal (?P<name>\S[^:]*): (?P<measured>.+) vs (?P<target>.+): (?P<verdict>met|not met)\b")
# what starts a Ray cluster in a bench: the drills, the Ray runner, the as-filed checkout's jobs and CLI
RAY_MARKERS = ("run_drill", "run_on_ray", "run_reported", "bench.as_filed")
QUICK_TIMEOUT_S = 1200  # a quick run takes minutes; make test-all runs it beside the rest of the suite


def _source(name: str) -> str:
    return (BENCH / f"{name}.py").read_text()


def _modules() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")


def _runnable(name: str) -> bool:
    """A bench runs as ``python -m bench.<name>``; any other module in bench/ is a helper of one."""
    return re.search(r"^if __name__ == .__main__.:", _source(name), re.MULTILINE) is not None


BENCHES = [n for n in _modules() if _runnable(n)]
HELPERS = [n for n in _modules() if not _runnable(n)]


def test_every_module_in_bench_is_a_bench_or_a_helper_one_imports():
    """A module that neither runs nor is imported by a bench is a bench someone forgot to make runnable."""
    assert BENCHES, "no bench found in bench/"
    for helper in HELPERS:
        users = [b for b in BENCHES + HELPERS if b != helper and f"bench.{helper}" in _source(b)]
        assert users, f"bench/{helper}.py has no `if __name__ == '__main__':` and no bench imports it"


@pytest.mark.parametrize("name", BENCHES)
def test_bench_parser_takes_quick_and_main_answers_help(name, capsys):
    """``parser()`` accepts ``--quick``; ``main(["--help"])`` prints that parser's help and exits 0
    before it measures anything (so ``main`` parses with ``parser()``, first)."""
    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "parser", None)), f"bench/{name}.py exposes no parser()"
    assert module.parser().parse_args(["--quick"]).quick is True
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and out == module.parser().format_help()


def test_p5_plants_states_its_selection_accepts(tmp_path):
    """P5's synthetic states are today's format: both selectors skip the torn newest and choose the
    next, reading one manifest on the lazy path (planted states read as corrupt are the bench's bug)."""
    from bench import p5_selection as p5

    run = str(tmp_path / "run")
    p5.plant(run, 4, torn_newest=1)
    for select in (p5.full_discover, p5.lazy_newest_first):
        decision, _ = select(RunStorage(run))
        assert decision.state == f"{3 * p5.SAVE_EVERY:012d}", select.__name__
    counted = p5.counting_storage(run)
    p5.lazy_newest_first(counted)
    assert isinstance(counted.backend, p5.CountingBackend) and counted.backend.counts["manifests"] == 1


def _quick_marks(name: str) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.long, pytest.mark.slow, pytest.mark.timeout(QUICK_TIMEOUT_S + 60)]
    if any(m in _source(name) for m in RAY_MARKERS):
        marks.append(pytest.mark.ray)  # make test-all runs these one after another with the other Ray tests
    return marks


@pytest.mark.parametrize("name", [pytest.param(n, marks=_quick_marks(n)) for n in BENCHES])
def test_quick_run_exits_0_and_prints_goal_lines(name):
    """``python -m bench.<name> --quick`` from the repository root: exit 0, at least one goal line,
    and every line that starts as a goal line well-formed."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--quick"],
        cwd=ROOT,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT_S,
    )
    tail = f"\n--- stdout (end):\n{proc.stdout[-4000:]}\n--- stderr (end):\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"bench.{name} --quick exited {proc.returncode}{tail}"
    claimed = [line for line in proc.stdout.splitlines() if line.startswith("goal ")]
    assert claimed, f"bench.{name} --quick printed no goal line{tail}"
    malformed = [line for line in claimed if not GOAL.match(line)]
    assert not malformed, f"bench.{name} --quick printed malformed goal lines: {malformed}"


def _syncpoint_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted syncpoint name it stands for, from every import in the module (a
    function's own imports included: benches import lazily)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("syncpoint"):
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("syncpoint") and a.asname:
                    names[a.asname] = a.name
    return names


def _resolve(dotted: str) -> object:
    """The module or attribute a dotted syncpoint name names (AttributeError/ImportError if none)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", _modules())
def test_every_syncpoint_name_a_bench_uses_exists(name):
    """What a bench reaches into syncpoint for (``launch._child``, ``module.function``) still exists: a
    rename in the product broke P10's quick run, inside a function only that run calls, and only
    ``make test-all`` noticed. Checked from the source, without running the bench."""
    tree = ast.parse(_source(name))
    names = _syncpoint_names(tree)
    missing = []
    for dotted in names.values():
        try:
            _resolve(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            target = names[node.value.id]
            try:
                base = _resolve(target)
            except (ImportError, AttributeError):
                continue  # reported above
            if inspect.ismodule(base) and not hasattr(base, node.attr):
                try:
                    importlib.import_module(f"{target}.{node.attr}")
                except ImportError:
                    missing.append(f"{target}.{node.attr} (bench/{name}.py line {node.lineno})")
    assert not missing, f"bench/{name}.py uses names syncpoint no longer has: {sorted(set(missing))}"
