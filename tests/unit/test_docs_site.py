"""The documentation site: it builds strictly (a broken link fails it), its Reference follows the code, and every file,
folder, module, make target and import a page names exists in the tree."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.docs_site import DOCS, ROOT, build_copy, build_site, pages

sys.path.insert(0, str(DOCS / "hooks"))
import reference  # noqa: E402  (docs/hooks/reference.py: the MkDocs hook that writes the Reference)

README = ROOT / "README.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it (strict), once for this module."""
    site_dir = tmp_path_factory.mktemp("site")
    result = build_site(site_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return site_dir


def test_the_site_builds_strictly_with_every_page_of_the_nav_and_the_generated_reference(site):
    for page in pages():
        built = site / page.relative_to(DOCS).with_suffix("") / "index.html"
        if page.name == "index.md":
            built = site / page.relative_to(DOCS).parent / "index.html"
        assert built.exists(), page
    for name in reference.REFERENCE_PAGES:
        assert (site / "reference" / Path(name).stem / "index.html").exists(), name
    assert list((site / reference.PLOTS_URI).glob("*.png")), "the benchmark plots are served with the site"


def test_a_broken_internal_link_fails_the_build(tmp_path):
    result = build_copy(tmp_path, "guides/catalog.md", "\nSee [a page that is not there](no-such-page.md).\n")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr


# --- the Reference is generated from the code ----------------------------------------------------------------------


def test_the_configuration_reference_lists_every_variable_the_settings_read():
    page = reference.configuration_page()
    source = (ROOT / "contract" / "settings.py").read_text()
    read = set(re.findall(r"""env(?:\.get\(|\[)\s*["'](MAAS_[A-Z0-9_]+)["']""", source))
    assert read, "the settings read no variable?"
    for name in read:
        assert f"`{name}`" in page, name
    from contract.settings import Settings

    for field in dataclasses.fields(Settings):
        assert f"`{field.name}`" in page, field.name


SETTINGS_WITH_A_NEW_FIELD = '''
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """A settings object as contract/settings.py writes one, with a field no page mentions."""

    project_id: str = "maas-local"
    # How many lighthouses a test may paint (a field added in the code).
    lighthouses: int = 3

    @classmethod
    def from_env(cls, environ=None):
        env = environ or {}
        return cls(project_id=env.get("MAAS_PROJECT_ID", "maas-local"), lighthouses=int(env.get("MAAS_LIGHTHOUSES", 3)))
'''


def test_a_settings_field_added_in_the_code_appears_in_the_configuration_reference(tmp_path):
    (tmp_path / "fixture_settings.py").write_text(textwrap.dedent(SETTINGS_WITH_A_NEW_FIELD))
    spec = importlib.util.spec_from_file_location("fixture_settings", tmp_path / "fixture_settings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fixture_settings"] = module
    spec.loader.exec_module(module)
    page = reference.configuration_page(module.Settings, extra_reads={})
    [row] = [line for line in page.splitlines() if "`lighthouses`" in line]
    assert "`MAAS_LIGHTHOUSES`" in row and "`3`" in row and "How many lighthouses a test may paint" in row


def test_a_catalog_field_added_in_the_code_appears_in_the_catalog_reference():
    from pydantic import BaseModel, Field

    from contract.model_spec import ModelSpec

    class Lighthouse(BaseModel):
        beam_degrees: int = Field(default=360, description="how far the beam turns")

    class ExtendedSpec(ModelSpec):
        lighthouse: Lighthouse | None = None

    page = reference.catalog_page((ExtendedSpec,))
    assert "## Lighthouse" in page and "`beam_degrees`" in page and "how far the beam turns" in page
    assert "`lighthouse`" in page
    for name in ModelSpec.model_fields:  # and every field the catalog already has
        assert f"`{ModelSpec.model_fields[name].alias or name}`" in page, name


def test_the_http_reference_lists_every_route_of_the_openapi_document():
    document = reference.openapi()
    page = reference.http_api_page(document)
    for path, operations in document["paths"].items():
        for method in operations:
            assert f"`{method.upper()} {path}`" in page
    # Each operation says which key it takes: the document's default unless the operation names its own.
    predict = page.split("## `POST /v1/models/{model}:predict`", 1)[1].split("\n## ", 1)[0]
    health = page.split("## `GET /healthz`", 1)[1].split("\n## ", 1)[0]
    assert "Key: `api_key`." in predict and "Key: none (public)." in health


def test_the_cli_metrics_bigquery_and_outcome_references_follow_their_sources():
    from contract.log_schema import log_schema_fields
    from contract.outcomes import Outcome

    cli = reference.cli_page()
    for command in ("maas predict", "maas jobs submit", "maas batches create", "maas usage"):
        assert f"`{command}`" in cli, command
    metrics = reference.metrics_page()
    for name in ("maas_api_requests_total", "maas_worker_requests_total", "maas_api_admission_decisions_total"):
        assert f"`{name}`" in metrics, name
    bigquery = reference.bigquery_page()
    for field in log_schema_fields():
        assert f"`{field['name']}`" in bigquery, field["name"]
    for view in (ROOT / "infra" / "sql").glob("*.sql"):
        assert f"`{view.stem}`" in bigquery, view.stem
    errors = reference.errors_page()
    for outcome in Outcome:
        assert f"`{outcome.value}`" in errors, outcome


# --- every name a page gives exists --------------------------------------------------------------------------------

TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
TOP_LEVEL = {path.split("/", 1)[0] for path in TRACKED if "/" in path}
FILE_NAMES = {Path(path).name for path in TRACKED}
CODE = [path for path in TRACKED if path.endswith(".py") and not path.startswith(("tests/", "docs/"))]
# Where the benchmarks, the GPU check and chaos write what they measured.
OUTPUT_FOLDERS = ("bench/results/", "chaos/results/")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"`([^`\n]+)`")
# A repository path: a top-level folder of the tree, then more of it (what a page's reader would open).
PATH = re.compile(r"(?<![\w./:@-])((?:[\w.-]+/)+[\w.*-]*)")
FILE = re.compile(r"(?<![\w./:@{-])([\w-]+\.(?:py|md|yaml|yml|json|sql|toml|sh|tf|txt|cfg))\b")
MODULE = re.compile(r"python3? -m ([\w.]+)")
MAKE = re.compile(r"(?<![\w-])make ((?:[A-Z_]+=\S+ )*)([a-z][\w-]*)")
IMPORT = re.compile(r"^\s*(?:from ([\w.]+) import|import ([\w.]+))", re.MULTILINE)
# Files the service writes at run time or a reader creates (not in the tree): named in prose, never to be opened there.
RUN_TIME = re.compile(
    r"^(?:\.stack|\.stack-\w+|\.gpu-bench|\.site|out|results|errors|images|inputs|adapters|batches|tmp)/|"
    r"(?:^|/)(?:results|errors)/part-|^chaos/results/runs/|lines\.jsonl$|day\.csv$|\{"
)


def code_of(text: str) -> list[str]:
    """The code a page shows: fenced blocks whole, and the inline spans of the prose around them."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return blocks + SPAN.findall(prose)


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", makefile, re.MULTILINE))


def module_exists(name: str) -> bool:
    parts = name.split(".")
    base = ROOT.joinpath(*parts)
    if (base.with_suffix(".py")).exists() or (base / "__init__.py").exists() or (base / "__main__.py").exists():
        return True
    try:
        return importlib.util.find_spec(name) is not None  # an installed one: the SDK, http.server...
    except ModuleNotFoundError:
        return False


def written_by_the_code(name: str) -> bool:
    """A file a command writes when it runs (a result, a manifest): the code that writes it names it in a string."""
    quoted = re.compile(rf"""["'/{{}}]{re.escape(Path(name).name)}["']""")
    return any(quoted.search((ROOT / path).read_text()) for path in CODE)


def path_exists(path: str) -> bool:
    path = path.split("::", 1)[0].rstrip("/.")
    if "*" in path:
        return any(ROOT.glob(path))
    if (ROOT / path).exists() or (path.startswith(OUTPUT_FOLDERS) and written_by_the_code(path)):
        return True
    # A place the tree keeps for what its commands write (.gitignore names it: infra/k8s/rendered/, .stack/).
    ignored = subprocess.run(["git", "check-ignore", path, f"{path}/"], cwd=ROOT, capture_output=True)
    return ignored.returncode == 0


def names_given(text: str) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {"path": set(), "file": set(), "module": set(), "make": set(), "import": set()}
    # A file named in the prose too ("DESIGN.md's numbers"), not only in code.
    prose = SPAN.sub(" ", FENCE.sub(" ", re.sub(r"\]\([^)]*\)|<!--.*?-->|https?://\S+", " ", text)))
    names["file"].update(name for name in FILE.findall(prose) if not RUN_TIME.search(name))
    for code in code_of(text):
        for match in PATH.findall(code):
            if match.split("/", 1)[0] in TOP_LEVEL and not RUN_TIME.search(match):
                names["path"].add(match)
        for match in FILE.findall(code):
            if not RUN_TIME.search(match):
                names["file"].add(match)
        names["module"].update(MODULE.findall(code))
        names["make"].update(target for _, target in MAKE.findall(code))
        names["import"].update(
            a or b for a, b in IMPORT.findall(code) if "\n" in code or code.startswith(("from", "import"))
        )
    return names


@pytest.mark.parametrize("page", [README, *pages()], ids=lambda page: str(page.relative_to(ROOT)))
def test_every_file_module_make_target_and_import_a_page_names_exists(page):
    targets = make_targets()
    missing = []
    names = names_given(page.read_text())
    missing += [f"path {p}" for p in sorted(names["path"]) if not path_exists(p)]
    missing += [f"file {f}" for f in sorted(names["file"]) if f not in FILE_NAMES and not written_by_the_code(f)]
    missing += [f"python -m {m}" for m in sorted(names["module"]) if not module_exists(m)]
    missing += [f"make {t}" for t in sorted(names["make"]) if t not in targets and not t.startswith("restart-")]
    missing += [f"import {i}" for i in sorted(names["import"]) if not module_exists(i)]
    assert not missing, f"{page.relative_to(ROOT)} names what the tree does not have: {missing}"


def test_the_names_check_finds_a_name_that_no_longer_exists():
    stale = (
        "The request path: `api_server/serving.py`, `log_spool.py`, `python -m api_server.records`, `make spool`; "
        "the numbers from DESIGN.md."
    )
    names = names_given(stale)
    assert not path_exists("api_server/serving.py") and "log_spool.py" not in FILE_NAMES
    assert path_exists("infra/k8s/rendered/") and not path_exists("infra/k8s/rendred/")
    assert not written_by_the_code("log_spool.py") and written_by_the_code("maas-manifest.json")
    assert names["path"] == {"api_server/serving.py"} and {"log_spool.py", "DESIGN.md"} <= names["file"]
    assert "DESIGN.md" not in FILE_NAMES and not written_by_the_code("DESIGN.md")
    assert names["module"] == {"api_server.records"} and not module_exists("api_server.records")
    assert names["make"] == {"spool"} and "spool" not in make_targets()


def test_the_local_stack_page_names_exactly_the_components_make_up_starts(tmp_path):
    from emulators.stack import StackConfig, components

    started = set(components(StackConfig(stack_dir=tmp_path)))
    with_fixtures = set(components(StackConfig(stack_dir=tmp_path, test_fixtures=True)))
    page = (DOCS / "getting-started" / "local-stack.md").read_text()
    [row] = [line for line in page.splitlines() if line.startswith("| `make restart")]
    named = {name for name in re.findall(r"`([\w-]+)`", row) if name not in ("make",)}
    assert started <= named, f"make up starts what the page does not name: {sorted(started - named)}"
    assert with_fixtures <= named, (
        f"the tests' stack starts what the page does not name: {sorted(with_fixtures - named)}"
    )
    stale = {name for name in named if name.startswith("worker-")} - with_fixtures
    assert not stale, f"the page names workers no stack starts: {sorted(stale)}"
