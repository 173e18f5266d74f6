"""The documentation's examples, run against the local stack as a reader would paste them.

The convention (docs/contributing/tests.md): a fenced ```bash or ```python block on a page is an example and is run
here, unless the line before it is `<!-- example: not run (why) -->`. A ```text block right after an example is what
it prints, compared with its standard output line by line; after `<!-- output: abridged -->` each shown line must
match a printed line, in order, with `...` standing for any text. The examples' address and key are the local
stack's (`http://127.0.0.1:8080`, `local-dev-key`); here they are the test stack's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TEST_API_KEYS
from tests.docs_site import ROOT, pages

pytestmark = pytest.mark.stack

SHELL = ("bash", "sh", "shell")
EXAMPLE_LANGUAGES = (*SHELL, "python")
BLOCK = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!-- example: not run \((.+?)\) -->\s*$")
ABRIDGED = "<!-- output: abridged -->"
LOCAL_URL, LOCAL_KEY = "http://127.0.0.1:8080", "local-dev-key"
# A reader's example takes seconds on the tiny pipelines; a hung one ends here.
EXAMPLE_TIMEOUT_SECONDS = 180


@dataclass
class Example:
    page: Path
    line: int
    language: str
    code: str
    not_run: str | None  # the reason, when the page marks it
    shown: str | None  # the output the page shows after it
    abridged: bool

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples_of(page: Path) -> list[Example]:
    text = page.read_text()
    blocks = list(BLOCK.finditer(text))
    found = []
    for index, block in enumerate(blocks):
        if block.group(1) not in EXAMPLE_LANGUAGES:
            continue
        before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marked = NOT_RUN.search(before)
        shown, abridged = None, False
        if index + 1 < len(blocks) and blocks[index + 1].group(1) == "text":
            between = text[block.end() : blocks[index + 1].start()].strip()
            if between in ("", ABRIDGED):
                shown, abridged = blocks[index + 1].group(2), between == ABRIDGED
        found.append(
            Example(page, text[: block.start()].count("\n") + 1, block.group(1), block.group(2),
                    marked.group(1) if marked else None, shown, abridged)
        )  # fmt: skip
    return found


EXAMPLES = [example for page in pages() for example in examples_of(page)]
RUN = [example for example in EXAMPLES if example.not_run is None]


def output_matches(shown: str, printed: str, abridged: bool) -> bool:
    shown_lines = [line.rstrip() for line in shown.strip("\n").splitlines()]
    printed_lines = [line.rstrip() for line in printed.strip("\n").splitlines()]
    if not abridged:
        return shown_lines == printed_lines
    remaining = iter(printed_lines)
    for line in shown_lines:
        pattern = re.compile(".*".join(re.escape(part) for part in line.split("...")) + "$")
        if not any(pattern.match(printed) for printed in remaining):
            return False
    return True


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A reader's folder: the repository as from its root (linked: the Makefile, the scripts, the virtualenv), so
    the images and the `out/` folders the examples write land here, not in the tree."""
    folder = tmp_path_factory.mktemp("reader")
    for entry in ROOT.iterdir():
        if entry.name != ".git" and not entry.name.startswith(".stack"):
            (folder / entry.name).symlink_to(entry)
    return folder


def run(example: Example, stack, workdir: Path) -> subprocess.CompletedProcess:
    code = example.code.replace(LOCAL_URL, stack.api_url).replace(LOCAL_KEY, TEST_API_KEYS[0])
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "MAAS_URL": stack.api_url,
        "MAAS_API_KEY": TEST_API_KEYS[0],
        "MAAS_STACK_DIR": str(stack.stack_dir),
        "COLUMNS": "200",
    }
    command = (
        ["bash", "-e", "-o", "pipefail", "-c", code] if example.language in SHELL else [sys.executable, "-c", code]
    )
    return subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_SECONDS
    )


@pytest.mark.parametrize("example", RUN, ids=lambda example: example.id)
def test_an_example_runs_against_the_local_stack_and_prints_what_its_page_shows(example, stack, workdir):
    result = run(example, stack, workdir)
    assert result.returncode == 0, f"{example.id} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    if example.shown is not None:
        assert output_matches(example.shown, result.stdout, example.abridged), (
            f"{example.id} printed:\n{result.stdout}\nits page shows:\n{example.shown}"
        )


def test_the_first_request_writes_the_image_the_readme_says_it_does(stack, workdir):
    [first] = [e for e in RUN if e.page.name == "first-requests.md" and "save_images.py lighthouse\n" in e.code]
    (workdir / "lighthouse.png").unlink(missing_ok=True)
    assert run(first, stack, workdir).returncode == 0
    assert (workdir / "lighthouse.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "lighthouse.png" in (ROOT / "README.md").read_text()


def test_the_examples_not_run_are_few_and_say_why():
    assert len(RUN) >= 5, "the first requests (curl, the SDK, the CLI) and the status are run"
    for example in EXAMPLES:
        assert example.not_run is None or len(example.not_run) > 10, example.id


def test_every_code_block_of_every_page_names_its_language():
    # An unlabelled block could hold a shell example that escapes this runner: every fence says what it holds.
    for page in pages():
        for block in BLOCK.finditer(page.read_text()):
            assert block.group(1), f"{page.relative_to(ROOT)}: a ``` block without a language"


def test_shown_output_is_compared_and_abridged_output_matched_in_order():
    assert output_matches("a\nb\n", "a\nb\n", abridged=False)
    assert not output_matches("a\nb\n", "a\nc\n", abridged=False)
    assert output_matches(
        "saved x.png (... bytes)\nrequest ...", "noise\nsaved x.png (12 bytes)\nrequest 1: 3 ms", True
    )
    assert not output_matches("request ...\nsaved x.png ...", "saved x.png (12 bytes)\nrequest 1: 3 ms", True)
