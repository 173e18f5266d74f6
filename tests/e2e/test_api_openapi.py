"""The OpenAPI document, generated from the models the API validates with, fuzzed against the live stack.

schemathesis generates valid and invalid inputs for every documented operation from `/openapi.json` and
checks each answer: never a 5xx, and status, headers, content type and body as documented. The `model`
path parameter is pinned to the synthetic `noop` model (it answers at once), so the run takes about a
minute while every case goes through the real API, Redis, Pub/Sub and the worker.
"""

from __future__ import annotations

import json
import socket
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from api_server.process.openapi import ADMIN_ONLY
from tests.conftest import TEST_ADMIN_KEY

pytestmark = pytest.mark.stack

# Cases per operation: the inference bodies get most; an operation without inputs has one case to make.
# The pinned-version predict and the admin-only traffic split mostly answer 404/403 for generated inputs: few.
EXAMPLES = {
    "POST": 270,
    "DELETE": 40,
    "GET /v1/jobs/{job_id}": 40,
    "GET /v1/models/{model}": 10,
    "POST /v1/models/{model}/versions/{version}:predict": 30,
    "DELETE /v1/models/{model}/traffic": 5,
    # The OpenAI Images routes: the same serving path as :predict, fuzzed for their own body shapes.
    "POST /v1/images/generations": 60,
    "POST /v1/images/edits": 30,
}
CASES = {"count": 0}
STATUSES: Counter[str] = Counter()
# The body schema is every model's; a model's own limits (instances per request, sizes, steps, whether it
# takes an input image, a decodable image) are its catalog entry's, answered 422 with the field: a
# schema-valid body may be refused, so acceptance of valid data is not checked (every other check is).
CATALOG_DEPENDENT = [positive_data_acceptance]


@pytest.fixture(scope="session")
def api_schema(stack):
    document = requests.get(f"{stack.api_url}/openapi.json", timeout=10).json()
    for operation in (op for ops in document["paths"].values() for op in ops.values()):
        for parameter in operation.get("parameters", []):
            if parameter["name"] == "model":
                parameter["schema"]["enum"] = ["noop"]
    # The OpenAI Images routes name the model in the body: the same pin.
    for body in ("ImageGenerationBody", "ImageEditForm"):
        document["components"]["schemas"][body]["properties"]["model"]["enum"] = ["noop"]
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=stack.api_url)
    return schema


def test_every_generated_request_is_answered_as_documented(api_schema, auth_headers):
    admin_headers = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES.get(operation.label, EXAMPLES.get(operation.method.upper(), 3)),
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def answered_as_documented(case):
            # The operations the document marks admin-only get the admin key: fuzzed past authentication.
            admin_only = case.operation.definition.raw.get("security") == [ADMIN_ONLY]
            headers = admin_headers if admin_only else auth_headers
            response = case.call_and_validate(headers=headers, excluded_checks=CATALOG_DEPENDENT, timeout=30)
            CASES["count"] += 1
            STATUSES[f"{case.operation.label} {response.status_code}"] += 1

        answered_as_documented()
    print("generated cases by operation and status:", dict(sorted(STATUSES.items())))
    # Every operation answered something past authentication (an operation only ever refused was not fuzzed).
    answered: dict[str, set[str]] = {}
    for label_status in STATUSES:
        label, status = label_status.rsplit(" ", 1)
        answered.setdefault(label, set()).add(status)
    assert not [label for label, statuses in answered.items() if statuses <= {"401", "403"}], answered


def test_the_fuzzer_ran_at_least_a_thousand_cases():
    if CASES["count"] == 0:
        pytest.skip("the generated tests were not selected")
    assert CASES["count"] >= 1000


def test_docs_page_loads_the_document(stack):
    page = requests.get(f"{stack.api_url}/docs", timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "/openapi.json" in page.text
    document = requests.get(f"{stack.api_url}/openapi.json", timeout=10).json()
    assert document["openapi"].startswith("3.")
    predict = document["paths"]["/v1/models/{model}:predict"]["post"]
    # The body schema is the validating model's; every error status has the one error shape.
    assert predict["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/PredictBody")
    for status in ("400", "401", "404", "413", "422", "429", "503"):
        assert predict["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "Location" in predict["responses"]["202"]["headers"]


def test_json_nested_ten_thousand_deep_is_a_400(stack, auth_headers):
    response = requests.post(
        f"{stack.api_url}/v1/models/noop:predict",
        data="[" * 10_000 + "]" * 10_000,
        headers={**auth_headers, "Content-Type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400 and "nested" in response.json()["error"]["message"]


def test_a_wrong_method_is_a_json_405_with_allow(stack, auth_headers):
    response = requests.get(f"{stack.api_url}/v1/models/noop:predict", headers=auth_headers, timeout=10)
    assert response.status_code == 405 and response.headers["Allow"]
    assert response.json()["error"]["code"] == 405
    assert response.headers["X-Request-Id"]


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"num_inference_steps": True}, "parameters.num_inference_steps"),
        ({"num_inference_steps": "4"}, "parameters.num_inference_steps"),
        ({"width": 65}, "parameters.width"),
    ],
)
def test_wrong_types_are_refused_not_coerced(stack, auth_headers, parameters, field):
    response = requests.post(
        f"{stack.api_url}/v1/models/noop:predict",
        json={"instances": [{"prompt": "strict"}], "parameters": parameters},
        headers=auth_headers,
        timeout=10,
    )
    assert response.status_code == 422 and response.json()["error"]["field"] == field


def test_nan_and_non_objects_are_refused_in_plain_words(stack, auth_headers):
    url = f"{stack.api_url}/v1/models/noop:predict"
    headers = {**auth_headers, "Content-Type": "application/json"}
    nan = requests.post(
        url, data='{"instances": [{"prompt": "x"}], "parameters": {"guidance_scale": NaN}}', headers=headers, timeout=10
    )
    assert nan.status_code == 422 and "finite" in nan.json()["error"]["message"]
    listed = requests.post(url, json=[1, 2], headers=headers, timeout=10)
    assert listed.status_code == 422 and "Body" not in listed.json()["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
    ],
)
def test_the_servers_own_refusals_are_json(stack, raw):
    host, port = stack.api_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(raw)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split()[1] in (b"400", b"414", b"431")
    assert b"Content-Type: application/json" in head
    assert json.loads(body)["error"]["code"] == int(head.split()[1])
