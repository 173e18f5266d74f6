"""Building the documentation site (mkdocs.yml) the way `make docs` does, for the tests that need the built pages.

`build_site` runs MkDocs with --strict into a folder of the test's; `build_copy` builds a copy of docs/ with one page
changed, with the repository's own hook (the Reference is still generated from this tree's code).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIG = ROOT / "mkdocs.yml"
# A strict build of the whole site takes a few seconds; a hung one ends here.
BUILD_TIMEOUT_SECONDS = 180


def pages() -> list[Path]:
    """Every Markdown page of the site as written in the tree (the Reference is generated, not among them)."""
    return sorted(path for path in DOCS.rglob("*.md") if "hooks" not in path.relative_to(DOCS).parts)


def build_site(site_dir: Path, config: Path = CONFIG) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config` into `site_dir`; the result, whether it passed or not."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site_dir),
        ],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_SECONDS,
    )


def build_copy(workdir: Path, page: str, append: str) -> subprocess.CompletedProcess:
    """Builds a copy of docs/ in `workdir` with `append` added to `page` (e.g. a broken link)."""
    docs = workdir / "docs"
    shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("hooks"))
    (docs / page).write_text((docs / page).read_text() + append)
    config = yaml.safe_load(CONFIG.read_text())
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(DOCS / "hooks" / "reference.py")]
    (workdir / "mkdocs.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    return build_site(workdir / "site", workdir / "mkdocs.yml")
