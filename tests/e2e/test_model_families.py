"""SDXL and FLUX.1 on the local stack: predict, jobs with progress, the family's 422s, rows with the family.

The tiny pipelines of each family are served by their own workers exactly as SD 1.5's: real Pub/Sub, Redis,
GCS-downloaded weights and BigQuery rows.
"""

from __future__ import annotations

import random
import uuid

import pytest
import requests

from tests.conftest import query_rows
from tests.e2e.test_job_events import events, open_stream, submit

pytestmark = pytest.mark.stack
NEW_FAMILIES = {"sdxl-txt2img": "sdxl", "flux-schnell": "flux"}


def predict(stack, auth_headers, model: str, **parameters) -> requests.Response:
    body = {"instances": [{"prompt": f"family {uuid.uuid4().hex}"}], "parameters": {"width": 64, "height": 64,
                                                                                     **parameters}}  # fmt: skip
    return requests.post(f"{stack.api_url}/v1/models/{model}:predict", json=body, headers=auth_headers, timeout=90)


@pytest.mark.parametrize("model", list(NEW_FAMILIES))
def test_each_new_family_answers_predict_and_logs_its_family(stack, auth_headers, bigquery, settings, model):
    seed = random.randrange(10**6)
    response = predict(stack, auth_headers, model, seed=seed, num_inference_steps=3)
    assert response.status_code == 200, response.text
    prediction = response.json()["predictions"][0]
    assert prediction["seed"] == seed and prediction["image_b64"]
    request_id = response.headers["X-Request-Id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    rows = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=60)
    assert len(rows) == 1
    assert (rows[0]["status"], rows[0]["model"], rows[0]["model_family"]) == ("ok", model, NEW_FAMILIES[model])


# The 2025-2026 families (issue 52), served by the stack's tiny pipelines: FLUX.2 [klein] from the SDXL worker,
# Z-Image-Turbo and Qwen-Image from one worker of their own.
FAMILIES_2026 = {"z-image-turbo": "zimage", "flux2-klein": "flux2-klein", "qwen-image": "qwenimage",
                 "z-image-img2img": "zimage", "qwen-image-img2img": "qwenimage", "flux2-klein-9b": "flux2-klein"}  # fmt: skip


def png_b64(size: int = 64) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 120, 40)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("model", list(FAMILIES_2026))
def test_each_2026_family_answers_predict_with_its_bigquery_row(stack, auth_headers, bigquery, settings, model):
    seed = random.randrange(10**6)
    parameters = {"seed": seed, "num_inference_steps": 2}
    if model.startswith("qwen-image"):  # its classifier-free guidance, with a negative prompt
        parameters.update(guidance_scale=3.0, negative_prompt="blurry")
    if model.endswith("img2img"):
        body = {"instances": [{"prompt": f"family {uuid.uuid4().hex}", "image": png_b64()}],
                "parameters": {"width": 64, "height": 64, "strength": 0.6, **parameters}}  # fmt: skip
        response = requests.post(f"{stack.api_url}/v1/models/{model}:predict", json=body, headers=auth_headers,
                                 timeout=90)  # fmt: skip
    else:
        response = predict(stack, auth_headers, model, **parameters)
    assert response.status_code == 200, response.text
    prediction = response.json()["predictions"][0]
    assert prediction["seed"] == seed and prediction["image_b64"]
    request_id = response.headers["X-Request-Id"]
    table = f"`{settings.project_id}.{settings.dataset}.{settings.log_table}`"
    rows = query_rows(bigquery, f"SELECT * FROM {table} WHERE request_id = '{request_id}'", 1, timeout=60)
    assert len(rows) == 1
    assert (rows[0]["status"], rows[0]["model"], rows[0]["model_family"]) == ("ok", model, FAMILIES_2026[model])


def test_the_2026_distilled_families_refuse_guidance_and_negative_prompts(stack, auth_headers):
    for model in ("z-image-turbo", "flux2-klein"):
        for parameters, field in (({"guidance_scale": 3.5}, "parameters.guidance_scale"),
                                  ({"negative_prompt": "blurry"}, "parameters.negative_prompt"),
                                  ({"width": 72}, "parameters.width")):  # fmt: skip
            response = predict(stack, auth_headers, model, **parameters)
            assert response.status_code == 422, (model, parameters, response.text)
            assert response.json()["error"]["field"] == field


@pytest.mark.parametrize("model", list(NEW_FAMILIES))
def test_each_new_family_runs_a_job_with_progress_events(stack, auth_headers, model):
    # Long enough on the tiny pipelines (about a second) for several progress ticks.
    steps, size = (8, 256) if model == "flux-schnell" else (40, 128)
    job_id = submit(stack, model, auth_headers, f"job {uuid.uuid4().hex}", num_inference_steps=steps, seed=5,
                    width=size, height=size)  # fmt: skip
    with open_stream(stack, job_id, auth_headers) as response:
        assert response.status_code == 200
        seen = list(events(response))
    kinds = [kind for kind, _, _ in seen]
    assert kinds[-1] == "succeeded", kinds
    steps_seen = [data["progress"]["step"] for kind, _, data in seen if kind == "running"]
    assert steps_seen and steps_seen == sorted(set(steps_seen)) and max(steps_seen) <= steps
    assert seen[-1][2]["result"]["predictions"][0]["seed"] == 5


def test_the_family_rules_are_422s_naming_the_field(stack, auth_headers):
    cases = [
        ("flux-schnell", {"width": 72}, "parameters.width"),
        ("flux-schnell", {"negative_prompt": "blurry"}, "parameters.negative_prompt"),
        ("flux-schnell", {"guidance_scale": 3.5}, "parameters.guidance_scale"),
    ]
    for model, parameters, field in cases:
        response = predict(stack, auth_headers, model, **parameters)
        assert response.status_code == 422, (model, parameters, response.text)
        assert response.json()["error"]["field"] == field


# (FLUX.2 [klein]'s tiny adapter moves its tiny image by about the tolerance: its oracle is the unit test's.)
@pytest.mark.parametrize("model", ["sdxl-txt2img", "flux-schnell", "sd35-txt2img", "z-image-turbo", "qwen-image"])
def test_each_family_serves_an_adapter_as_diffusers_own_lora_loading_applies_it(stack, auth_headers, model):
    """The adapter `make up` registers for the model, through the API, the queue and the worker, equals the
    diffusers pipeline given the same file with `load_lora_weights` and `set_adapters`."""
    import base64
    import io

    import numpy as np
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image
    from safetensors.torch import load_file

    from emulators.tiny_pipeline import ADAPTER_VERSION

    seed, prompt, scale = random.randrange(10**6), f"adapter {uuid.uuid4().hex}", 0.8
    parameters = {"seed": seed, "num_inference_steps": 3, "adapters": [{"name": "tiny-ink", "scale": scale}]}
    if model not in ("flux-schnell", "z-image-turbo"):  # distilled: no guidance
        parameters["guidance_scale"] = 4.0
    body = {"instances": [{"prompt": prompt}], "parameters": {"width": 64, "height": 64, **parameters}}
    response = requests.post(f"{stack.api_url}/v1/models/{model}:predict", json=body, headers=auth_headers,
                             timeout=90)  # fmt: skip
    assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()["predictions"][0]["image_b64"])
    served = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)

    pipeline = DiffusionPipeline.from_pretrained(stack.tiny_model_dir / model)
    adapter = (
        stack.tiny_model_dir / "adapters" / model / "tiny-ink" / ADAPTER_VERSION / "pytorch_lora_weights.safetensors"
    )
    pipeline.load_lora_weights(load_file(adapter), adapter_name="tiny-ink")
    pipeline.set_adapters(["tiny-ink"], [scale])
    call = {k: v for k, v in parameters.items() if k in ("num_inference_steps", "guidance_scale")}
    if model == "flux-schnell":
        call["max_sequence_length"] = 256  # [schnell]'s T5 length, as its reference code and the worker run it
    if model == "qwen-image":  # its true_cfg_scale, with the model card's " " as the negative prompt
        call.update(true_cfg_scale=call.pop("guidance_scale"), guidance_scale=None, negative_prompt=" ")
    if model == "z-image-turbo":
        call["guidance_scale"] = 0.0
    reference = pipeline(prompt=prompt, width=64, height=64, generator=torch.Generator().manual_seed(seed),
                         output_type="np", **call).images[0]  # fmt: skip
    pipeline.disable_lora()
    base = pipeline(prompt=prompt, width=64, height=64, generator=torch.Generator().manual_seed(seed),
                    output_type="np", **call).images[0]  # fmt: skip
    assert np.abs(served - np.round(reference * 255)).max() <= 3, "the served image is not diffusers' own"
    assert np.abs(served - np.round(base * 255)).max() > 3, "the adapter changed nothing"


def test_the_model_list_shows_each_family(stack, auth_headers):
    response = requests.get(f"{stack.api_url}/v1/models", headers=auth_headers, timeout=10)
    families = {model["name"]: (model["family"], model["guidance"]) for model in response.json()["models"]}
    assert families["sd15-txt2img"] == ("sd15", "cfg")
    assert families["sdxl-txt2img"] == ("sdxl", "cfg")
    assert families["flux-schnell"] == ("flux", "none")


def test_a_versioned_model_under_step_scheduling_serves_each_version_pinned_and_through_the_split(stack, auth_headers):
    # Each version's worker steps on its own runner (keyed `{model}--{version}`): the defect that killed the
    # worker at its first step looked the runner up by the model's name.
    base = f"{stack.api_url}/v1/models/flux-versions"
    for version in ("1", "2"):
        body = {"instances": [{"prompt": f"pinned {uuid.uuid4().hex}"}], "parameters": {"num_inference_steps": 2}}
        response = requests.post(f"{base}/versions/{version}:predict", json=body, headers=auth_headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model_version"] == version
    served = set()
    for _ in range(20):  # a 50/50 split: both versions answer (all 20 on one version: p = 2e-6)
        body = {"instances": [{"prompt": f"split {uuid.uuid4().hex}"}], "parameters": {"num_inference_steps": 2}}
        response = requests.post(f"{base}:predict", json=body, headers=auth_headers, timeout=60)
        assert response.status_code == 200, response.text
        served.add(response.json()["model_version"])
    assert served == {"1", "2"}
