"""Batch jobs over HTTP against the real stack: validation as predict's, results and errors files exact by
custom_id, fail-fast, cancel, expiry, another key's 404, the log rows and the usage per batch."""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime

import pytest
import requests

from tests.conftest import TEST_API_KEYS, open_hold, query_rows

pytestmark = pytest.mark.stack
OTHER_KEY = {"Authorization": f"Bearer {TEST_API_KEYS[1]}"}
ENDED = {"completed", "failed", "cancelled", "expired"}


def line(custom_id: str, model: str = "noop", seed: int | None = None, **parameters) -> dict:
    if seed is not None:
        parameters["seed"] = seed
    return {"custom_id": custom_id, "model": model, "instances": [{"prompt": f"batch {custom_id}"}],
            "parameters": {"width": 64, "height": 64, **parameters}}  # fmt: skip


def create(stack, headers: dict, **body) -> dict:
    response = requests.post(f"{stack.api_url}/v1/batches", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def read(stack, headers: dict, batch_id: str) -> dict | None:
    """The batch now; None while the API cannot answer (the fault tests kill it)."""
    try:
        response = requests.get(f"{stack.api_url}/v1/batches/{batch_id}", headers=headers, timeout=10)
    except requests.RequestException:  # refused or timed out while it restarts
        return None
    return response.json() if response.status_code == 200 else None


def wait(stack, headers: dict, batch_id: str, timeout: float = 60, until=lambda view: view["status"] in ENDED) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = read(stack, headers, batch_id)
        if view is not None and until(view):
            return view
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} not there in {timeout}s: {view}")


def output(stack, headers: dict, batch_id: str, kind: str) -> list[dict]:
    response = requests.get(f"{stack.api_url}/v1/batches/{batch_id}/{kind}", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return [json.loads(text) for text in response.text.splitlines()]


def predict_error(stack, headers: dict, body: dict) -> tuple[int, str]:
    """What the predict route answers the same body (the batch line without its custom_id)."""
    payload = {key: value for key, value in body.items() if key in ("instances", "parameters")}
    response = requests.post(f"{stack.api_url}/v1/models/{body['model']}:predict", json=payload, headers=headers,
                             timeout=30)  # fmt: skip
    return response.status_code, response.json()["error"]["message"]


def test_a_mixed_batch_answers_each_custom_id_once_with_invalid_lines_as_predict_refuses_them(
    stack, auth_headers, settings, bigquery
):
    valid = [line(f"ok-{index}", seed=1000 + index) for index in range(6)]
    invalid = [
        line("unknown-model", model="no-such-model"),
        line("width-as-text", width="64"),
        {**line("no-instances"), "instances": []},
        line("too-wide", width=4096),
        line("bad-steps", num_inference_steps=0),
    ]
    lines = [valid[0], invalid[0], valid[1], invalid[1], invalid[2], valid[2], invalid[3], valid[3], invalid[4],
             valid[4], valid[5]]  # fmt: skip
    no_id = {"model": "noop", "instances": [{"prompt": "no id"}]}
    lines += [no_id, line("ok-0")]  # a line without a custom_id, and a second ok-0
    batch = create(stack, auth_headers, requests=lines, metadata={"purpose": "mixed"})
    assert batch["status"] == "validating" and batch["metadata"] == {"purpose": "mixed"}
    assert batch["completion_window"] == "24h"
    final = wait(stack, auth_headers, batch["id"])
    assert final["status"] == "completed", final
    counts = final["request_counts"]
    assert counts == {"total": 13, "succeeded": 6, "failed": 7, "cancelled": 0, "expired": 0}, counts
    assert final["in_progress_at"] and final["finalizing_at"] and final["completed_at"]

    results = output(stack, auth_headers, batch["id"], "results")
    assert sorted(item["custom_id"] for item in results) == sorted(item["custom_id"] for item in valid)
    bucket = _bucket(settings)
    for item in results:
        index = int(item["custom_id"].split("-")[1])
        assert item["status"] == "succeeded" and item["model"] == "noop"
        [image] = item["images"]
        assert image["seed"] == 1000 + index and image["width"] > 0 and image["height"] > 0
        prefix = f"gs://{bucket.name}/"
        assert image["uri"].startswith(f"{prefix}batches/{batch['id']}/images/")
        assert bucket.blob(image["uri"][len(prefix) :]).download_as_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    errors = {(item["custom_id"], item["line"]): item for item in output(stack, auth_headers, batch["id"], "errors")}
    expected = {}
    for body in invalid:
        code, message = predict_error(stack, auth_headers, body)
        expected[(body["custom_id"], lines.index(body) + 1)] = (code, message)
    expected[(None, 12)] = (422, "custom_id: a string of 1 to 256 characters, unique in the batch")
    expected[("ok-0", 13)] = (409, "custom_id 'ok-0': a line before this one has it")
    assert {key: (item["error"]["code"], item["error"]["message"]) for key, item in errors.items()} == expected
    assert all(item["status"] == "failed" for item in errors.values())

    rows = query_rows(
        bigquery,
        f"SELECT custom_id, status, endpoint, priority, batch_job_id, num_images FROM "
        f"`{settings.project_id}.{settings.dataset}.{settings.log_table}` WHERE batch_job_id = '{batch['id']}'",
        expected=6,
    )
    assert sorted(row["custom_id"] for row in rows) == sorted(item["custom_id"] for item in valid)
    assert {(row["status"], row["endpoint"], row["priority"]) for row in rows} == {("ok", "batch", "batch")}
    usage = _usage_of(stack, auth_headers, batch["id"])
    assert usage["lines"] == 6 and usage["succeeded"] == 6 and usage["gpu_seconds"] >= 0


def _bucket(settings):
    from contract import google_clients

    return google_clients.storage_client(settings).bucket(settings.payload_bucket)


def _usage_of(stack, headers: dict, batch_id: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        usage = requests.get(f"{stack.api_url}/v1/usage", headers=headers, timeout=30).json()
        found = [item for item in usage["batches"] if item["batch_job_id"] == batch_id]
        if found or time.monotonic() > deadline:
            assert found, usage["batches"]
            return found[0]
        time.sleep(0.5)


def test_a_batch_whose_first_lines_are_all_invalid_fails_fast_with_the_reason(stack, auth_headers):
    lines = [line(f"bad-{index}", model="no-such-model") for index in range(120)] + [line("late-good")]
    final = wait(stack, auth_headers, create(stack, auth_headers, requests=lines)["id"])
    assert final["status"] == "failed", final
    assert final["error"]["message"].startswith("the first 100 lines are all invalid; line 1: 404 unknown model")
    assert final["request_counts"] == {"total": 100, "succeeded": 0, "failed": 100, "cancelled": 0, "expired": 0}


def test_another_keys_batch_is_a_404_everywhere_and_absent_from_its_list(stack, auth_headers):
    batch = create(stack, auth_headers, requests=[line("mine")])
    for method, path in [("get", ""), ("delete", ""), ("get", "/results"), ("get", "/errors")]:
        response = requests.request(method, f"{stack.api_url}/v1/batches/{batch['id']}{path}", headers=OTHER_KEY,
                                    timeout=10)  # fmt: skip
        assert response.status_code == 404, (method, path, response.text)
    listed = requests.get(f"{stack.api_url}/v1/batches", headers=OTHER_KEY, timeout=10).json()["batches"]
    assert batch["id"] not in {item["id"] for item in listed}
    own = requests.get(f"{stack.api_url}/v1/batches", headers=auth_headers, timeout=10).json()["batches"]
    assert batch["id"] in {item["id"] for item in own}
    # Digits int() refuses (a superscript passes str.isdigit()) are a 422 naming the parameter, not a 500.
    for params, field in [
        ({"before": "\u00b9"}, "before"),
        ({"limit": "\u00b2"}, "limit"),
        ({"before": "x"}, "before"),
    ]:
        refused = requests.get(f"{stack.api_url}/v1/batches", params=params, headers=auth_headers, timeout=10)
        assert refused.status_code == 422 and refused.json()["error"]["field"] == field, (params, refused.text)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"requests": []}, "requests"),
        ({"input_file": "gs://nowhere-bucket/missing.jsonl"}, "input_file"),
        ({"input_table": "project.dataset.table"}, "input_table"),
        ({"requests": [{}], "completion_window": "2s"}, "completion_window"),
        ({"requests": [{}], "metadata": {"a": 1}}, "metadata"),
    ],
)
def test_a_bad_submission_is_a_422_naming_the_field(stack, auth_headers, body, field):
    response = requests.post(f"{stack.api_url}/v1/batches", json=body, headers=auth_headers, timeout=10)
    assert response.status_code == 422 and response.json()["error"]["field"] == field, response.text


def _sleep_lines(prefix: str, count: int, held_at: int | None = None, gate: str = "") -> list[dict]:
    """`sleep` lines; the one at `held_at` is a `!hold <gate>` prompt: its call waits after its first step until the
    test opens the gate (the stand-in GPU runs one call at a time), so the batch cannot end before that by order.
    The feeder publishes it only once all but the in-flight bound's lines before it were answered (32 locally: one worker of max_batch_size 8, times 4)."""
    lines = [line(f"{prefix}-{index}", model="sleep", seed=index) for index in range(count)]
    if held_at is not None:
        lines[held_at]["instances"] = [{"prompt": f"!hold {gate}"}]
    return lines


def _assert_each_custom_id_once(stack, headers: dict, final: dict, expected_ids: set[str]) -> tuple[list, list]:
    results = output(stack, headers, final["id"], "results")
    errors = output(stack, headers, final["id"], "errors")
    answered = [item["custom_id"] for item in results + errors]
    assert len(answered) == len(set(answered)), "a custom_id answered twice"
    assert set(answered) <= expected_ids
    counts = final["request_counts"]
    assert len(answered) == counts["total"] == sum(counts[name] for name in ("succeeded", "failed", "cancelled",
                                                                              "expired"))  # fmt: skip
    assert len(results) == counts["succeeded"]
    return results, errors


def test_a_batch_cancelled_mid_way_keeps_what_finished_and_counts_the_rest_cancelled(stack, auth_headers):
    gate = f"cancel-{uuid.uuid4().hex}"
    lines = _sleep_lines(f"cancel-{uuid.uuid4().hex[:6]}", 300, held_at=150, gate=gate)
    batch = create(stack, auth_headers, requests=lines)
    try:
        wait(stack, auth_headers, batch["id"], until=lambda view: view["request_counts"]["succeeded"] >= 16)
        response = requests.delete(f"{stack.api_url}/v1/batches/{batch['id']}", headers=auth_headers, timeout=10)
    finally:
        open_hold(stack, gate)
    assert response.status_code == 200 and response.json()["status"] == "cancelling", response.text
    final = wait(stack, auth_headers, batch["id"])
    assert final["status"] == "cancelled" and final["cancelling_at"] and final["cancelled_at"], final
    results, errors = _assert_each_custom_id_once(stack, auth_headers, final, {item["custom_id"] for item in lines})
    counts = final["request_counts"]
    assert counts["succeeded"] >= 16 and counts["cancelled"] > 0 and counts["failed"] == counts["expired"] == 0
    # Every line of the file has its line: the never-read ones listed `cancelled`, counted in `total`.
    assert counts["total"] == len(lines)
    assert {item["custom_id"] for item in results + errors} == {item["custom_id"] for item in lines}
    assert {item["status"] for item in errors} == {"cancelled"}
    again = requests.delete(f"{stack.api_url}/v1/batches/{batch['id']}", headers=auth_headers, timeout=10)
    assert again.status_code == 409


def test_a_batch_past_its_window_expires_its_unfinished_lines_and_keeps_the_finished(stack, auth_headers):
    gate = f"expire-{uuid.uuid4().hex}"
    lines = _sleep_lines(f"expire-{uuid.uuid4().hex[:6]}", 400, held_at=100, gate=gate)
    batch = create(stack, auth_headers, requests=lines, completion_window="10s")
    try:
        # Lines run until the held one (at least 36 before it), which keeps the batch unfinished past its window.
        wait(stack, auth_headers, batch["id"], until=lambda view: view["request_counts"]["succeeded"] > 0)
        ends = datetime.fromisoformat(batch["expires_at"]).timestamp()
        time.sleep(max(0.0, ends - time.time()))  # to the window's end, however long the lines before took
    finally:
        open_hold(stack, gate)
    final = wait(stack, auth_headers, batch["id"], timeout=60)
    assert final["status"] == "expired" and final["expired_at"], final
    results, errors = _assert_each_custom_id_once(stack, auth_headers, final, {item["custom_id"] for item in lines})
    counts = final["request_counts"]
    assert counts["succeeded"] > 0 and counts["expired"] > 0, counts
    assert {item["status"] for item in errors} == {"expired"}
    assert counts["total"] == len(lines)
    assert {item["custom_id"] for item in results + errors} == {item["custom_id"] for item in lines}


def test_the_sdk_and_the_cli_create_wait_list_and_read_a_batch(stack, tmp_path):
    from maas_client import Client
    from tests.e2e.test_sdk_cli import run_cli

    with Client(stack.api_url, TEST_API_KEYS[0]) as client:
        view = client.batches.create(requests=[line("sdk-1"), line("sdk-2")], metadata={"via": "sdk"})
        done = client.batches.wait(view.id, timeout=60)
        assert done.status == "completed" and done.request_counts.succeeded == 2 and done.metadata == {"via": "sdk"}
        assert sorted(item["custom_id"] for item in client.batches.results(view.id)) == ["sdk-1", "sdk-2"]
        assert client.batches.errors(view.id) == []
        assert view.id in {listed.id for listed in client.batches.list(limit=5)}
    source = tmp_path / "lines.jsonl"
    source.write_text(json.dumps(line("cli-1")) + "\n" + json.dumps(line("cli-2", model="no-such-model")) + "\n")
    created = run_cli(stack, "--json", "batches", "create", str(source), "--metadata", "via=cli")
    assert created.returncode == 0, created.stderr
    batch_id = json.loads(created.stdout)["id"]
    waited = run_cli(stack, "--json", "batches", "wait", batch_id)
    assert waited.returncode == 0, waited.stderr
    final = json.loads(waited.stdout)
    assert final["status"] == "completed" and final["request_counts"]["failed"] == 1, final
    listed = run_cli(stack, "batches", "list", "--limit", "3")
    assert listed.returncode == 0 and batch_id in listed.stdout, listed.stdout


def test_a_flow_is_a_batch_line_like_a_model(stack, auth_headers, settings, bigquery):
    # relay-across (tests/models.fixtures.yaml): its draft in the relay group, its polish in another deployment.
    ok, refused = line("flow-ok", model="relay-across", seed=7), line("flow-bad", model="relay-across", strength=0.5)
    batch = create(stack, auth_headers, requests=[ok, refused])
    final = wait(stack, auth_headers, batch["id"])
    assert final["status"] == "completed" and final["request_counts"]["succeeded"] == 1, final
    [result] = output(stack, auth_headers, batch["id"], "results")
    assert (result["custom_id"], result["status"], result["model"]) == ("flow-ok", "succeeded", "relay-across")
    assert result["images"][0]["seed"] == 7
    assert result["model_version"] == "draft=1,polish=1"
    assert [stage["stage"] for stage in result["stages"]] == ["draft", "polish"]  # as the sync answer has them
    # Its rows are the interactive call's: the flow's (billed, the sum of its stages' GPU-seconds) and one per stage.
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    request_id = result["request_id"]
    sql = (f"SELECT * FROM {table} WHERE request_id = '{request_id}' OR flow_request_id = '{request_id}' "
           f"ORDER BY stage_index")  # fmt: skip
    rows = query_rows(bigquery, sql, 3, timeout=60)
    own = next(row for row in rows if row["stage"] is None)
    staged = [row for row in rows if row["stage"] is not None]
    assert (own["model"], own["flow"], own["endpoint"], own["batch_job_id"]) == (
        "relay-across", "relay-across", "batch", batch["id"],
    )  # fmt: skip
    assert [(row["stage"], row["model"]) for row in staged] == [("draft", "relay-draft"), ("polish", "relay-polish")]
    assert all(row["gpu_seconds"] is not None and row["flow_request_id"] == request_id for row in staged)
    assert staged[0]["gpu_seconds"] > 0  # the draft sleeps 0.3 s: the flow is billed for it, not a fallback guess
    assert own["gpu_seconds"] == pytest.approx(sum(row["gpu_seconds"] for row in staged), rel=1e-6)
    [error] = output(stack, auth_headers, batch["id"], "errors")
    code, message = predict_error(stack, auth_headers, refused)
    assert code == 422 and (error["custom_id"], error["error"]["code"], error["error"]["message"]) == (
        "flow-bad", code, message,
    )  # fmt: skip
