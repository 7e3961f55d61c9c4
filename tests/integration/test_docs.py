"""The documentation site: the generated job spec reference matches the models, the sections the
command tests run exist, the README stays a short card, every benchmark result says how it was
taken, and `mkdocs build --strict` (no broken links, anchors or API references) passes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.helpers import ROOT
from tests.readme import SECTIONS, bash_blocks, commands


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_spec_reference", ROOT / "docs" / "gen_spec_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_spec_reference_is_the_one_the_models_generate():
    gen = _generator()
    page = gen.PAGE.read_text()
    assert gen.page_with(gen.render(), page) == page, (
        "docs/reference/spec.md and policies/contracts/spec/ disagree: run python docs/gen_spec_reference.py"
    )


def _module_map() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_module_map", ROOT / "docs" / "gen_module_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_design_page_maps_every_production_module_by_its_own_docstring():
    gen = _module_map()
    page = gen.DESIGN.read_text()
    assert gen.rewritten(page) == page, "docs/design.md's module map is stale: run python docs/gen_module_map.py"
    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", page, re.MULTILINE))
    assert listed == {str(p.relative_to(ROOT)) for p in gen.modules()} and len(listed) > 100
    assert "(no docstring)" not in page, "every production module says what it is for in its first docstring line"


def test_the_spec_reference_names_every_field_with_a_description():
    from syncpoint.policies.contracts.spec import JobSpec

    text = _generator().render()
    rows = re.findall(r"^\| `([^`]+)` \| .* \| (.*) \|$", text, re.MULTILINE)
    assert {name for name, _ in rows} >= {
        "name",
        "train.lr",
        "checkpoint.async",
        "scaling.num_workers.min",
        "faults[].phase",
        "train.scheduler.type",
    }
    assert [name for name, desc in rows if not desc.strip()] == [], "a field without a description"
    assert len([n for n, _ in rows if "." not in n]) == len(JobSpec.model_fields)


def test_every_section_the_command_tests_run_is_there_with_its_commands():
    for section, page in SECTIONS.items():
        blocks = bash_blocks(section, page)
        assert blocks and all(commands(b) for b in blocks), f"{page}: {section!r} has no ```bash block"
    assert "make example" in commands(bash_blocks("## Quick start")[0])
    assert "make test" in commands(bash_blocks("## Quick start")[0])  # the test command CI's .ci/run calls
    assert [b for b in bash_blocks("## Quick start") if "syncpoint states runs/tiny-lm" in b]
    assert commands(bash_blocks("# Deploy with `ray job submit`")[0])[-1] == "ray stop"


def test_the_getting_started_pages_commands_are_the_readmes_that_the_quick_start_test_runs():
    """docs/getting-started.md repeats the README's quick start for the site: its ```bash blocks must be
    exactly the README's (tests/ray/test_first_hour.py runs those as written), so neither drifts."""
    readme = [commands(b) for b in bash_blocks("## Quick start")]
    page = "docs/getting-started.md"
    site = [commands(b) for b in bash_blocks("## Quick start", page) + bash_blocks("## What the run left behind", page)]
    assert site and all(block in readme for block in site), (site, readme)


def test_the_readme_is_a_short_card():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_benchmark_result_says_how_it_was_taken_and_is_on_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    results = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert results
    for path in results:
        head = path.read_text()[:1500]
        for what in ("ommand", "Date", "Machine"):
            assert what in head, f"{path.name} does not say its {what.lower()}"
        assert f"results/{path.name}" in nav, f"{path.name} is not in mkdocs.yml's nav"
        assert f"(results/{path.name})" in (ROOT / "docs" / "benchmarks.md").read_text(), (
            f"docs/benchmarks.md does not link {path.name}"
        )


def test_the_site_builds_strictly(tmp_path: Path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "syncpoint.workers.task.Task" in api and "syncpoint.policies.contracts.spec.JobSpec" in api
