"""`GET /v1/models` shows each model's memory plan (contract/memory_plan.py) from the API, which has no torch."""

from __future__ import annotations

import requests

from contract.hardware import GIB


def test_the_model_listing_shows_each_models_memory_plan(stack, auth_headers):
    response = requests.get(f"{stack.api_url}/v1/models", headers=auth_headers, timeout=10)
    assert response.status_code == 200, response.text
    models = {model["name"]: model for model in response.json()["models"]}
    flux = models["flux-schnell"]["memory_plan"]
    # The local stack serves FLUX.1 unquantized (contract/models.local.yaml): its plan is bf16 on an 80 GB card.
    assert (flux["architecture"], flux["hardware"]) == ("flux.1-schnell", "a100-80")
    assert flux["components"]["transformer"]["dtype"] == "bfloat16"
    assert flux["components"]["text_encoder"]["dtype"] == "bfloat16"
    assert flux["activation_at"] == {"batch": 4, "width": 1024, "height": 1024}
    assert 31 * GIB < flux["weights_bytes"] < 32 * GIB  # FLUX.1's 31.4 GiB in bf16 (diffusers' quantization blog)
    assert flux["total_bytes"] == flux["weights_bytes"] + flux["activation_bytes"] < 79 * GIB
    # FLUX.1 Kontext in its worker (one process): both bf16 copies count; flux-schnell-cached (FLUX.1 [schnell]'s
    # own weights with a step cache) is served from the same loaded components.
    assert flux["worker_deployment"]["fits"]
    assert flux["worker_deployment"]["models"] == ["flux-schnell", "flux-kontext", "flux-schnell-cached"]
    # Two versions in one worker: their weights add up.
    versions = models["flux-versions"]["memory_plan"]["worker_deployment"]
    assert versions["weights_bytes"] == 2 * models["flux-versions"]["memory_plan"]["weights_bytes"]
    assert models["noop"]["memory_plan"] is None
