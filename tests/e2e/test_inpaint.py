"""Inpainting everywhere a request goes, against the real stack: `GET /v1/models` says what a model takes, the CLI's
`maas inpaint`, and a batch of inpaint lines (images and masks inline, as predict takes them, or by gs:// URI)."""

from __future__ import annotations

import base64
import io
import uuid

import pytest
import requests
from PIL import Image

from contract import google_clients, naming
from contract.settings import api_key_digest
from tests.conftest import TEST_API_KEYS, png_b64
from tests.e2e.test_batches import create, output, wait
from tests.e2e.test_sdk_cli import run_cli

pytestmark = pytest.mark.stack


def mask_png(size=(64, 64), box=(16, 16, 48, 48)) -> bytes:
    mask = Image.new("L", size, 0)
    mask.paste(255, box)
    buffer = io.BytesIO()
    mask.save(buffer, format="PNG")
    return buffer.getvalue()


def test_models_say_what_each_instance_takes(stack, auth_headers):
    listed = requests.get(f"{stack.api_url}/v1/models", headers=auth_headers, timeout=10).json()["models"]
    inputs = {model["name"]: model["inputs"] for model in listed}
    assert inputs["sd15-inpaint"] == inputs["sdxl-inpaint"] == inputs["flux-fill"] == ["prompt", "image", "mask"]
    assert inputs["sd15-img2img"] == inputs["flux-kontext"] == ["prompt", "image"]
    assert inputs["sd15-txt2img"] == ["prompt"]


@pytest.mark.parametrize("model", ["sdxl-inpaint", "flux-fill"])
def test_sdxl_and_flux_fill_inpaint_as_sd15_does(stack, auth_headers, model):
    """The same mask contract on the other inpaint families' tiny pipelines (in SD 3.5's local worker)."""
    body = {"instances": [{"prompt": "a window", "image": png_b64(64, 64, noise=True),
                           "mask": base64.b64encode(mask_png()).decode()}],
            "parameters": {"width": 64, "height": 64, "num_inference_steps": 2, "seed": 3}}  # fmt: skip
    response = requests.post(f"{stack.api_url}/v1/models/{model}:predict", json=body, headers=auth_headers, timeout=120)
    assert response.status_code == 200, response.text
    (prediction,) = response.json()["predictions"]
    assert Image.open(io.BytesIO(base64.b64decode(prediction["image_b64"]))).size == (64, 64)


def test_cli_inpaint_writes_the_repainted_image(stack, tmp_path):
    image, mask = tmp_path / "photo.png", tmp_path / "mask.png"
    image.write_bytes(base64.b64decode(png_b64(64, 64, noise=True)))
    mask.write_bytes(mask_png())
    out = tmp_path / "out"
    done = run_cli(stack, "inpaint", str(image), str(mask), f"a door {uuid.uuid4().hex}", "--size", "64x64",
                   "--steps", "2", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (path,) = sorted(out.glob("*.png"))
    assert Image.open(path).size == (64, 64)


def test_a_batch_of_inpaint_lines_answers_each_line_and_refuses_a_bad_mask(stack, auth_headers, settings):
    image = png_b64(64, 64, noise=True)
    masks = [mask_png(box=(0, 0, 32, 32)), mask_png(box=(32, 32, 64, 64)), mask_png(size=(32, 32))]
    lines = [
        {"custom_id": f"inpaint-{index}", "model": "sd15-inpaint",
         "instances": [{"prompt": f"line {index}", "image": image, "mask": base64.b64encode(mask).decode()}],
         "parameters": {"width": 64, "height": 64, "num_inference_steps": 2, "seed": index}}
        for index, mask in enumerate(masks)
    ]  # fmt: skip
    # The image and mask by gs:// URI, under the key's own prefix of the batch inputs bucket; a missing one fails its
    # line alone.
    inputs = google_clients.storage_client(settings).bucket(naming.batch_input_bucket(settings.project_id))
    prefix = f"{api_key_digest(TEST_API_KEYS[0])[:12]}/inpaint-{uuid.uuid4().hex[:8]}/"
    inputs.blob(f"{prefix}photo.png").upload_from_string(base64.b64decode(image), content_type="image/png")
    inputs.blob(f"{prefix}mask.png").upload_from_string(mask_png(), content_type="image/png")
    by_uri = {"image": f"gs://{inputs.name}/{prefix}photo.png", "mask": f"gs://{inputs.name}/{prefix}mask.png"}
    lines.append({**lines[0], "custom_id": "inpaint-gs", "instances": [{"prompt": "by uri", **by_uri}]})
    missing = {**by_uri, "mask": f"gs://{inputs.name}/{prefix}missing.png"}
    lines.append({**lines[0], "custom_id": "inpaint-missing", "instances": [{"prompt": "no mask", **missing}]})
    batch = create(stack, auth_headers, requests=lines)
    final = wait(stack, auth_headers, batch["id"], timeout=180)
    assert final["request_counts"]["succeeded"] == 3 and final["request_counts"]["failed"] == 2, final
    results = output(stack, auth_headers, batch["id"], "results")
    assert sorted(item["custom_id"] for item in results) == ["inpaint-0", "inpaint-1", "inpaint-gs"]
    assert all(len(item["images"]) == 1 for item in results)
    errors = {item["custom_id"]: item["error"] for item in output(stack, auth_headers, batch["id"], "errors")}
    assert errors["inpaint-2"]["code"] == 422 and "mask" in errors["inpaint-2"]["message"]
    assert (errors["inpaint-missing"]["code"], errors["inpaint-missing"]["field"]) == (422, "instances.0.mask")
    assert "is not a readable object in this key's batch input locations" in errors["inpaint-missing"]["message"]
