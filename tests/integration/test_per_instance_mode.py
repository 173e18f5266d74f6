"""The API in per-instance reply mode, served by the stack's real workers."""

from __future__ import annotations

import base64

import pytest

from api_server.process.app import create_app
from api_server.process.state import app_state
from contract.settings import Settings

pytestmark = pytest.mark.stack


def test_per_instance_mode_answers_each_request_with_its_own_reply(stack, auth_headers):
    settings = Settings.from_env({**stack.service_env(), "MAAS_REPLY_MODE": "per-instance"})
    app = create_app(settings)
    try:
        client = app.test_client()
        assert client.get("/readyz").get_json()["reply_mode"] == "per-instance"
        images = {}
        for seed in (21, 22, 21):
            response = client.post(
                "/v1/models/sd15-txt2img:predict",
                json={
                    "instances": [{"prompt": "routed"}],
                    "parameters": {"seed": seed, "num_inference_steps": 2, "width": 64, "height": 64},
                },
                headers=auth_headers,
            )
            assert response.status_code == 200, response.get_data(as_text=True)
            body = response.get_json()
            assert body["predictions"][0]["seed"] == seed
            images.setdefault(seed, set()).add(base64.b64decode(body["predictions"][0]["image_b64"]))
        assert len(images[21]) == 1 and images[21] != images[22]
    finally:
        app_state(app).close()
