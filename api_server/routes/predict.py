"""POST /v1/models/<model>:predict: validate, queue, wait, answer; one inference log row whatever happens."""

from __future__ import annotations

import base64
import time
import uuid
from datetime import UTC, datetime

from flask import Blueprint, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from api_server.dispatch import DispatchTimings
from api_server.errors import ApiError
from api_server.inference_log import InferenceLogRow
from api_server.schemas import decode_input_image, parse_body, resolve_parameters
from contract.messages import InferenceRequest, RequestInstance
from contract.payloads import PayloadError

bp = Blueprint("predict", __name__)

REPLY_STATUS_HTTP = {"ok": 200, "expired": 504, "error": 500, "cancelled": 409}


@bp.post("/v1/models/<model>:predict")
def predict(model: str):
    services = current_app.extensions["maas"]
    started = time.perf_counter()
    g.request_id = uuid.uuid4().hex
    row = InferenceLogRow(
        request_id=g.request_id,
        created_at=datetime.now(UTC),
        model=model[:128],
        status="error",
        http_status=500,
        api_instance=services.settings.instance_id,
        cache_hit=False,
    )
    try:
        response = _predict(services, model, row, started)
        row.status, row.http_status = "ok", 200
        return response
    except ApiError as error:
        row.http_status, row.status, row.error = error.status, _log_status(error.status), error.message[:1024]
        raise
    except HTTPException as error:  # raised by Flask itself, e.g. 413 while reading the body
        row.http_status, row.status, row.error = error.code or 500, _log_status(error.code or 500), error.name
        raise
    finally:
        row.total_ms = round((time.perf_counter() - started) * 1000, 2)
        services.inference_log.write(row)


def _log_status(http_status: int) -> str:
    return {504: "timeout", 503: "unavailable"}.get(http_status, "rejected" if http_status < 500 else "error")


def _predict(services, model: str, row: InferenceLogRow, started: float):
    row.api_key_id = services.auth.authenticate(request)
    spec = services.catalog.get(model)
    if spec is None:
        raise ApiError(404, f"unknown model {model!r}; GET /v1/models lists them")
    row.model_version, row.task = spec.version, spec.task
    payload = request.get_json(silent=True)
    if payload is None:
        raise ApiError(400, "body must be a JSON object (Content-Type: application/json)")
    body = parse_body(payload)
    params = resolve_parameters(body, spec)
    row.num_images, row.width, row.height = len(body.instances), params.width, params.height
    row.num_inference_steps, row.seed = params.num_inference_steps, params.seed
    instances = []
    for index, instance in enumerate(body.instances):
        image = None
        if instance.image:
            raw = decode_input_image(instance.image, f"instances.{index}.image")
            image = services.payloads.pack(
                raw, f"inputs/{g.request_id}/{index}", content_type="application/octet-stream"
            )
        instances.append(RequestInstance(prompt=instance.prompt, image=image))
    inference_request = InferenceRequest(
        request_id=g.request_id, model=spec.name, model_version=spec.version, instances=instances, parameters=params
    )
    timings = DispatchTimings()
    reply = services.dispatcher.run(inference_request, spec, timings)
    row.worker_id, row.queue_ms, row.inference_ms = reply.worker_id, reply.queue_ms, reply.inference_ms
    if reply.status != "ok":
        raise ApiError(REPLY_STATUS_HTTP[reply.status], reply.error or f"model worker answered {reply.status}")
    response = jsonify(
        {
            "predictions": [_prediction_json(services, prediction) for prediction in reply.predictions],
            "model": spec.name,
            "model_version": spec.version,
            "request_id": g.request_id,
            "timings_ms": {
                "total": round((time.perf_counter() - started) * 1000, 2),
                "queue": round(reply.queue_ms, 2),
                "inference": round(reply.inference_ms, 2),
                "subscribe": timings.subscribe_ms,
                "publish": timings.publish_ms,
                "wait": timings.wait_ms,
                "cleanup": timings.cleanup_ms,
            },
        }
    )
    response.headers["X-Request-Id"] = g.request_id
    return response


def _prediction_json(services, prediction) -> dict:
    try:
        png = services.payloads.unpack(prediction.image)
    except PayloadError as exc:
        raise ApiError(500, f"result unavailable: {exc}") from exc
    return {
        "image_b64": base64.b64encode(png).decode("ascii"),
        "mime_type": "image/png",
        "seed": prediction.seed,
        "width": prediction.width,
        "height": prediction.height,
    }
