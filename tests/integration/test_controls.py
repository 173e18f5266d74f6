"""Control models (ControlNets, IP-Adapters) on the real stack: registered by an admin against the tiny SD 1.5
pipeline's own UNet in the model bucket (the GCS emulator), hostile files refused with their reason, listed in
`GET /v1/models/{model}`."""

from __future__ import annotations

import pytest
import requests

from contract import google_clients, naming
from emulators.tiny_controls import control_files
from tests.conftest import TEST_ADMIN_KEY, query_rows

pytestmark = pytest.mark.stack
MODEL = "sd15-txt2img"


@pytest.fixture(scope="module")
def bucket(settings):
    return google_clients.storage_client(settings).bucket(settings.model_bucket)


@pytest.fixture(scope="module")
def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}


def upload(bucket, name: str, files: dict[str, bytes], version: str = "1") -> None:
    for file, data in files.items():
        bucket.blob(naming.control_prefix(MODEL, name, version) + file).upload_from_string(data)


def register(stack, headers, name: str, kind: str, version: str = "1") -> requests.Response:
    return requests.put(f"{stack.api_url}/v1/models/{MODEL}/controls/{name}", json={"kind": kind, "version": version},
                        headers=headers, timeout=60)  # fmt: skip


def test_control_models_are_registered_by_an_admin_listed_and_hostile_files_refused(stack, auth_headers, admin, bucket):
    from safetensors.torch import load, save

    # The tiny ControlNet and IP-Adapter `make up` built for this model, registered again under other names.
    built = stack.tiny_model_dir / "controls" / MODEL
    controlnet = control_files(built / "tiny-edges" / "1")
    ip_adapter = control_files(built / "tiny-style" / "1")
    upload(bucket, "fresh-edges", controlnet)
    upload(bucket, "fresh-style", ip_adapter)
    assert register(stack, auth_headers, "fresh-edges", "controlnet").status_code == 403
    for name, kind in (("fresh-edges", "controlnet"), ("fresh-style", "ip_adapter")):
        response = register(stack, admin, name, kind)
        assert response.status_code == 200, response.text
        assert response.json()["kind"] == kind
    detail = requests.get(f"{stack.api_url}/v1/models/{MODEL}", headers=auth_headers, timeout=30).json()
    listed = {control["name"]: control["kind"] for control in detail["controls"]}
    assert {"fresh-edges": "controlnet", "fresh-style": "ip_adapter"}.items() <= listed.items()

    weights = "diffusion_pytorch_model.safetensors"
    tensors = load(controlnet[weights])
    nan = {**tensors, "controlnet_mid_block.weight": tensors["controlnet_mid_block.weight"] * float("nan")}
    narrow = {**tensors, "conv_in.weight": tensors["conv_in.weight"][:16]}
    refused = {
        "nan-weights": ({**controlnet, weights: save(nan)}, "controlnet_mid_block.weight holds NaN"),
        "other-model": ({**controlnet, weights: save(narrow)}, "conv_in.weight is 16x4x3x3, the base UNet's is 32x4x3x3"),
        "truncated": ({**controlnet, weights: controlnet[weights][:-100]}, "truncated"),
        "pickled": ({**controlnet, "diffusion_pytorch_model.bin": b"\x80\x04"}, "pickle-format files are refused"),
    }  # fmt: skip
    for name, (files, reason) in refused.items():
        upload(bucket, name, files)
        response = register(stack, admin, name, "controlnet")
        assert response.status_code == 422, (name, response.text)
        assert reason in response.json()["error"]["message"], (name, response.text)
    for name, kind, version, field in (("a..b", "controlnet", "1", "name"), ("fresh-edges", "lora", "1", "kind"),
                                       ("fresh-edges", "controlnet", "..", "version"),
                                       ("never-uploaded", "controlnet", "1", "version")):  # fmt: skip
        response = register(stack, admin, name, kind, version)
        assert response.status_code == 422, (name, response.text)
        assert response.json()["error"]["field"] == field, response.text


def png_b64(seed: int, size: int = 64) -> str:
    """A control image: a bright square on black, somewhere by `seed` (edges for a ControlNet to follow)."""
    import base64
    import io

    from PIL import Image

    image = Image.new("RGB", (size, size))
    image.paste((255, 255, 255), (8 + seed % 16, 8, 40 + seed % 16, 40))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def predict(stack, headers, seed: int, controls=None, image_prompts=None) -> requests.Response:
    parameters = {"seed": seed, "width": 64, "height": 64, "num_inference_steps": 4}
    if controls is not None:
        parameters["controls"] = controls
    if image_prompts is not None:
        parameters["image_prompts"] = image_prompts
    body = {"instances": [{"prompt": "a lighthouse"}], "parameters": parameters}
    return requests.post(f"{stack.api_url}/v1/models/{MODEL}:predict", json=body,
                         headers={**headers, "Cache-Control": "no-cache"}, timeout=120)  # fmt: skip


def pixels(response: requests.Response):
    import base64
    import io

    import numpy as np
    from PIL import Image

    assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()["predictions"][0]["image_b64"])
    return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)


def test_a_controlnet_request_is_answered_beside_a_plain_one_and_its_row_names_the_control_model(
    stack, auth_headers, bigquery, settings
):
    """`make up`'s tiny ControlNet (tiny-edges) and tiny IP-Adapter (tiny-style) each steer a request served in the
    same running set as a plain request of the same seed; their BigQuery rows name the control model and its version;
    bad controls and image prompts are 422s naming the field."""
    import threading

    control = [{"name": "tiny-edges", "image": png_b64(1), "scale": 0.8, "preprocess": "canny"}]
    prompt = [{"name": "tiny-style", "image": png_b64(5), "scale": 0.6}]
    answers: dict[str, requests.Response] = {}

    def send(key: str, controls, image_prompts) -> None:
        answers[key] = predict(stack, auth_headers, 7, controls, image_prompts)

    asks = (("plain", None, None), ("controlled", control, None), ("prompted", None, prompt))
    threads = [threading.Thread(target=send, args=args) for args in asks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    plain, controlled = pixels(answers["plain"]), pixels(answers["controlled"])
    assert abs(plain - controlled).max() > 10  # the ControlNet steered it
    request_id = answers["controlled"].headers["X-Request-Id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    [row] = query_rows(bigquery, f"SELECT controls FROM {table} WHERE request_id = '{request_id}'", 1, timeout=30)
    assert row["controls"] == "tiny-edges@1:0.8"
    assert abs(plain - pixels(answers["prompted"])).max() > 10  # the image prompt steered it
    request_id = answers["prompted"].headers["X-Request-Id"]
    [row] = query_rows(bigquery, f"SELECT controls FROM {table} WHERE request_id = '{request_id}'", 1, timeout=30)
    assert row["controls"] == "tiny-style@1:0.6"
    for prompts, field in (([{"name": "nothing-here", "image": png_b64(2)}], "parameters.image_prompts.0.name"),
                           ([{"name": "tiny-edges", "image": png_b64(2)}], "parameters.image_prompts.0.name"),
                           ([{"name": "tiny-style", "image": png_b64(2), "scale": 9.0}],
                            "parameters.image_prompts.0.scale"),
                           ([{"name": "tiny-style", "image": "bm90IGFuIGltYWdl"}], "parameters.image_prompts.0.image")):  # fmt: skip
        response = predict(stack, auth_headers, 8, image_prompts=prompts)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["field"] == field, response.text
    for controls, field in (([{"name": "nothing-here", "image": png_b64(2)}], "parameters.controls.0.name"),
                            ([{"name": "tiny-edges", "image": png_b64(2), "scale": 9.0}], "parameters.controls.0.scale"),
                            ([{"name": "tiny-edges", "image": "bm90IGFuIGltYWdl"}], "parameters.controls.0.image"),
                            ([{"name": "tiny-edges", "image": png_b64(2), "preprocess": "depth"}],
                             "parameters.controls.0.preprocess")):  # fmt: skip
        response = predict(stack, auth_headers, 8, controls)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["field"] == field, response.text


def test_a_flux_controlnet_and_an_image_prompt_are_steered_by_make_ups_tiny_flux_control_models(stack, auth_headers):
    """FLUX.1 [schnell] takes ControlNets and image prompts too: `make up` registers a tiny FluxControlNetModel
    (tiny-edges) and a tiny FLUX.1 IP-Adapter (tiny-style) for it, each steering a request away from the same
    request without it."""
    body = {"instances": [{"prompt": "a lighthouse"}], "parameters": {"seed": 7, "width": 64, "height": 64}}
    controlled = {**body, "parameters": {**body["parameters"],
                                         "controls": [{"name": "tiny-edges", "image": png_b64(1), "scale": 0.8}]}}  # fmt: skip
    prompted = {**body, "parameters": {**body["parameters"],
                                       "image_prompts": [{"name": "tiny-style", "image": png_b64(3), "scale": 0.9}]}}  # fmt: skip
    url, headers = f"{stack.api_url}/v1/models/flux-schnell:predict", {**auth_headers, "Cache-Control": "no-cache"}
    plain, steered, styled = (pixels(requests.post(url, json=b, headers=headers, timeout=120))
                              for b in (body, controlled, prompted))  # fmt: skip
    assert abs(plain - steered).max() > 10
    assert abs(plain - styled).max() > 10


def test_a_batch_line_and_a_flows_stages_take_controls_as_predict_does(stack, auth_headers, bigquery, settings):
    """A batch line with `make up`'s tiny ControlNet is answered and its row names it; a line with a bad control is
    the predict route's own 422 in the errors file; sd15-hires takes it in both stages (each its model's
    registration), its flow row naming it."""
    import time

    control = {"name": "tiny-edges", "image": png_b64(3), "scale": 0.8}
    parameters = {"seed": 11, "width": 64, "height": 64, "num_inference_steps": 4}
    lines = [{"custom_id": "edges", "model": MODEL, "instances": [{"prompt": "a lighthouse"}],
              "parameters": {**parameters, "controls": [control]}},
             {"custom_id": "too-strong", "model": MODEL, "instances": [{"prompt": "a lighthouse"}],
              "parameters": {**parameters, "controls": [{**control, "scale": 9.0}]}}]  # fmt: skip
    created = requests.post(f"{stack.api_url}/v1/batches", json={"requests": lines}, headers=auth_headers, timeout=30)
    assert created.status_code == 200, created.text
    flow = requests.post(f"{stack.api_url}/v1/models/sd15-hires:predict", headers=auth_headers, timeout=120,
                         json={"instances": [{"prompt": "a lighthouse"}],
                               "parameters": {**parameters, "controls": [control]}})  # fmt: skip
    assert flow.status_code == 200, flow.text
    assert [stage["stage"] for stage in flow.json()["stages"]] == ["base", "hires"]
    batch = f"{stack.api_url}/v1/batches/{created.json()['id']}"
    deadline = time.monotonic() + 60
    while (view := requests.get(batch, headers=auth_headers, timeout=10).json())["status"] != "completed":
        assert time.monotonic() < deadline and view["status"] not in ("failed", "cancelled", "expired"), view
        time.sleep(0.2)
    [result] = _lines(requests.get(f"{batch}/results", headers=auth_headers, timeout=30))
    [error] = _lines(requests.get(f"{batch}/errors", headers=auth_headers, timeout=30))
    assert (result["custom_id"], result["status"], error["custom_id"]) == ("edges", "succeeded", "too-strong")
    assert error["error"]["code"] == 422 and "parameters.controls.0.scale" in error["error"]["message"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    ids = (result["request_id"], flow.headers["X-Request-Id"])
    rows = query_rows(bigquery, f"SELECT request_id, controls FROM {table} WHERE request_id IN {ids}", 2, timeout=30)
    assert {row["request_id"]: row["controls"] for row in rows} == dict.fromkeys(ids, "tiny-edges@1:0.8")


def _lines(response: requests.Response) -> list[dict]:
    import json

    assert response.status_code == 200, response.text
    return [json.loads(text) for text in response.text.splitlines()]
