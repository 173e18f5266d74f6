"""The OpenAI Images API over HTTP: POST /v1/images/generations (JSON) and POST /v1/images/edits (multipart).

The same path as :predict (`predict.py`'s hooks: the log row opened first, the key authenticated, then the model
admitted under the key's limits, served by the serving stage, the row closed); only the body's shape and the
answer's differ (`api_server/predict/openai_images.py`). The model is named in the body, so it is admitted once
the body is read, after authentication. Every error here, whoever raises it, is in OpenAI's shape.
"""

from __future__ import annotations

import base64
import json
import logging

from flask import Blueprint, Response, g, jsonify, request
from spectree import Response as Documented
from werkzeug.exceptions import HTTPException

from api_server.core.errors import ApiError
from api_server.inference_log.records import InferenceCall
from api_server.predict.openai_images import (
    EDIT_FILE_PARTS,
    ImageEditForm,
    ImageGenerationBody,
    ImagesCall,
    OpenAIErrorResponse,
    OpenAIImagesResponse,
    edit_call,
    form_values,
    generation_call,
    images_response,
    openai_error,
)
from api_server.predict.serving import Answer
from api_server.process.openapi import JobAccepted, documented
from api_server.process.routes import predict
from api_server.process.routes.access import authenticated
from api_server.process.state import app_state

log = logging.getLogger(__name__)
bp = Blueprint("images", __name__)
bp.before_request(predict.open_record)
authenticated(bp)
bp.after_request(predict.close_record)

IMAGES_RESPONSES = Documented(
    HTTP_200=OpenAIImagesResponse,
    HTTP_202=JobAccepted,
    **{f"HTTP_{status}": OpenAIErrorResponse for status in (400, 401, 403, 404, 409, 413, 422, 429, 500, 503, 504)},
)


@bp.post("/v1/images/generations")
@documented(IMAGES_RESPONSES, json=ImageGenerationBody, tags=["openai"])
def generations():
    """Generate images (OpenAI Images API)

    OpenAI's `images.generate` on a text-to-image model of `GET /v1/models`: the same limits, cache and billing
    as :predict. Errors in OpenAI's shape."""
    try:
        payload = request.get_json(silent=True)
    except RecursionError:
        raise ApiError(400, "body: JSON nested too deeply") from None
    return _answered(generation_call(payload))


@bp.post("/v1/images/edits")
@documented(IMAGES_RESPONSES, form=ImageEditForm, tags=["openai"])
def edits():
    """Edit an image (OpenAI Images API)

    OpenAI's `images.edit`, multipart/form-data: `image` (PNG, JPEG or WebP), `prompt`, `model`, and optionally
    `mask`, `n`, `size` (default: the image's own), `response_format`. Without a mask, an image-to-image model
    redraws the image, or an edit model (FLUX.1 Kontext) changes it as the prompt says; with one, an inpaint model
    repaints the mask's fully transparent pixels (OpenAI's convention; a mask without transparency is read as
    white = repaint). Errors in OpenAI's shape."""
    if not request.mimetype.startswith("multipart/form-data"):
        raise ApiError(400, "body must be multipart/form-data (image, prompt, model, ...)")
    files: dict[str, list[bytes]] = {}
    for name, part in request.files.items(multi=True):
        if name not in EDIT_FILE_PARTS:
            raise ApiError(422, f"{name}: not a part this route takes (image, mask)", name)
        files.setdefault(name, []).append(part.read())
    return _answered(edit_call(form_values(request.form.to_dict(flat=False)), files))


def _answered(images: ImagesCall) -> Response:
    call: InferenceCall = g.inference
    call.row.model = images.model[:128]
    predict.admit(images.model)
    answer = predict.serve(images.payload)
    return _render(answer, images)


def _render(answer: Answer, images: ImagesCall) -> Response:
    record = answer.record
    body, headers = record.body, dict(record.headers)
    if record.status == 200:
        links = None
        if images.response_format == "url":
            pngs = [base64.b64decode(item["image_b64"]) for item in json.loads(body)["predictions"]]
            links = app_state().result_links.links(g.request_id, pngs)
        body = json.dumps(images_response(body, links)).encode()
    elif record.status >= 400:
        error = json.loads(body).get("error", {})
        body = json.dumps(openai_error(record.status, error.get("message", ""), error.get("field"))).encode()
    response = Response(body, status=record.status, headers=headers)
    if answer.cache:
        response.headers["X-Cache"] = answer.cache
    return response


@bp.errorhandler(ApiError)
def _api_error(error: ApiError):
    response = jsonify(openai_error(error.status, error.message, error.field))
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


@bp.errorhandler(HTTPException)
def _http_error(error: HTTPException):
    status = error.code or 500
    message = error.description or error.name
    if status == 413:
        message = f"request body exceeds {app_state().settings.max_request_bytes} bytes"
    response = jsonify(openai_error(status, message, None))
    response.status_code = status
    return response
