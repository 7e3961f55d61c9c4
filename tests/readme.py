"""The README's commands as a test runs them: its ```bash blocks, in a copy of the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def bash_blocks(section: str) -> list[str]:
    """The ```bash blocks of a README section (from its heading to the next heading of its level)."""
    start = README.index(section)
    level = section.split(" ", 1)[0]
    nxt = re.search(rf"^{level} ", README[start + len(section):], re.MULTILINE)
    text = README[start:start + len(section) + (nxt.start() if nxt else len(README))]
    return re.findall(r"```bash\n(.*?)```", text, re.DOTALL)


def commands(block: str) -> list[str]:
    """A block's commands, comments and blank lines left out."""
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.split("#")[0].strip()]


def copy_of_repository(dest: Path) -> None:
    """The tracked files (mtimes kept: make compares them), and ``.venv`` linking to this environment,
    so the README's commands run from the copy as from a checkout where `make venv` ran."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / ".venv").symlink_to(sys.prefix)


def venv_is_up_to_date(repo: Path) -> bool:
    """Whether `make` would leave ``.venv`` alone (else it would reinstall this shared environment)."""
    return subprocess.run(["make", "-q", ".venv/.installed"], cwd=repo, capture_output=True).returncode == 0
