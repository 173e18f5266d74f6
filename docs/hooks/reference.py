"""The Reference pages, generated from the code each time the site is built (an MkDocs hook).

Nothing here is a copied list: the HTTP API comes from the document `/openapi.json` serves, the catalog's fields from
its pydantic models, the configuration from `contract.settings.Settings` and its `from_env`, the CLI from the typer
app, the metrics from the API's and the worker's Prometheus objects, the BigQuery page from the schema files and the
view SQL, the outcomes from `contract/outcomes.py`. A field added in the code appears here without a page edited.
The plots `make bench` and `make capacity` draw are copied into the site from `bench/results/` (never into docs/).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The pages this hook writes, under docs/reference/ in the site (the nav names them).
REFERENCE_PAGES = ("http-api.md", "catalog.md", "configuration.md", "cli.md", "metrics.md", "bigquery.md", "errors.md")
# The benchmark and capacity plots (files in the tree, drawn by `make bench` / `make capacity`), as the site serves them.
PLOTS_DIR = ROOT / "bench" / "results"
PLOTS_URI = "assets/plots"
# Pictures of the tree the pages show, served by the site under these names.
PICTURES = {"assets/playground.png": ROOT / "api_server" / "playground" / "screenshot.png"}
# Where a process reads a variable straight from the environment, outside the settings object.
ENVIRONMENT_READERS = ("api_server", "model_worker", "contract", "emulators", "maas_client/src")
ENVIRONMENT_READ = re.compile(
    r"""(?:os\.environ(?:\.get)?\(|os\.environ\[|os\.getenv\(|\benv(?:iron)?\.get\(|\benv(?:iron)?\[)\s*["']([A-Z][A-Z0-9_]*)["']"""
)
GENERATED_NOTE = '!!! note "Generated"\n    This page is generated from {source} when the site is built; edit the code, not this page.\n\n'


def cell(text: object) -> str:
    """One Markdown table cell: no line breaks, no stray pipes."""
    return " ".join(str(text).split()).replace("|", "\\|")


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def field_comments(cls: type, covers_following: bool = False) -> dict[str, str]:
    """The `# ...` lines right above each field of a class body: how this codebase documents a field. A short first
    line without a full stop over more comment lines is a section's title (`# Worker`), not the field's. With
    `covers_following`, a comment also describes the fields right after it that have none of their own (a group:
    `cache_ttl_seconds` and `cache_max_entry_bytes`), as the settings object writes them."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    last = ""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # a class made at run time (pydantic's create_model) has no source to read
        return comments
    for line in textwrap.dedent(source).splitlines()[1:]:
        stripped = line.strip()
        if not stripped or not line.startswith("    ") or line.startswith("     "):
            if not line.startswith("     "):
                pending, last = [], ""
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"(\w+)\s*:", stripped)
        if match:
            if len(pending) > 1 and len(pending[0]) < 40 and not pending[0].endswith((".", ")", ";", ":")):
                pending = pending[1:]
            own = " ".join(pending)
            comments[match.group(1)] = own or (last if covers_following else "")
            last = comments[match.group(1)]
        else:
            last = ""
        pending = []
    return comments


def type_name(annotation: object) -> str:
    """`int`, `str | None`, `Literal['step', 'request']`, `dict[str, ModelSpec]`: what a reader writes there."""
    if isinstance(annotation, str):
        text = annotation
    elif isinstance(annotation, type) and not typing.get_args(annotation):
        text = annotation.__name__
    else:
        text = repr(annotation)
    text = re.sub(r"\b(?:typing|contract\.[\w.]+|collections\.abc|pydantic\.[\w.]+)\.", "", text)
    return re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text).replace("NoneType", "None")


# --- configuration -------------------------------------------------------------------------------------------------


def _environment_names(node: ast.AST) -> list[str]:
    """The MAAS_ names a piece of from_env reads (not those inside an error message's f-string)."""
    names: list[str] = []

    def visit(child: ast.AST) -> None:
        if isinstance(child, ast.JoinedStr):
            for value in child.values:
                if isinstance(value, ast.FormattedValue):
                    visit(value.value)
            return
        is_text = isinstance(child, ast.Constant) and isinstance(child.value, str)
        if is_text and re.fullmatch(r"MAAS_[A-Z0-9_]+", child.value) and child.value not in names:
            names.append(child.value)
        for grandchild in ast.iter_child_nodes(child):
            visit(grandchild)

    visit(node)
    return names


def settings_variables(settings_cls: type) -> dict[str, list[str]]:
    """Field name -> the environment variables `from_env` reads for it, from its source (followed through the
    local names and the module's helper functions it calls)."""
    module = sys.modules[settings_cls.__module__]
    module_tree = ast.parse(inspect.getsource(module))
    helpers = {node.name: node for node in module_tree.body if isinstance(node, ast.FunctionDef)}
    from_env = ast.parse(textwrap.dedent(inspect.getsource(settings_cls.from_env))).body[0]
    local: dict[str, list[str]] = {}
    for statement in ast.walk(from_env):
        targets: list[str] = []
        if isinstance(statement, ast.Assign):
            targets = [t.id for t in statement.targets if isinstance(t, ast.Name)]
        elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            function = statement.value.func
            if isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name):
                targets = [function.value.id]  # digests.update(...)
        for target in targets:
            local.setdefault(target, []).extend(_environment_names(statement))
    [construction] = [
        node
        for node in ast.walk(from_env)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cls"
    ]
    variables: dict[str, list[str]] = {}
    claimed: set[str] = set()  # a variable is its first field's: `batch_inputs` also reads MAAS_DATASET, `dataset`'s
    for keyword in construction.keywords:
        names = _environment_names(keyword.value)
        for call in (n for n in ast.walk(keyword.value) if isinstance(n, ast.Call)):
            if isinstance(call.func, ast.Name) and call.func.id in helpers:
                names += [n for n in _environment_names(helpers[call.func.id]) if n not in names]
        if not names:
            for name in (n.id for n in ast.walk(keyword.value) if isinstance(n, ast.Name)):
                names += [n for n in local.get(name, []) if n not in names]
        variables[keyword.arg] = [name for name in names if name not in claimed] or names
        claimed.update(names)
    return variables


def environment_reads(roots: Iterable[str] = ENVIRONMENT_READERS, skip: Iterable[Path] = ()) -> dict[str, list[str]]:
    """Variables read straight from the environment, outside the settings object: name -> the files reading it."""
    skipped = {path.resolve() for path in skip}
    reads: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            if path.resolve() in skipped:
                continue
            for name in ENVIRONMENT_READ.findall(path.read_text()):
                if name.startswith("MAAS_") or name in ("PORT", "PROMETHEUS_MULTIPROC_DIR"):
                    relative = str(path.relative_to(ROOT))
                    if relative not in reads.setdefault(name, []):
                        reads[name].append(relative)
    return dict(sorted(reads.items()))


def configuration_page(settings_cls: type | None = None, extra_reads: dict[str, list[str]] | None = None) -> str:
    if settings_cls is None:
        from contract.settings import Settings

        settings_cls = Settings
    comments = field_comments(settings_cls, covers_following=True)
    variables = settings_variables(settings_cls)
    rows = []
    for field in dataclasses.fields(settings_cls):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        shown = "—" if default in ("", None) or default == () or default == {} or default == frozenset() else default
        names = variables.get(field.name, [])
        rows.append(
            (
                ", ".join(f"`{name}`" for name in names) or "—",
                f"`{field.name}`",
                type_name(field.type),
                f"`{shown}`" if shown != "—" else shown,
                comments.get(field.name, ""),
            )
        )
    source = Path(inspect.getsourcefile(settings_cls)).resolve()
    reads = environment_reads(skip=[source]) if extra_reads is None else extra_reads
    settings_names = {name for names in variables.values() for name in names}
    outside = {name: files for name, files in reads.items() if name not in settings_names}
    return (
        "# Configuration\n\n"
        + GENERATED_NOTE.format(source="`contract/settings.py` (`Settings` and `Settings.from_env`)")
        + "Everything the API and the worker configure comes from environment variables, read once into "
        "`contract.settings.Settings`: the variable, the field it sets, its type and default, and the comment the "
        "code gives it. A default shown as — is unset or derived (e.g. the buckets from the project).\n\n"
        + table(("variable", "field", "type", "default", "what it is"), rows)
        + "\n## Read by one process\n\n"
        "Variables a process reads straight from the environment rather than through the settings object (gunicorn's "
        "settings, the local stack, the SDK and the `maas` command line):\n\n"
        + table(
            ("variable", "read in"), ((f"`{n}`", ", ".join(f"`{f}`" for f in files)) for n, files in outside.items())
        )
    )


# --- catalog -------------------------------------------------------------------------------------------------------


def _nested_models(annotation: object) -> list[type]:
    from pydantic import BaseModel

    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in typing.get_args(annotation) for model in _nested_models(argument)]


def pydantic_models(roots: Iterable[type]) -> list[type]:
    """The roots and every pydantic model their fields hold, each once, in the order met."""
    seen: list[type] = []
    queue = list(roots)
    while queue:
        model = queue.pop(0)
        if model in seen:
            continue
        seen.append(model)
        for info in model.model_fields.values():
            queue += [m for m in _nested_models(info.annotation) if m not in seen]
    return seen


def model_section(model: type, level: str = "##") -> str:
    from pydantic_core import PydanticUndefined

    comments = field_comments(model)
    rows = []
    for name, info in model.model_fields.items():
        if info.is_required():
            default = "required"
        elif info.default_factory is not None:
            default = f"`{info.default_factory()}`"
        else:
            default = f"`{info.default}`" if info.default is not PydanticUndefined else ""
        rows.append(
            (f"`{info.alias or name}`", type_name(info.annotation), default, info.description or comments.get(name, ""))
        )
    doc = inspect.getdoc(model)
    own_doc = doc if doc and model.__doc__ else ""
    return (
        f"{level} {model.__name__}\n\n"
        + (f"{own_doc}\n\n" if own_doc else "")
        + table(("field", "type", "default", "what it is"), rows)
    )


def catalog_page(roots: Iterable[type] | None = None) -> str:
    if roots is None:
        from contract.catalog import ModelCatalog

        roots = (ModelCatalog,)
    sections = [model_section(model) for model in pydantic_models(roots)]
    return (
        "# Catalog fields\n\n"
        + GENERATED_NOTE.format(
            source="the catalog's pydantic models (`contract/catalog.py`, `contract/model_spec.py`)"
        )
        + "`contract/models.yaml` is read into these models (unknown fields are refused); the "
        "[catalog guide](../guides/catalog.md) says how to use them. A model entry is a `ModelSpec`.\n\n"
        + "\n".join(sections)
    )


# --- HTTP API ------------------------------------------------------------------------------------------------------


def openapi() -> dict:
    """The document `/openapi.json` serves, made from the routes as the unit tests make it (no stack)."""
    from flask import Flask

    from api_server.process.app import BLUEPRINTS, ModelNameConverter
    from api_server.process.openapi import openapi_document
    from contract.catalog import load_catalog

    catalog = load_catalog(None, None)
    app = Flask("maas-docs")
    app.url_map.converters["model"] = ModelNameConverter
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
    with app.app_context():
        return openapi_document([*catalog.names(), *catalog.flows])


def _schema_type(schema: dict | bool) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(_schema_type(s) for s in schema.get("anyOf") or schema["oneOf"])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    if schema.get("type") == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if schema.get("type") == "object" and "additionalProperties" in schema:
        return f"object of {_schema_type(schema['additionalProperties'] or {})}"
    return str(schema.get("type", "any"))


def operation_anchor(method: str, path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")


def http_api_page(document: dict | None = None) -> str:
    document = document or openapi()
    out = [
        "# HTTP API\n\n",
        GENERATED_NOTE.format(source="the API's OpenAPI document (`api_server/process/openapi.py`, the routes)"),
        f"{document['info'].get('description', '')}\n\n",
        "The running API serves the same document at `/openapi.json` and renders it at `/docs`. Every operation but "
        "the health checks and the documents takes `Authorization: Bearer <key>`.\n\n",
    ]
    rows = []
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            label = f"{method.upper()} {path}"
            rows.append((f"[`{label}`](#{operation_anchor(method, path)})", operation.get("summary", "")))
    out.append(table(("operation", "what it does"), rows))
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            out.append(f"\n## `{method.upper()} {path}` {{#{operation_anchor(method, path)}}}\n\n")
            out.append(f"{operation.get('summary', '')}\n\n")
            if operation.get("description"):
                out.append(f"{operation['description']}\n\n")
            schemes = operation.get("security", document.get("security", []))  # the document's unless it says
            security = [name for scheme in schemes for name in scheme]
            out.append(f"Key: {', '.join(f'`{s}`' for s in security) or 'none (public)'}.\n\n")
            if operation.get("parameters"):
                out.append(
                    table(
                        ("parameter", "in", "type", "required", "description"),
                        (
                            (
                                f"`{p['name']}`",
                                p["in"],
                                _schema_type(p.get("schema", {})),
                                "yes" if p.get("required") else "",
                                p.get("description", ""),
                            )
                            for p in operation["parameters"]
                        ),
                    )  # fmt: skip
                    + "\n"
                )
            body = operation.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                out.append(f"Body ({media}): {_schema_type(content.get('schema', {}))}\n\n")
            out.append(
                table(
                    ("status", "description", "body", "headers"),
                    (
                        (
                            status,
                            response.get("description", ""),
                            ", ".join(
                                f"{m}: {_schema_type(c.get('schema', {}))}"
                                for m, c in response.get("content", {}).items()
                            ),
                            ", ".join(f"`{h}`" for h in response.get("headers", {})),
                        )
                        for status, response in operation["responses"].items()
                    ),
                )  # fmt: skip
            )
    out.append("\n## Schemas\n")
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        out.append(f"\n### {name} {{#{name.lower()}}}\n\n")
        if schema.get("description"):
            out.append(f"{schema['description']}\n\n")
        properties = schema.get("properties")
        if properties:
            required = set(schema.get("required", []))
            out.append(
                table(
                    ("field", "type", "required", "description"),
                    (
                        (
                            f"`{field}`",
                            _schema_type(spec),
                            "yes" if field in required else "",
                            spec.get("description", ""),
                        )
                        for field, spec in properties.items()
                    ),
                )
            )
        else:
            out.append(f"{_schema_type(schema)}\n")
    return "".join(out)


# --- CLI -----------------------------------------------------------------------------------------------------------


def cli_page(app=None) -> str:
    import typer

    if app is None:
        from maas_client.cli import app
    root = typer.main.get_command(app)  # typer's own click: groups and params read by duck type
    out = [
        "# Command line: `maas`\n\n",
        GENERATED_NOTE.format(source="the typer app (`maas_client/src/maas_client/cli.py`)"),
        f"{root.help or ''}\n\n",
    ]

    def options(command) -> None:
        rows = []
        for param in command.params:
            if param.param_type_name == "argument":
                rows.append(
                    (f"`{param.name.upper()}`", (param.help or "") + (" (optional)" if not param.required else ""), "")
                )
            else:
                shown = param.default not in (None, False, ()) and not callable(param.default)
                rows.append(
                    (", ".join(f"`{o}`" for o in param.opts), param.help or "", f"`{param.default}`" if shown else "")
                )
        if rows:
            out.append(table(("name", "help", "default"), rows) + "\n")

    def walk(command, words: list[str]) -> None:
        if hasattr(command, "list_commands"):
            context = command.context_class(command)
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                if hasattr(sub, "list_commands"):
                    out.append(f"## `maas {' '.join([*words, name])}`\n\n{inspect.cleandoc(sub.help or '')}\n\n")
                    walk(sub, [*words, name])
                else:
                    out.append(f"### `maas {' '.join([*words, name])}`\n\n{inspect.cleandoc(sub.help or '')}\n\n")
                    options(sub)

    out.append("## Global options\n\n")
    options(root)
    walk(root, [])
    return "".join(out)


# --- metrics -------------------------------------------------------------------------------------------------------


def metric_rows(objects: Iterable[object]) -> list[tuple[str, str, str, str]]:
    from prometheus_client.metrics import MetricWrapperBase

    rows = []
    for metric in objects:
        if isinstance(metric, MetricWrapperBase):
            name = metric._name + ("_total" if metric._type == "counter" else "")
            labels = ", ".join(f"`{label}`" for label in metric._labelnames)
            rows.append((f"`{name}`", metric._type, labels, metric._documentation))
    return rows


def metrics_page() -> str:
    from api_server.core import metrics as api_metrics
    from model_worker.serving import metrics as worker_metrics

    worker = worker_metrics.WorkerMetrics()
    collectors = [
        (name, obj)
        for name, obj in vars(worker_metrics).items()
        if inspect.isclass(obj) and hasattr(obj, "collect") and obj.__module__ == worker_metrics.__name__
    ]
    collected = [f"`{name}` ({inspect.getdoc(obj).splitlines()[0]})" for name, obj in collectors]
    return (
        "# Metrics\n\n"
        + GENERATED_NOTE.format(source="`api_server/core/metrics.py` and `model_worker/serving/metrics.py`")
        + "## The API (`GET /metrics`)\n\n"
        + table(("metric", "type", "labels", "what it counts"), metric_rows(vars(api_metrics).values()))
        + "\n## A worker (`/metrics` on `MAAS_WORKER_HEALTH_PORT`)\n\n"
        + table(("metric", "type", "labels", "what it counts"), metric_rows(vars(worker).values()))
        + ("\nComputed when scraped: " + "; ".join(collected) + ".\n" if collected else "")
    )


# --- BigQuery ------------------------------------------------------------------------------------------------------


def _schema_table(path: Path) -> str:
    fields = json.loads(path.read_text())
    return table(
        ("column", "type", "mode", "description"),
        ((f"`{f['name']}`", f["type"], f.get("mode", "NULLABLE"), f.get("description", "")) for f in fields),
    )


def bigquery_page(sql_dir: Path = ROOT / "infra" / "sql") -> str:
    out = [
        "# BigQuery table and views\n\n",
        GENERATED_NOTE.format(source="`contract/*_schema.json` and `infra/sql/*.sql`"),
        "## `inference_log`\n\nOne row per request, whatever its outcome (`contract/inference_log_schema.json`, "
        "also read by Terraform and by the API's row check).\n\n",
        _schema_table(ROOT / "contract" / "inference_log_schema.json"),
        "\n## `rollout_audit`\n\nEvery traffic split change and automatic rollback "
        "(`contract/rollout_audit_schema.json`).\n\n",
        _schema_table(ROOT / "contract" / "rollout_audit_schema.json"),
        "\n## Views\n\nEach view is a file of `infra/sql/`; `make analytics` prints them from the local stack "
        "([analytics guide](../guides/analytics.md)).\n",
    ]
    for path in sorted(sql_dir.glob("*.sql")):
        text = path.read_text()
        comment = " ".join(line[2:].strip() for line in text.splitlines() if line.startswith("--"))
        sql = "\n".join(line for line in text.splitlines() if not line.startswith("--")).strip()
        out.append(f'\n### `{path.stem}`\n\n{comment}\n\n??? info "SQL"\n\n    ```sql\n')
        out.append(textwrap.indent(sql, "    ") + "\n    ```\n")
    return "".join(out)


# --- outcomes and errors -------------------------------------------------------------------------------------------


def errors_page() -> str:
    from contract.outcomes import OUTCOMES

    return (
        "# Outcomes and error kinds\n\n"
        + GENERATED_NOTE.format(source="`contract/outcomes.py`")
        + "Every outcome of a request has one name, one HTTP status (a synchronous predict's), one log `status` and "
        "`error_kind`, and one job state; the API, the inference log and the views all read this table. A worker's "
        "own error kind (e.g. `bad_input`, `inference_failed`, `malformed`) wins over the outcome's on the row.\n\n"
        'Every error body is `{"error": {"code", "message", "field"?, "request_id"?}}` '
        "([ErrorResponse](http-api.md#errorresponse)).\n\n"
        + table(
            ("outcome", "HTTP (sync)", "log status", "error kind", "job state"),
            (
                (
                    f"`{outcome.value}`",
                    spec.http_status,
                    f"`{spec.log_status}`",
                    f"`{spec.error_kind}`" if spec.error_kind else "–",
                    f"`{spec.job_state}`" if spec.job_state else "–",
                )
                for outcome, spec in OUTCOMES.items()
            ),
        )  # fmt: skip
    )


GENERATORS: dict[str, Callable[[], str]] = {
    "http-api.md": http_api_page,
    "catalog.md": catalog_page,
    "configuration.md": configuration_page,
    "cli.md": cli_page,
    "metrics.md": metrics_page,
    "bigquery.md": bigquery_page,
    "errors.md": errors_page,
}


def reference_pages() -> dict[str, str]:
    """Every Reference page by its path under docs/ (a generator that fails fails the build)."""
    if str(ROOT) not in sys.path:  # MkDocs loads a hook with its own folder on the path, then takes it off again
        sys.path.insert(0, str(ROOT))
    return {f"reference/{name}": GENERATORS[name]() for name in REFERENCE_PAGES}


# --- the MkDocs hooks ----------------------------------------------------------------------------------------------


def on_files(files, config):
    """Adds the generated Reference pages and the plots to the site's files (before the nav is built)."""
    from mkdocs.structure.files import File

    for uri, content in reference_pages().items():
        files.append(File.generated(config, uri, content=content))
    pictures = {**PICTURES, **{f"{PLOTS_URI}/{plot.name}": plot for plot in sorted(PLOTS_DIR.glob("*.png"))}}
    for uri, path in pictures.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
