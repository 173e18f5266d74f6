"""The running worker's side of the wire contract: deadlines, at-least-once redelivery, malformed input."""

from __future__ import annotations

import base64
import time
import uuid

import pytest
import redis

from api_server.predict.reply_waiter import PerRequestReplyWaiter
from chaos.malformed_images import MALFORMED_IMAGES
from contract import google_clients, naming
from contract.messages import (
    GenerationParameters,
    InferenceReply,
    InferenceRequest,
    Payload,
    RequestInstance,
    request_attributes,
)
from contract.stores.results import ResultStore
from tests.conftest import png_b64

pytestmark = pytest.mark.stack
MODEL = "sd15-txt2img"


def make_request(request_id: str) -> InferenceRequest:
    params = GenerationParameters(seed=3, num_inference_steps=2, guidance_scale=7.5, width=64, height=64)
    return InferenceRequest(
        request_id=request_id,
        model=MODEL,
        model_version="1",
        instances=[RequestInstance(prompt="contract")],
        parameters=params,
    )


def send_and_wait(
    settings, request_id: str, data: bytes, attributes: dict[str, str], timeout: float = 30, model: str = MODEL
) -> InferenceReply | None:
    results = ResultStore(redis.Redis.from_url(settings.redis_url), 60)
    waiter = PerRequestReplyWaiter(google_clients.subscriber_client(), settings.project_id, results)
    publisher = google_clients.publisher_client()
    pending = waiter.expect(request_id)
    try:
        publisher.publish(
            publisher.topic_path(settings.project_id, naming.request_topic(model)), data, **attributes
        ).result(10)
        return pending.wait(timeout)
    finally:
        pending.close()


def attributes_for(settings, request: InferenceRequest, deadline_ms: int) -> dict[str, str]:
    replies = f"projects/{settings.project_id}/topics/{naming.REPLIES_TOPIC}"
    return request_attributes(request, replies, deadline_ms)


def test_request_past_its_deadline_is_answered_expired_without_running(stack, settings):
    request = make_request(uuid.uuid4().hex)
    reply = send_and_wait(
        settings, request.request_id, request.model_dump_json().encode(), attributes_for(settings, request, 1)
    )
    assert reply is not None and reply.status == "expired"
    assert reply.inference_ms == 0 and reply.predictions == []


def test_redelivered_request_is_answered_once(stack, settings):
    request = make_request(uuid.uuid4().hex)
    attributes = attributes_for(settings, request, int((time.time() + 60) * 1000))
    first = send_and_wait(settings, request.request_id, request.model_dump_json().encode(), attributes)
    second = send_and_wait(settings, request.request_id, request.model_dump_json().encode(), attributes)
    assert first is not None and first.status == "ok"
    # The stored reply is republished: same image bytes and the first run's own timing, so no second run.
    assert second == first


def test_malformed_request_gets_an_error_reply_not_silence(stack, settings):
    request_id = uuid.uuid4().hex
    attributes = attributes_for(settings, make_request(request_id), int((time.time() + 60) * 1000))
    reply = send_and_wait(settings, request_id, b'{"not": "a request"}', attributes)
    assert reply is not None and reply.status == "error"
    assert "malformed request" in reply.error


# Each refused by a check the worker did not make before (CRCs, frames, format, a text chunk's limit).
MALFORMED_AT_THE_WORKER = [
    "png: zTXt inflating past the text limit, before IDAT",
    "png: wrong IDAT CRC",
    "png: animated, 3 frames",
    "gif: a format the models do not take",
]


def test_a_malformed_image_fails_its_request_alone_with_a_clear_reply(stack, settings):
    """Images the API would refuse, published straight to the worker: each gets a `bad_input` reply naming the
    problem, and the worker goes on to answer a good image-to-image request."""
    for name in [*MALFORMED_AT_THE_WORKER, None]:
        image = png_b64(64, 64) if name is None else base64.b64encode(MALFORMED_IMAGES[name]()).decode()
        request = make_request(uuid.uuid4().hex).model_copy(
            update={
                "model": "sd15-img2img",
                "instances": [RequestInstance(prompt="fuzz", image=Payload(b64=image))],
                "parameters": make_request("x").parameters.model_copy(update={"strength": 0.5}),
            }
        )
        attributes = attributes_for(settings, request, int((time.time() + 60) * 1000))
        data = request.model_dump_json().encode()
        reply = send_and_wait(settings, request.request_id, data, attributes, model="sd15-img2img")
        assert reply is not None, name
        if name is None:
            assert reply.status == "ok" and len(reply.predictions) == 1
        else:
            assert (reply.status, reply.error_kind) == ("error", "bad_input"), (name, reply)
            assert reply.error.startswith("input image: ") and reply.inference_ms == 0, (name, reply.error)
