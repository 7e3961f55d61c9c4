"""mkdocs hook: serve every ``bench/results/*.md`` as the page ``results/<name>.md``.

The measurements live beside the benchmarks that produce them (each file names its command, date
and machine); the site shows them as they are, without a copy under ``docs/`` to keep in sync.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def on_files(files: Files, config: Any) -> Files:
    for path in sorted(RESULTS.glob("*.md")):
        files.append(
            File(
                f"results/{path.name}",
                src_dir=str(RESULTS.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
