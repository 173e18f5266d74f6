"""Terraform declares every Google Cloud resource the code uses, with the code's names and settings.

The Google provider cannot be downloaded here, so `terraform validate/plan` cannot run. Instead the
configuration is parsed with python-hcl2 and cross-checked against the `contract` package (catalog,
naming, log schema), formatted with `terraform fmt`, and scanned with checkov.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import time
import typing
from functools import cache
from pathlib import Path

import hcl2
import pytest

from contract import naming
from contract.catalog import DEFAULT_CATALOG_PATH, load_catalog
from contract.model_spec import ModelSpec
from tests.infra.tool_runs import run_bounded_by_cpu

REPO_ROOT = Path(__file__).resolve().parents[2]
TERRAFORM_DIR = REPO_ROOT / "terraform"
EXAMPLE_TFVARS = TERRAFORM_DIR / "examples" / "production.tfvars"
CONTRACT_LOG_SCHEMA = Path(naming.__file__).with_name("inference_log_schema.json")
EXAMPLE_PROJECT = "example-project"
CATALOG = load_catalog()
# Every servable unit by its queue name: a model, or one version of a model with `versions`.
MODELS = [spec.queue for spec in CATALOG.units()]
# checkov needs about 4 s of CPU here: a limit on its CPU time, which the machine's load does not stretch.
CHECKOV_CPU_SECONDS = 60


# --- Reading the configuration -------------------------------------------------------------------


def _unquote(value: str) -> str:
    """python-hcl2 >= 7 keeps the quotes of string literals and block labels; older versions drop them."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return value


def _normalise(node):
    if isinstance(node, dict):
        return {_unquote(key): _normalise(value) for key, value in node.items() if not key.startswith("__")}
    if isinstance(node, list):
        return [_normalise(item) for item in node]
    if isinstance(node, str):
        return _unquote(node)
    return node


def _load(path: Path) -> dict:
    with path.open() as handle:
        return _normalise(hcl2.load(handle))


@cache
def configuration() -> dict[str, list]:
    merged: dict[str, list] = {}
    for path in sorted(TERRAFORM_DIR.glob("*.tf")):
        for key, blocks in _load(path).items():
            merged.setdefault(key, []).extend(blocks)
    return merged


def _labelled(kind: str) -> dict[str, dict[str, dict]]:
    """{type: {name: body}} for `resource` or `data` blocks."""
    found: dict[str, dict[str, dict]] = {}
    for block in configuration().get(kind, []):
        for type_, named in block.items():
            for name, body in named.items():
                found.setdefault(type_, {})[name] = body
    return found


def resource(type_: str, name: str) -> dict:
    declared = _labelled("resource").get(type_, {})
    assert name in declared, f"terraform/ declares no {type_}.{name}"
    return declared[name]


def resources_of_type(type_: str) -> dict[str, dict]:
    return _labelled("resource").get(type_, {})


@cache
def locals_() -> dict:
    merged: dict = {}
    for block in configuration().get("locals", []):
        merged.update(block)
    return merged


@cache
def variables() -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for block in configuration().get("variable", []):
        merged.update(block)
    return merged


def outputs() -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for block in configuration().get("output", []):
        merged.update(block)
    return merged


def block(body: dict, name: str) -> dict:
    """A nested block (python-hcl2 gives a list of one dict per occurrence)."""
    assert name in body, f"missing block {name!r}"
    value = body[name]
    return value[0] if isinstance(value, list) else value


def expression(value) -> str:
    """The Terraform expression of an attribute, without the `${...}` python-hcl2 wraps it in."""
    assert isinstance(value, str), f"expected an expression, got {value!r}"
    if value.startswith("${"):
        depth = 0
        for index, char in enumerate(value[1:], start=1):
            depth += char == "{"
            depth -= char == "}"
            if depth == 0:
                if index == len(value) - 1:
                    return value[2:-1]
                break
    return value


def render(template: str, substitutions: dict[str, str]) -> str:
    """Render a Terraform string template whose interpolations are all in `substitutions`."""

    def substitute(match: re.Match) -> str:
        assert match.group(1) in substitutions, f"cannot render ${{{match.group(1)}}} in {template!r}"
        return substitutions[match.group(1)]

    return re.sub(r"\$\{([^}]*)\}", substitute, template)


def per_model_name(local_name: str, model: str) -> str:
    """Render a `{ for model in keys(local.models) : model => "<template>" }` naming local."""
    expr = expression(locals_()[local_name])
    match = re.fullmatch(r'\{\s*for (\w+) in keys\(local\.models\)\s*:\s*\1 => "(.*)"\s*\}', expr, re.S)
    assert match, f"local.{local_name} is not a name per catalog model: {expr!r}"
    return render(match.group(2), {match.group(1): model})


def per_queue_name(local_name: str, model: str, priority: str) -> str:
    """Render a `{ for key, queue in local.request_queues : key => "<template>" }` naming local."""
    expr = expression(locals_()[local_name])
    match = re.fullmatch(r'\{\s*for (\w+), (\w+) in local\.request_queues\s*:\s*\1 => "(.*)"\s*\}', expr, re.S)
    assert match, f"local.{local_name} is not a name per request queue: {expr!r}"
    queue = match.group(2)
    suffix = locals_()["priority_suffixes"][priority]
    return render(
        match.group(3),
        {
            f"{queue}.model": model,
            f"local.priority_suffixes[{queue}.priority]": suffix,
        },
    )


def project_name(local_name: str) -> str:
    return render(locals_()[local_name], {"var.project_id": EXAMPLE_PROJECT})


def resolve_module_path(value: str) -> Path:
    return (TERRAFORM_DIR / render(value, {"path.module": "."})).resolve()


# --- Formatting and well-formedness ------------------------------------------------------------


def test_terraform_files_are_formatted():
    terraform = shutil.which("terraform")
    assert terraform, "terraform is not installed; it is needed for `terraform fmt -check`"
    result = run_bounded_by_cpu([terraform, "fmt", "-check", "-recursive", "-diff", str(TERRAFORM_DIR)], cpu_seconds=30)
    assert result.returncode == 0, f"terraform fmt would change:\n{result.stdout}{result.stderr}"


def test_every_variable_has_a_description_and_a_type():
    undocumented = [name for name, body in variables().items() if not body.get("description") or "type" not in body]
    assert not undocumented, f"variables without description or type: {undocumented}"


def test_every_reference_resolves_to_a_declaration():
    declared_resources = {(type_, name) for type_, named in _labelled("resource").items() for name in named}
    declared_data = {(type_, name) for type_, named in _labelled("data").items() for name in named}
    problems = []
    for path in sorted(TERRAFORM_DIR.glob("*.tf")):
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        problems += [f"{path.name}: var.{n}" for n in re.findall(r"\bvar\.(\w+)", code) if n not in variables()]
        problems += [f"{path.name}: local.{n}" for n in re.findall(r"\blocal\.(\w+)", code) if n not in locals_()]
        for type_, name in re.findall(r"(?<![\w.])(google_\w+)\.(\w+)", code):
            if (type_, name) not in declared_resources:
                problems.append(f"{path.name}: {type_}.{name}")
        for type_, name in re.findall(r"\bdata\.(google_\w+)\.(\w+)", code):
            if (type_, name) not in declared_data:
                problems.append(f"{path.name}: data.{type_}.{name}")
    assert not problems, f"references to undeclared things: {sorted(set(problems))}"


def test_resources_are_keyed_by_name_never_counted():
    counted = [f"{t}.{n}" for t, named in _labelled("resource").items() for n, body in named.items() if "count" in body]
    assert not counted, f"use for_each keyed by name instead of count: {counted}"


def test_example_sets_every_required_variable_and_only_declared_ones():
    example = _load(EXAMPLE_TFVARS)
    required = {name for name, body in variables().items() if "default" not in body}
    assert required <= set(example), f"examples/production.tfvars misses {sorted(required - set(example))}"
    assert set(example) <= set(variables()), f"undeclared variables set: {sorted(set(example) - set(variables()))}"


# --- The catalog drives the queues -------------------------------------------------------------


def test_catalog_is_read_from_the_file_the_code_reads():
    # models.yaml only: the local overlay's synthetic models must never get production queues.
    assert resolve_module_path(locals_()["catalog_path"]) == DEFAULT_CATALOG_PATH.resolve()
    assert expression(locals_()["catalog"]) == "yamldecode(file(local.catalog_path))"
    code = [
        line
        for path in TERRAFORM_DIR.glob("*.tf")
        for line in path.read_text().splitlines()
        if not line.lstrip().startswith("#")
    ]
    assert not [line for line in code if "models.local.yaml" in line]


def _catalog_fields_read() -> tuple[dict[str, str], str]:
    """{attribute: expression} of the per-model object local.models builds, and the loop's spec variable."""
    expr = expression(locals_()["models"])
    match = re.fullmatch(r"\{\s*for (\w+), (\w+) in local\.catalog_units\s*:\s*\1 => \{(.*)\}\s*\}", expr, re.S)
    assert match, f"local.models must build one object per catalog entry: {expr!r}"
    body = match.group(3)
    fields = dict(re.findall(r"(\w+)\s*=\s*(.+?)(?:\n|,\s*(?=\w+\s*=)|$)", body))
    return fields, match.group(2)


def test_terraform_reads_only_required_catalog_fields_without_a_fallback():
    # An optional catalog field (runner, worker_group, weights_path, ...) may be absent from a model:
    # yamldecode then has no such attribute, and reading it without try() fails the whole plan.
    fields, spec = _catalog_fields_read()
    assert fields, "local.models reads no catalog field"
    required = {name for name, field in ModelSpec.model_fields.items() if field.is_required()}
    unguarded = set()
    for value in fields.values():
        guarded = set(re.findall(rf"try\({spec}\.(\w+)", value))
        unguarded |= set(re.findall(rf"(?<![\w.]){spec}\.(\w+)", value)) - guarded
        assert guarded <= set(ModelSpec.model_fields), f"try() reads fields the catalog does not have: {guarded}"
    assert unguarded <= required, f"optional catalog fields read without try(): {sorted(unguarded - required)}"


def test_terraform_defaults_for_optional_catalog_fields_are_the_catalogs():
    fields, spec = _catalog_fields_read()
    assert fields["runner"] == f'try({spec}.runner, "{ModelSpec.model_fields["runner"].default}")'
    assert fields["weights_path"] == f'try({spec}.weights_path, "{ModelSpec.model_fields["weights_path"].default}")'
    # A model without a worker_group is its own deployment (ModelSpec.deployment).
    assert fields["worker_group"] == f"coalesce(try({spec}.worker_group, null), name)"


def test_terraform_priorities_are_the_codes():
    assert tuple(sorted(locals_()["priority_suffixes"])) == tuple(sorted(naming.PRIORITIES))
    queues = expression(locals_()["request_queues"])
    assert "setproduct(keys(local.models), keys(local.priority_suffixes))" in queues
    assert '"${pair[0]}/${pair[1]}"' in queues, "request queues must be keyed model/priority"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("priority", naming.PRIORITIES)
@pytest.mark.parametrize(
    ("local_name", "contract_name"),
    [
        ("request_topic_names", naming.request_topic),
        ("worker_subscription_names", naming.worker_subscription),
    ],
)
def test_per_queue_names_match_the_code(model, priority, local_name, contract_name):
    assert per_queue_name(local_name, model, priority) == contract_name(model, priority)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    ("local_name", "contract_name"),
    [
        ("dead_letter_topic_names", naming.dead_letter_topic),
        ("dead_letter_subscription_names", naming.dead_letter_subscription),
    ],
)
def test_per_model_names_match_the_code(model, local_name, contract_name):
    assert per_model_name(local_name, model) == contract_name(model)


def test_shared_names_match_the_code():
    assert locals_()["replies_topic_name"] == naming.REPLIES_TOPIC
    assert locals_()["bigquery_dataset"] == naming.DATASET
    assert locals_()["inference_log_table"] == naming.LOG_TABLE
    assert project_name("model_bucket_name") == naming.model_bucket(EXAMPLE_PROJECT)
    assert project_name("payload_bucket_name") == naming.payload_bucket(EXAMPLE_PROJECT)


def _is_per_catalog_model(body: dict) -> bool:
    return expression(body.get("for_each", "")) == "local.models"


def _is_per_request_queue(body: dict) -> bool:
    """One per catalog model and priority (local.request_queues, keyed model/priority)."""
    return expression(body.get("for_each", "")) == "local.request_queues"


def test_each_catalog_model_gets_a_request_topic_per_priority_and_one_dead_letter_topic():
    requests = resource("google_pubsub_topic", "requests")
    dead_letter = resource("google_pubsub_topic", "dead_letter")
    assert _is_per_request_queue(requests) and _is_per_catalog_model(dead_letter)
    assert expression(requests["name"]) == "local.request_topic_names[each.key]"
    assert expression(dead_letter["name"]) == "local.dead_letter_topic_names[each.key]"


def test_replies_topic_is_declared_once():
    replies = resource("google_pubsub_topic", "replies")
    assert "for_each" not in replies
    assert expression(replies["name"]) == "local.replies_topic_name"


def test_worker_subscription_settings_come_from_the_catalog():
    # Both priorities of a model share its ack deadline, delivery attempts and one dead-letter topic.
    workers = resource("google_pubsub_subscription", "workers")
    assert _is_per_request_queue(workers)
    assert expression(workers["name"]) == "local.worker_subscription_names[each.key]"
    assert expression(workers["topic"]) == "google_pubsub_topic.requests[each.key].id"
    assert expression(workers["ack_deadline_seconds"]) == "local.models[each.value.model].ack_deadline_seconds"
    dead_letter_policy = block(workers, "dead_letter_policy")
    assert expression(dead_letter_policy["dead_letter_topic"]) == "google_pubsub_topic.dead_letter[each.value.model].id"
    assert (
        expression(dead_letter_policy["max_delivery_attempts"])
        == "local.models[each.value.model].max_delivery_attempts"
    )
    # local.models holds catalog fields under their catalog names.
    fields, spec = _catalog_fields_read()
    for field in ("ack_deadline_seconds", "max_delivery_attempts"):
        assert field in ModelSpec.model_fields and fields[field] == f"{spec}.{field}"
    retry = block(workers, "retry_policy")
    assert retry.get("minimum_backoff") and retry.get("maximum_backoff")
    assert workers.get("message_retention_duration")
    assert block(workers, "expiration_policy")["ttl"] == "", "worker subscriptions must never expire"


@pytest.mark.parametrize("model", MODELS)
def test_catalog_queue_settings_are_valid_for_pubsub(model):
    spec = CATALOG.unit(model)
    assert 10 <= spec.ack_deadline_seconds <= 600
    assert 5 <= spec.max_delivery_attempts <= 100
    # Short, because workers extend leases: a crashed worker's request is redelivered in time.
    assert spec.ack_deadline_seconds <= spec.request_timeout_seconds / 3


def test_nothing_dead_lettered_is_lost():
    subscription = resource("google_pubsub_subscription", "dead_letter")
    assert _is_per_catalog_model(subscription)
    assert expression(subscription["name"]) == "local.dead_letter_subscription_names[each.key]"
    assert expression(subscription["topic"]) == "google_pubsub_topic.dead_letter[each.key].id"
    assert subscription.get("message_retention_duration")
    assert block(subscription, "expiration_policy")["ttl"] == ""


def test_pubsub_service_agent_can_move_requests_to_the_dead_letter_topic():
    agent = render(locals_()["pubsub_service_agent"], {"data.google_project.this.number": "123"})
    assert agent == "serviceAccount:service-123@gcp-sa-pubsub.iam.gserviceaccount.com"
    publisher = resource("google_pubsub_topic_iam_member", "dead_letter_publisher")
    assert _is_per_catalog_model(publisher)
    assert expression(publisher["topic"]) == "google_pubsub_topic.dead_letter[each.key].name"
    assert publisher["role"] == "roles/pubsub.publisher"
    assert expression(publisher["member"]) == "local.pubsub_service_agent"
    forwarder = resource("google_pubsub_subscription_iam_member", "dead_letter_forwarder")
    assert _is_per_request_queue(forwarder), "the service agent must acknowledge on both priorities' subscriptions"
    assert expression(forwarder["subscription"]) == "google_pubsub_subscription.workers[each.key].name"
    assert forwarder["role"] == "roles/pubsub.subscriber"
    assert expression(forwarder["member"]) == "local.pubsub_service_agent"


# --- Storage and BigQuery ----------------------------------------------------------------------


def test_model_bucket_is_private_and_versioned():
    bucket = resource("google_storage_bucket", "models")
    assert expression(bucket["name"]) == "local.model_bucket_name"
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert block(bucket, "versioning")["enabled"] is True


def _payload_lifecycle_rules() -> dict[str, str]:
    """The payload bucket's Delete rules: each prefix they match -> the age expression that deletes it."""
    bucket = resource("google_storage_bucket", "payloads")
    rules = bucket.get("lifecycle_rule", [])
    deleted: dict[str, str] = {}
    for rule in rules if isinstance(rules, list) else [rules]:
        assert block(rule, "action")["type"] == "Delete"
        condition = block(rule, "condition")
        prefixes = condition.get("matches_prefix")
        assert prefixes, f"a lifecycle rule without matches_prefix deletes every object, batches' too: {condition}"
        assert set(condition) == {"age", "matches_prefix"}, condition
        for prefix in prefixes:
            assert prefix not in deleted, f"{prefix} matched by two rules"
            deleted[prefix] = expression(condition["age"])
    return deleted


def _validated_minimum(name: str) -> int:
    """The least value a variable's validation allows (`var.NAME >= N`)."""
    [validation] = variables()[name]["validation"]
    match = re.fullmatch(rf"var\.{name} >= (\d+)", expression(validation["condition"]))
    assert match, validation["condition"]
    return int(match[1])


def test_payload_bucket_is_private_and_deletes_one_requests_objects_after_the_retention_period():
    bucket = resource("google_storage_bucket", "payloads")
    assert expression(bucket["name"]) == "local.payload_bucket_name"
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    rules = _payload_lifecycle_rules()
    assert {prefix: rules.get(prefix) for prefix in naming.REQUEST_PAYLOAD_PREFIXES} == dict.fromkeys(
        naming.REQUEST_PAYLOAD_PREFIXES, "var.payload_retention_days"
    )
    assert variables()["payload_retention_days"]["default"] == 1
    # Every per-request object the code writes lies under one of those prefixes.
    for name in (naming.input_object("r", 0), naming.result_object("r", 0), naming.flow_stage_object("r", 1)):
        assert name.startswith(naming.REQUEST_PAYLOAD_PREFIXES), name


def test_batch_files_outlive_the_longest_window_and_the_download_period_and_running_markers_never_expire():
    rules = _payload_lifecycle_rules()
    assert rules[naming.BATCHES_PREFIX] == "var.batch_retention_days"
    assert naming.batch_prefix("batch-x").startswith(naming.BATCHES_PREFIX)
    needed_days = -(-(naming.BATCH_MAX_WINDOW_SECONDS + naming.BATCH_DOWNLOAD_SECONDS) // 86400)
    assert variables()["batch_retention_days"]["default"] >= needed_days
    assert _validated_minimum("batch_retention_days") >= needed_days
    # No rule reaches the markers of running batches (nor anything else by a shorter prefix of theirs).
    assert not [prefix for prefix in rules if naming.BATCHES_ACTIVE_PREFIX.startswith(prefix)], rules
    # The example keeps them as long at least.
    example = _load(EXAMPLE_TFVARS)
    assert example.get("batch_retention_days", needed_days) >= needed_days


def test_inference_log_table_uses_the_code_schema_file():
    dataset = resource("google_bigquery_dataset", "maas")
    assert expression(dataset["dataset_id"]) == "local.bigquery_dataset"
    table = resource("google_bigquery_table", "inference_log")
    assert expression(table["dataset_id"]) == "google_bigquery_dataset.maas.dataset_id"
    assert expression(table["table_id"]) == "local.inference_log_table"
    schema_file = re.fullmatch(r'file\("(.*)"\)', expression(table["schema"]))
    assert schema_file, f"the table schema must be read from the contract file, not written inline: {table['schema']!r}"
    assert resolve_module_path(schema_file.group(1)) == CONTRACT_LOG_SCHEMA.resolve()
    assert resolve_module_path(locals_()["inference_log_schema_path"]) == CONTRACT_LOG_SCHEMA.resolve()


def test_inference_log_is_partitioned_by_day_and_clustered_as_the_contract_says():
    table = resource("google_bigquery_table", "inference_log")
    partitioning = block(table, "time_partitioning")
    assert partitioning["type"] == "DAY"
    assert partitioning["field"] == "created_at"
    from contract.log_schema import CLUSTERING_FIELDS, PARTITION_FIELD

    assert partitioning["field"] == PARTITION_FIELD
    assert table["clustering"] == CLUSTERING_FIELDS
    columns = {field["name"]: field for field in json.loads(CONTRACT_LOG_SCHEMA.read_text())}
    assert columns["created_at"]["type"] == "TIMESTAMP"
    assert columns["model"]["type"] == columns["status"]["type"] == "STRING"


def test_log_schema_file_is_a_bigquery_schema_and_the_one_the_code_loads():
    fields = json.loads(CONTRACT_LOG_SCHEMA.read_text())
    assert fields and all({"name", "type", "mode"} <= set(field) for field in fields)
    assert {field["mode"] for field in fields} <= {"REQUIRED", "NULLABLE", "REPEATED"}
    bigquery_types = {"STRING", "INTEGER", "FLOAT", "BOOLEAN", "TIMESTAMP", "BYTES", "JSON"}
    assert {field["type"] for field in fields} <= bigquery_types
    assert len({field["name"] for field in fields}) == len(fields)
    try:
        from contract import log_schema
    except ImportError:
        return  # the code reads the JSON file directly; nothing more to compare
    assert Path(log_schema.SCHEMA_PATH).resolve() == CONTRACT_LOG_SCHEMA.resolve()
    assert log_schema.log_schema_fields() == fields


def test_analytics_views_are_one_per_sql_file_in_infra_sql():
    assert resolve_module_path(locals_()["analytics_sql_dir"]) == (REPO_ROOT / "infra" / "sql").resolve()
    assert expression(locals_()["analytics_sql_files"]) == 'fileset(local.analytics_sql_dir, "*.sql")'
    views = resource("google_bigquery_table", "analytics_views")
    assert expression(views["for_each"]) == "local.analytics_sql_files"
    assert expression(views["table_id"]) == 'trimsuffix(each.key, ".sql")'
    query = expression(block(views, "view")["query"])
    assert query.startswith('templatefile("${local.analytics_sql_dir}/${each.key}"')
    assert "project_id" in query and "dataset" in query


def test_analytics_base_views_are_created_before_the_views_that_read_them():
    assert expression(locals_()["analytics_base_sql_files"]) == 'fileset("${local.analytics_sql_dir}/base", "*.sql")'
    base = resource("google_bigquery_table", "analytics_base_views")
    assert expression(base["for_each"]) == "local.analytics_base_sql_files"
    assert expression(block(base, "view")["query"]).startswith(
        'templatefile("${local.analytics_sql_dir}/base/${each.key}"'
    )
    views = resource("google_bigquery_table", "analytics_views")
    assert "google_bigquery_table.analytics_base_views" in [expression(item) for item in views["depends_on"]]


ALL_SQL = sorted((REPO_ROOT / "infra" / "sql").glob("**/*.sql"))


@pytest.mark.parametrize("sql_file", ALL_SQL, ids=lambda path: path.name)
def test_analytics_sql_uses_only_the_template_variables_terraform_passes(sql_file):
    used = set(re.findall(r"(?<!\$)\$\{\s*(\w+)\s*\}", sql_file.read_text()))
    assert used <= {"project_id", "dataset"}, f"{sql_file.name} uses template variables {sorted(used)}"


# --- Identities --------------------------------------------------------------------------------


def _grants(type_: str, member: str) -> dict[str, dict]:
    return {name: body for name, body in resources_of_type(type_).items() if expression(body["member"]) == member}


def test_api_publishes_to_each_request_topic_only():
    grants = _grants("google_pubsub_topic_iam_member", "google_service_account.api.member")
    by_role = {(expression(body["topic"]), body["role"]): body for body in grants.values()}
    publish = by_role[("google_pubsub_topic.requests[each.key].name", "roles/pubsub.publisher")]
    assert _is_per_request_queue(publish), "the API must publish to the high-priority topics too"
    assert ("google_pubsub_topic.replies.name", "roles/pubsub.subscriber") in by_role
    assert len(by_role) == 2


def test_api_reply_waiting_role_is_minimal():
    role = resource("google_project_iam_custom_role", "reply_waiter")
    allowed = {f"pubsub.subscriptions.{verb}" for verb in ("create", "delete", "consume", "get", "list")}
    assert set(role["permissions"]) <= allowed
    granted = resource("google_project_iam_member", "api_waits_for_replies")
    assert expression(granted["role"]) == "google_project_iam_custom_role.reply_waiter.id"
    project_roles = {
        expression(body["role"])
        for body in _grants("google_project_iam_member", "google_service_account.api.member").values()
    }
    # and one permission more: the copy job of a batch table's snapshot at submit (api_server/batches/tables.py)
    assert project_roles == {"google_project_iam_custom_role.reply_waiter.id",
                             "google_project_iam_custom_role.batch_table_snapshots.id"}  # fmt: skip
    assert resource("google_project_iam_custom_role", "batch_table_snapshots")["permissions"] == [
        "bigquery.jobs.create"
    ]


def test_api_data_access_is_scoped_to_its_resources():
    member = "google_service_account.api.member"
    dataset = [b for b in _grants("google_bigquery_dataset_iam_member", member).values()]
    assert [(expression(b["dataset_id"]), b["role"]) for b in dataset] == [
        ("google_bigquery_dataset.maas.dataset_id", "roles/bigquery.dataEditor")
    ]
    buckets = [b for b in _grants("google_storage_bucket_iam_member", member).values()]
    assert [(expression(b["bucket"]), b["role"]) for b in buckets] == [
        ("google_storage_bucket.payloads.name", "roles/storage.objectAdmin"),
        ("google_storage_bucket.models.name", "roles/storage.objectViewer"),
        ("google_storage_bucket.models.name", "roles/storage.objectAdmin"),
    ]
    # Writing to the model bucket is for adapter registration records only.
    (admin,) = [b for b in buckets if b["role"] == "roles/storage.objectAdmin" and "models" in expression(b["bucket"])]
    assert "/objects/adapters/" in block(admin, "condition")["expression"]
    secrets = list(_grants("google_secret_manager_secret_iam_member", member).values())
    assert [b["role"] for b in secrets] == ["roles/secretmanager.secretAccessor"]
    assert expression(secrets[0]["for_each"]) == "google_secret_manager_secret.maas"


def test_workers_run_as_their_own_account_through_workload_identity():
    binding = resource("google_service_account_iam_member", "worker_workload_identity")
    assert binding["role"] == "roles/iam.workloadIdentityUser"
    member = render(
        binding["member"],
        {
            "var.project_id": EXAMPLE_PROJECT,
            "local.worker_namespace": locals_()["worker_namespace"],
            "local.worker_service_account": locals_()["worker_service_account"],
        },
    )
    assert member == f"serviceAccount:{EXAMPLE_PROJECT}.svc.id.goog[maas/model-worker]"
    cluster = resource("google_container_cluster", "workers")
    assert block(cluster, "workload_identity_config")["workload_pool"] == "${var.project_id}.svc.id.goog"


def test_worker_grants_cover_exactly_what_the_worker_touches():
    member = "google_service_account.worker.member"
    subscriptions = {
        (expression(b["subscription"]), b["role"], expression(b["for_each"]))
        for b in _grants("google_pubsub_subscription_iam_member", member).values()
    }
    assert subscriptions == {
        # Both priorities, and the dead letters the workers answer with an error reply.
        ("google_pubsub_subscription.workers[each.key].name", "roles/pubsub.subscriber", "local.request_queues"),
        ("google_pubsub_subscription.dead_letter[each.key].name", "roles/pubsub.subscriber", "local.models"),
    }
    topics = {(expression(b["topic"]), b["role"]) for b in _grants("google_pubsub_topic_iam_member", member).values()}
    assert topics == {
        ("google_pubsub_topic.replies.name", "roles/pubsub.publisher"),
        # A flow's later stages' request topics only (local.flow_forwarded_queues): a worker forwards a flow.
        ("google_pubsub_topic.requests[each.key].name", "roles/pubsub.publisher"),
        # A batch line's reply goes to the batch collector's topic (issue 35).
        ("google_pubsub_topic.batch_replies.name", "roles/pubsub.publisher"),
    }
    bucket_grants = _grants("google_storage_bucket_iam_member", member).values()
    buckets = {(expression(b["bucket"]), b["role"]) for b in bucket_grants}
    assert buckets == {
        ("google_storage_bucket.models.name", "roles/storage.objectViewer"),
        ("google_storage_bucket.payloads.name", "roles/storage.objectAdmin"),
    }
    assert not _grants("google_project_iam_member", member), "workers need no project-wide role"


def _manifest_renderer():
    """infra/k8s/render.py, which writes the worker manifests this cluster must be able to run."""
    path = REPO_ROOT / "infra" / "k8s" / "render.py"
    if not path.exists():
        pytest.skip("no Kubernetes manifest renderer to compare with")
    name = "maas_k8s_render_for_terraform"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_worker_service_account_is_the_one_the_manifests_annotate():
    render_module = _manifest_renderer()
    account_id = resource("google_service_account", "worker")["account_id"]
    settings = render_module.RenderSettings(project_id=EXAMPLE_PROJECT)
    assert f"{account_id}@{EXAMPLE_PROJECT}.iam.gserviceaccount.com" == settings.worker_google_service_account
    assert settings.namespace == locals_()["worker_namespace"]


def test_gpu_pools_are_the_ones_the_manifests_schedule_on():
    render_module = _manifest_renderer()
    hardware = locals_()["gpu_hardware"]
    for name, pool in render_module.GPU_POOLS.items():
        assert hardware[name] == {"machine_type": pool.machine_type, "accelerator_type": pool.accelerator}
    shared = [
        pool["max_shared_clients_per_gpu"]
        for pool in variables()["gpu_node_pools"]["default"].values()
        if pool.get("max_shared_clients_per_gpu", 1) > 1
    ]
    assert shared == [render_module.DEFAULT_MAX_SHARED_CLIENTS_PER_GPU]


# --- Compute ------------------------------------------------------------------------------------


def test_gpu_hardware_classes_are_the_catalog_ones():
    hardware = locals_()["gpu_hardware"]
    assert set(hardware) == set(typing.get_args(ModelSpec.model_fields["hardware"].annotation))
    assert hardware["l4"] == {"machine_type": "g2-standard-8", "accelerator_type": "nvidia-l4"}
    assert hardware["a100"] == {"machine_type": "a2-highgpu-1g", "accelerator_type": "nvidia-tesla-a100"}


@pytest.mark.parametrize("model", MODELS)
def test_default_node_pools_can_run_every_catalog_model(model):
    spec = CATALOG.models[model]
    pools = variables()["gpu_node_pools"]["default"]
    fitting = [
        name
        for name, pool in pools.items()
        if pool["hardware"] == spec.hardware and (pool.get("max_shared_clients_per_gpu", 1) > 1) == spec.gpu_sharing
    ]
    assert fitting, f"no default GPU pool offers {spec.hardware} with gpu_sharing={spec.gpu_sharing} for {model}"


def test_default_node_pools_hold_the_memory_the_plan_gives_each_worker():
    """Every worker's pod (host memory from the memory plan: its weights at load) fits a node of every default pool
    it may land on, its share where the GPU is time-shared; the pool's GPU holds the plan's weights and activations."""
    render_module = _manifest_renderer()
    settings = render_module.RenderSettings(project_id=EXAMPLE_PROJECT)
    hardware, pools = locals_()["gpu_hardware"], variables()["gpu_node_pools"]["default"]
    for deployment in render_module.worker_deployments(CATALOG):
        memory = render_module.worker_memory_mib(deployment, settings)
        fitting = [pool for pool in pools.values() if pool["hardware"] == deployment.hardware
                   and (pool.get("max_shared_clients_per_gpu", 1) > 1) == deployment.gpu_sharing]  # fmt: skip
        assert fitting, deployment.name
        for pool in fitting:
            node = render_module.GPU_POOLS[pool["hardware"]]
            assert hardware[pool["hardware"]]["machine_type"] == node.machine_type
            clients = pool.get("max_shared_clients_per_gpu", 1)
            assert memory <= node.node_memory_mib // clients, (deployment.name, memory)
            plan = CATALOG.deployment_plans()[deployment.name]
            assert plan.clients_per_gpu == clients or not deployment.gpu_sharing
            assert plan.fits, plan.problem()


def test_gpu_nodes_are_tainted_shared_and_get_drivers_from_gke():
    pool = resource("google_container_node_pool", "gpu")
    assert expression(pool["for_each"]) == "var.gpu_node_pools"
    node_config = block(pool, "node_config")
    assert block(node_config, "taint") == {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}
    assert expression(node_config["spot"]) == "each.value.spot"
    accelerator = block(node_config, "guest_accelerator")
    assert expression(accelerator["type"]) == "local.gpu_hardware[each.value.hardware].accelerator_type"
    assert block(accelerator, "gpu_driver_installation_config")["gpu_driver_version"] == "LATEST"
    sharing = block(block(accelerator, "dynamic"), "gpu_sharing_config")
    content = block(sharing, "content")
    assert content["gpu_sharing_strategy"] == "TIME_SHARING"
    autoscaling = block(pool, "autoscaling")
    assert expression(autoscaling["total_min_node_count"]) == "each.value.min_node_count"
    assert expression(autoscaling["total_max_node_count"]) == "each.value.max_node_count"


def test_cluster_has_private_nodes_and_a_release_channel():
    cluster = resource("google_container_cluster", "workers")
    assert block(cluster, "private_cluster_config")["enable_private_nodes"] is True
    assert expression(block(cluster, "release_channel")["channel"]) == "var.gke_release_channel"
    assert cluster["remove_default_node_pool"] is True


def test_api_service_gets_the_settings_the_code_reads():
    service = resource("google_cloud_run_v2_service", "api")
    assert expression(service["name"]) == "local.api_service_name"
    template = block(service, "template")
    container = block(template, "containers")
    assert block(container, "ports")["container_port"] == 8080
    env = {item["name"]: item for item in container["env"]}
    assert env["MAAS_ENV"]["value"] == "production"
    assert expression(env["MAAS_PROJECT_ID"]["value"]) == "var.project_id"
    redis_url = render(
        env["MAAS_REDIS_URL"]["value"],
        {"google_redis_instance.cache.host": "10.0.0.3", "google_redis_instance.cache.port": "6379"},
    )
    assert redis_url == "redis://10.0.0.3:6379"
    assert expression(env["MAAS_REPLY_MODE"]["value"]) == "var.api_reply_mode"
    key_ref = block(block(env["MAAS_API_KEY_SHA256"], "value_source"), "secret_key_ref")
    assert expression(key_ref["secret"]) == 'google_secret_manager_secret.maas["api_key_sha256"].secret_id'
    assert locals_()["secret_ids"]["api_key_sha256"] == "maas-api-key-sha256"
    assert locals_()["secret_ids"]["webhook_signing_secret"] == "maas-webhook-signing-secret"
    assert block(template, "vpc_access"), "the API reaches Redis through the VPC"


def test_reply_modes_are_the_ones_the_code_accepts():
    settings = pytest.importorskip("contract.settings")
    validation = block(variables()["api_reply_mode"], "validation")
    accepted = set(re.findall(r'"([\w-]+)"', expression(validation["condition"])))
    assert accepted == set(typing.get_args(settings.ReplyMode))
    assert variables()["api_reply_mode"]["default"] == settings.Settings.reply_mode


# --- Alerts and outputs --------------------------------------------------------------------------


def test_each_request_queue_has_a_backlog_alert_and_each_model_a_dead_letter_alert():
    backlog = resource("google_monitoring_alert_policy", "request_queue_backlog")
    dead_letter = resource("google_monitoring_alert_policy", "dead_lettered_requests")
    assert _is_per_request_queue(backlog), "both priorities' oldest unacked age must be watched"
    assert _is_per_catalog_model(dead_letter)
    backlog_condition = block(block(backlog, "conditions"), "condition_threshold")
    assert "local.worker_subscription_names[each.key]" in backlog_condition["filter"]
    assert "oldest_unacked_message_age" in backlog_condition["filter"]
    # Interactive queues alert past the model's timeout; a batch line waits for idle capacity, so a day.
    assert expression(backlog_condition["threshold_value"]) == (
        'each.value.priority == "batch" ? var.batch_backlog_alert_seconds : '
        "local.models[each.value.model].request_timeout_seconds"
    )
    assert variables()["batch_backlog_alert_seconds"]["default"] >= 24 * 3600
    filters = [block(condition, "condition_threshold")["filter"] for condition in dead_letter["conditions"]]
    moved, unanswered = filters
    assert "dead_letter_message_count" in moved and "local.worker_subscription_names" in moved
    assert "keys(local.priority_suffixes)" in moved, "requests dead-lettered from either priority must alert"
    assert "local.dead_letter_subscription_names[each.key]" in unanswered
    assert "num_undelivered_messages" in unanswered


def test_api_alerts_watch_the_api_service():
    for name in ("api_server_errors", "api_latency"):
        policy = resource("google_monitoring_alert_policy", name)
        condition = block(block(policy, "conditions"), "condition_threshold")
        assert "local.api_service_name" in condition["filter"]
        assert expression(policy["notification_channels"]) == "var.alert_notification_channels"


def test_keda_can_read_the_backlog_through_promql():
    binding = resource("google_service_account_iam_member", "keda_workload_identity")
    assert binding["role"] == "roles/iam.workloadIdentityUser"
    roles = {
        expression(body["role"])
        for body in _grants("google_project_iam_member", "google_service_account.keda.member").values()
    }
    # monitoring.timeSeries.list is what Cloud Monitoring's PromQL API checks.
    assert roles == {"roles/monitoring.viewer"}


def test_promql_endpoint_is_the_one_the_scaled_objects_query():
    render_module = _manifest_renderer()
    url = render(outputs()["prometheus_query_url"]["value"], {"var.project_id": EXAMPLE_PROJECT})
    assert url == render_module.PROMETHEUS_SERVER_ADDRESS.format(project_id=EXAMPLE_PROJECT)


def test_cluster_runs_managed_prometheus_to_scrape_the_workers():
    config = block(resource("google_container_cluster", "workers"), "monitoring_config")
    assert block(config, "managed_prometheus")["enabled"] is True


def test_outputs_tell_operators_where_everything_is():
    expected = {
        "api_url",
        "cluster_name",
        "request_topics",
        "worker_subscriptions",
        "worker_deployments",
        "prometheus_query_url",
        "replies_topic",
        "model_bucket",
        "payload_bucket",
        "bigquery_dataset",
        "worker_service_account_email",
        "artifact_registry_url",
    }
    assert expected <= set(outputs())


# --- Security scan -------------------------------------------------------------------------------


def _checkov_executable() -> Path:
    return Path(os.environ.get("MAAS_CHECKOV_BIN") or REPO_ROOT / ".venv-checkov" / "bin" / "checkov")


def test_checkov_finds_no_failure_without_a_written_justification():
    checkov = _checkov_executable()
    assert checkov.exists(), (
        f"checkov not found at {checkov}: create .venv-checkov from requirements-checkov.txt or set MAAS_CHECKOV_BIN"
    )
    started = time.monotonic()
    # Bounded by the CPU it uses, not by the wall clock: its wall time grows with the machine's load (tool_runs).
    result = run_bounded_by_cpu(
        [str(checkov), "-d", str(TERRAFORM_DIR), "--framework", "terraform", "--quiet", "--compact"]
        + ["--skip-download", "-o", "json"],
        CHECKOV_CPU_SECONDS,
        cwd=REPO_ROOT,
    )
    print(f"checkov took {time.monotonic() - started:.1f}s")
    assert result.returncode not in (-signal.SIGXCPU, -signal.SIGKILL), f"checkov used {CHECKOV_CPU_SECONDS}s of CPU"
    assert result.stdout.strip(), f"checkov printed nothing (exit {result.returncode}):\n{result.stderr}"
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{check['check_id']} {check['resource']} ({check['file_path']}): {check['check_name']}"
        for report in reports
        for check in report.get("results", {}).get("failed_checks", [])
    ]
    parsing_errors = [error for report in reports for error in report.get("results", {}).get("parsing_errors", [])]
    assert not parsing_errors, f"checkov could not parse: {parsing_errors}"
    assert failed == [], "checkov failures; fix them or skip inline with a reason:\n" + "\n".join(failed)


def test_each_catalog_version_is_a_unit_named_as_the_code_names_it():
    # local.catalog_units expands `versions` the way ModelCatalog.units does: "<model>--<version>", the
    # version's fields over the model's; an entry without `versions` is one unit named after the model.
    units = expression(locals_()["catalog_units"])
    assert "for name, entry in local.catalog.models" in units
    assert "try(entry.versions, {(entry.version) = {}})" in units
    assert f'"${{name}}{naming.VERSION_SEPARATOR}${{version}}"' in units
    assert "merge(entry, override)" in units
    assert naming.version_queue("m", "2") == "m--2"


# --- Batch jobs on Spot (issue 35) ---------------------------------------------------------------


def test_spot_pools_are_tainted_for_the_batch_workers_the_renderer_tolerates():
    render_module = _manifest_renderer()
    node_config = block(resource("google_container_node_pool", "gpu"), "node_config")
    spot_taint = block(node_config, "dynamic")["taint"]
    assert expression(spot_taint["for_each"]) == 'each.value.spot ? toset(["spot"]) : toset([])'
    content = block(spot_taint, "content")
    assert content["key"] == render_module.SPOT_TAINT_KEY and content["effect"] == "NO_SCHEDULE"
    assert expression(content["value"]) == "taint.value" and render_module.SPOT_TAINT_VALUE == "spot"
    assert "each.value.spot" in expression(node_config["labels"]["maas-capacity"])


@pytest.mark.parametrize("pools", ["default", "example"])
def test_every_catalog_hardware_has_an_on_demand_pool_and_a_spot_pool_from_zero(pools):
    configured = (
        variables()["gpu_node_pools"]["default"] if pools == "default" else _load(EXAMPLE_TFVARS)["gpu_node_pools"]
    )
    for hardware in {spec.hardware for spec in CATALOG.units()}:
        of_hardware = [pool for pool in configured.values() if pool["hardware"] == hardware]
        assert [pool for pool in of_hardware if not pool.get("spot", False)], f"{hardware}: no on-demand pool"
        spot = [pool for pool in of_hardware if pool.get("spot", False)]
        assert spot, f"{hardware}: no Spot pool for its batch workers"
        assert all(pool["min_node_count"] == 0 for pool in spot), "a Spot pool costs nothing without a batch"


def test_batch_queues_keep_their_lines_for_longer_than_a_batch_window():
    workers = resource("google_pubsub_subscription", "workers")
    assert expression(workers["message_retention_duration"]) == (
        'each.value.priority == "batch" ? "${var.batch_request_retention_seconds}s" : "${var.request_retention_seconds}s"'
    )
    assert 24 * 3600 < variables()["batch_request_retention_seconds"]["default"] <= 604800
    assert locals_()["priority_suffixes"]["batch"] == "-batch"


def test_a_flow_needs_no_topic_of_its_own_and_workers_may_forward_a_flow_to_its_later_stages():
    # A flow is published to its first stage's request topic: no topic is declared for flows.
    assert all("flow" not in name for name in resources_of_type("google_pubsub_topic"))
    forwarded = expression(locals_()["flow_forwarded_models"])
    assert "try(local.catalog.flows, {})" in forwarded and "stage.model if index > 0" in forwarded
    queues = expression(locals_()["flow_forwarded_queues"])
    assert (
        "local.request_queues" in queues
        and 'contains(local.flow_forwarded_models, split("--", queue.model)[0])' in queues
    )
    grant = resource("google_pubsub_topic_iam_member", "worker_forwards_flow_stages")
    assert expression(grant["for_each"]) == "local.flow_forwarded_queues"
    assert expression(grant["topic"]) == "google_pubsub_topic.requests[each.key].name"
    assert grant["role"] == "roles/pubsub.publisher"
    assert expression(grant["member"]) == "google_service_account.worker.member"


def test_the_dashboard_counts_the_admission_lines_the_api_logs(caplog):
    """The log-based metric behind the dashboard's refused / fallback series reads the fields the API logs."""
    import logging

    from api_server.predict.admission import Verdict, _log_decision

    with caplog.at_level(logging.INFO, logger="api_server.predict.admission"):
        _log_decision(CATALOG.get("sd15-txt2img"), "refused", Verdict(False, 40.0, 42.0, 12))
    (record,) = caplog.records
    logged = record.fields["admission"]
    metric = resource("google_logging_metric", "admission_decisions")
    assert "jsonPayload.admission:*" in metric["filter"]
    extractors = metric["label_extractors"]
    assert sorted(extractors) == ["decision", "model"]
    for label, extractor in extractors.items():
        assert extractor == f"EXTRACT(jsonPayload.admission.{label})" and label in logged
    assert (logged["model"], logged["decision"]) == ("sd15-txt2img", "refused")
    dashboard = resource("google_monitoring_dashboard", "fleet")
    assert "local.dashboard_rows" in expression(dashboard["dashboard_json"])
    # One row of tiles per model of the catalog, read from the same local as every other per-model resource.
    assert "for model, spec in local.models" in expression(locals_()["dashboard_model_tiles"])


def test_api_may_sign_result_links_as_itself_only():
    """`response_format: url` signs through IAM signBlob: the token creator role on the API's own account, no other."""
    grants = _grants("google_service_account_iam_member", "google_service_account.api.member")
    assert [(expression(b["service_account_id"]), b["role"]) for b in grants.values()] == [
        ("google_service_account.api.name", "roles/iam.serviceAccountTokenCreator")
    ]
