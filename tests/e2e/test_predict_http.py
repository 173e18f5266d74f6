"""End to end over HTTP: the stack as `make up` starts it, real emulators, real workers, real images."""

from __future__ import annotations

import base64
import io
import socket

import pytest
import requests
from PIL import Image

from tests.conftest import png_b64, query_rows

pytestmark = pytest.mark.stack

TXT2IMG, IMG2IMG = "sd15-txt2img", "sd15-img2img"


def predict(stack, model: str, body, headers: dict, **kwargs) -> requests.Response:
    return requests.post(
        f"{stack.api_url}/v1/models/{model}:predict", json=body, headers=headers, timeout=120, **kwargs
    )


def decode_png(prediction: dict) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(prediction["image_b64"])))
    assert image.format == "PNG"
    return image


def test_text_to_image_returns_a_png_of_the_requested_size(stack, auth_headers):
    body = {
        "instances": [{"prompt": "a lighthouse at dawn"}],
        "parameters": {"seed": 7, "num_inference_steps": 4, "width": 64, "height": 96},
    }
    response = predict(stack, TXT2IMG, body, auth_headers)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["model"] == TXT2IMG and result["model_version"] == "1"
    assert result["request_id"] == response.headers["X-Request-Id"]
    assert set(result["timings_ms"]) >= {"total", "queue", "inference", "publish", "wait"}
    assert result["timings_ms"]["inference"] > 0
    [prediction] = result["predictions"]
    assert prediction["seed"] == 7
    assert decode_png(prediction).size == (64, 96)


def test_image_to_image_returns_a_png_of_the_requested_size(stack, auth_headers):
    body = {
        "instances": [{"prompt": "make it a watercolor", "image": png_b64(80, 80)}],
        "parameters": {"seed": 11, "num_inference_steps": 4, "width": 64, "height": 64, "strength": 0.5},
    }
    response = predict(stack, IMG2IMG, body, auth_headers)
    assert response.status_code == 200, response.text
    [prediction] = response.json()["predictions"]
    assert decode_png(prediction).size == (64, 64)


def test_large_image_to_image_output_travels_through_the_payload_bucket(stack, auth_headers, settings):
    # 512x512 noise PNGs exceed the inline limit, so the worker stores them in GCS and the API fetches them.
    body = {
        "instances": [{"prompt": "large", "image": png_b64(512, 512, noise=True)}],
        "parameters": {"seed": 5, "num_inference_steps": 2, "width": 512, "height": 512, "strength": 0.5},
    }
    response = predict(stack, IMG2IMG, body, auth_headers)
    assert response.status_code == 200, response.text
    [prediction] = response.json()["predictions"]
    assert decode_png(prediction).size == (512, 512)
    from contract import google_clients

    bucket = google_clients.storage_client(settings).bucket(settings.payload_bucket)
    request_id = response.json()["request_id"]
    stored = bucket.blob(f"results/{request_id}/0.png").download_as_bytes()
    assert stored == base64.b64decode(prediction["image_b64"])
    assert bucket.blob(f"inputs/{request_id}/0").exists()


def test_same_seeded_request_gives_byte_identical_images(stack, auth_headers):
    body = {
        "instances": [{"prompt": "same seed, same bytes"}],
        "parameters": {"seed": 1234, "num_inference_steps": 3, "width": 64, "height": 64},
    }
    first = predict(stack, TXT2IMG, body, auth_headers).json()["predictions"][0]["image_b64"]
    again = predict(stack, TXT2IMG, body, auth_headers)
    # What the docs promise (docs/guides/requests.md): the same bytes through the cache (a batch may move a pixel value by 1/255).
    assert again.headers.get("X-Cache") == "hit"
    second = again.json()["predictions"][0]["image_b64"]
    other = {**body, "parameters": {**body["parameters"], "seed": 1235}}
    third = predict(stack, TXT2IMG, other, auth_headers).json()["predictions"][0]["image_b64"]
    assert first == second
    assert first != third


def test_every_request_is_logged_to_bigquery(stack, auth_headers, bigquery, settings):
    small = {
        "instances": [{"prompt": "logged"}],
        "parameters": {"seed": 1, "num_inference_steps": 2, "width": 64, "height": 64},
    }
    responses = {
        ("ok", 200): predict(stack, TXT2IMG, small, auth_headers),
        ("rejected", 422): predict(stack, TXT2IMG, {"instances": [{}]}, auth_headers),
        ("rejected", 401): predict(stack, TXT2IMG, small, {"Authorization": "Bearer nope"}),
        ("rejected", 404): predict(stack, "no-such-model", small, auth_headers),
        ("rejected", 413): predict(
            stack, IMG2IMG, {"instances": [{"prompt": "x", "image": "A" * (9 << 20)}]}, auth_headers
        ),
    }
    ids = {}
    for (status, http_status), response in responses.items():
        assert response.status_code == http_status, response.text
        body = response.json()
        ids[body.get("request_id") or body["error"]["request_id"]] = (status, http_status)
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    id_list = ", ".join(f"'{request_id}'" for request_id in ids)
    rows = query_rows(
        bigquery,
        f"SELECT request_id, model, model_version, status, http_status, total_ms, inference_ms, worker_id, created_at "
        f"FROM {table} WHERE request_id IN ({id_list})",
        expected=len(ids),
    )
    assert {row["request_id"]: (row["status"], row["http_status"]) for row in rows} == ids
    [ok] = [row for row in rows if row["status"] == "ok"]
    assert ok["model"] == TXT2IMG and ok["model_version"] == "1" and ok["worker_id"]
    assert ok["inference_ms"] > 0 and ok["total_ms"] >= ok["inference_ms"]
    assert all(row["created_at"] is not None for row in rows)
    # The 401 and the 404 were refused before routing: no model version, so no model's usage below.
    assert {row["http_status"] for row in rows if row["model_version"] is None} == {401, 404}
    [usage] = query_rows(
        bigquery,
        "SELECT SUM(requests) AS requests, SUM(succeeded) AS succeeded, SUM(failed) AS failed "
        f"FROM `{settings.project_id}.{settings.dataset}.daily_usage_by_model` WHERE model = '{TXT2IMG}'",
        expected=1,
    )
    assert (
        usage["requests"] == usage["succeeded"] + usage["failed"] and usage["succeeded"] >= 1 and usage["failed"] >= 1
    )


def test_bad_json_is_400(stack, auth_headers):
    response = requests.post(
        f"{stack.api_url}/v1/models/{TXT2IMG}:predict",
        data="{not json",
        headers={**auth_headers, "Content-Type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_missing_prompt_is_422_naming_the_field(stack, auth_headers):
    response = predict(stack, TXT2IMG, {"instances": [{"negative": "x"}]}, auth_headers)
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "instances.0.prompt"


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (TXT2IMG, {"instances": []}, "instances"),
        (TXT2IMG, {"instances": [{"prompt": "x"}], "parameters": {"width": 100}}, "parameters.width"),
        (
            TXT2IMG,
            {"instances": [{"prompt": "x"}], "parameters": {"num_inference_steps": 500}},
            "parameters.num_inference_steps",
        ),
        (TXT2IMG, {"instances": [{"prompt": "x", "image": png_b64()}]}, "instances.0.image"),
        (IMG2IMG, {"instances": [{"prompt": "x"}]}, "instances.0.image"),
        (IMG2IMG, {"instances": [{"prompt": "x", "image": "not base64!"}]}, "instances.0.image"),
        (
            IMG2IMG,
            {"instances": [{"prompt": "x", "image": base64.b64encode(b"plain text").decode()}]},
            "instances.0.image",
        ),
    ],
)
def test_invalid_bodies_are_422_naming_the_field(stack, auth_headers, model, body, field):
    response = predict(stack, model, body, auth_headers)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_unknown_model_is_404(stack, auth_headers):
    response = predict(stack, "no-such-model", {"instances": [{"prompt": "x"}]}, auth_headers)
    assert response.status_code == 404
    assert "no-such-model" in response.json()["error"]["message"]


def test_every_answer_forbids_content_sniffing_a_404_and_gunicorns_own_refusals_too(stack, auth_headers):
    """Error bodies echo what the client sent (here a model name holding markup): no browser may sniff them."""
    not_found = predict(stack, "<b>no-such-model", {"instances": [{"prompt": "x"}]}, auth_headers)
    assert not_found.status_code == 404 and "<b>" in not_found.json()["error"]["message"]
    unauthorized = predict(stack, TXT2IMG, {"instances": [{"prompt": "x"}]}, {})
    models = requests.get(f"{stack.api_url}/v1/models", headers=auth_headers, timeout=10)
    health = requests.get(f"{stack.api_url}/healthz", timeout=5)
    for response in (not_found, unauthorized, models, health):
        assert response.headers.get("X-Content-Type-Options") == "nosniff", (response.status_code, response.headers)
    with socket.create_connection(("127.0.0.1", stack.api_port), timeout=10) as raw:
        raw.sendall(b"NOT AN HTTP REQUEST LINE\r\n\r\n")
        head = raw.recv(65536).split(b"\r\n\r\n")[0].decode("latin-1").lower()
    assert head.startswith("http/1.1 400") and "x-content-type-options: nosniff" in head, head


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Basic abc"}])
def test_missing_or_wrong_api_key_is_401(stack, headers):
    response = predict(stack, TXT2IMG, {"instances": [{"prompt": "x"}]}, headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_every_configured_key_is_accepted(stack):
    from tests.conftest import TEST_API_KEYS

    response = requests.get(
        f"{stack.api_url}/v1/models", headers={"Authorization": f"Bearer {TEST_API_KEYS[1]}"}, timeout=10
    )
    assert response.status_code == 200
    assert {model["name"] for model in response.json()["models"]} >= {TXT2IMG, IMG2IMG}


def test_oversized_body_is_413(stack, auth_headers):
    response = predict(stack, IMG2IMG, {"instances": [{"prompt": "x", "image": "A" * (9 * 1024 * 1024)}]}, auth_headers)
    assert response.status_code == 413


def test_health_endpoints(stack):
    assert requests.get(f"{stack.api_url}/healthz", timeout=5).status_code == 200
    ready = requests.get(f"{stack.api_url}/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json()["reply_mode"] == "per-request"
    # JSON (no charset parameter: RFC 8259), every non-ASCII character escaped, so no client misreads a reason.
    assert ready.headers["Content-Type"] == "application/json" and ready.content.isascii()


def test_an_image_whose_text_chunk_inflates_too_far_is_a_422_not_a_500(stack, auth_headers):
    from chaos.malformed_images import MALFORMED_IMAGES

    image = MALFORMED_IMAGES["png: zTXt inflating past the text limit, before IDAT"]()
    body = {"instances": [{"prompt": "x", "image": base64.b64encode(image).decode()}], "parameters": {"seed": 1}}
    response = predict(stack, IMG2IMG, body, auth_headers)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "instances.0.image"
