"""The documented commands as a test runs them: the ```bash blocks of a section of the README or of a
docs page, in a copy of the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

README = "README.md"
# The sections whose commands the tests run, and the page that holds each: tests/integration/test_docs.py checks
# that every one is still there, with a ```bash block.
SECTIONS = {
    "## Quick start": README,  # tests/ray/test_first_hour.py
    "# Deploy with `ray job submit`": "docs/deploy/ray.md",  # tests/ray/test_readme_commands.py
}


def section_text(section: str, page: str = README) -> str:
    """A section of a page, from its heading line to the next heading of its level or above."""
    text = (ROOT / page).read_text()
    m = re.search(rf"^{re.escape(section)}$", text, re.MULTILINE)
    if m is None:
        raise LookupError(f"{page} has no heading {section!r}")
    level = len(section.split(" ", 1)[0])
    nxt = re.search(rf"^#{{1,{level}}} ", text[m.end() :], re.MULTILINE)
    return text[m.start() : m.end() + (nxt.start() if nxt else len(text))]


def bash_blocks(section: str, page: str | None = None) -> list[str]:
    """The ```bash blocks of a section (``page``: the file that holds it, by default the one
    ``SECTIONS`` names, else the README)."""
    return re.findall(r"```bash\n(.*?)```", section_text(section, page or SECTIONS.get(section, README)), re.DOTALL)


def commands(block: str) -> list[str]:
    """A block's commands, comments and blank lines left out."""
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.split("#")[0].strip()]


def copy_of_repository(dest: Path) -> None:
    """The tracked files (mtimes kept: make compares them), and ``.venv`` linking to this environment,
    so the documented commands run from the copy as from a checkout where `make venv` ran."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / ".venv").symlink_to(sys.prefix)


def venv_is_up_to_date(repo: Path) -> bool:
    """Whether `make` would leave ``.venv`` alone (else it would reinstall this shared environment)."""
    return subprocess.run(["make", "-q", ".venv/.installed"], cwd=repo, capture_output=True).returncode == 0
