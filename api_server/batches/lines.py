"""The input file as a stream of lines, and a line's validation: exactly the predict route's.

`read_lines` reads a binary stream in fixed chunks from a byte offset, yielding each line with the offset just
past it (the resume point recorded in Redis), so memory stays at one chunk plus one line whatever the file's
size; a line longer than the limit is skipped to its end and reported, never held whole.

A line's images (an instance's `image` and `mask`, a control's or an image prompt's `image`) are base64, as predict
takes them, or `gs://` URIs under the key's batch input locations (`inline_images`): read and put inline before the
line is validated, so it is checked as the same line sent inline would be.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import BinaryIO

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.flows.serving import FlowService
from api_server.predict.inference import PreparedRequest
from api_server.predict.serving import ServingStage

CHUNK_BYTES = 256 * 1024
MAX_CUSTOM_ID_LENGTH = 256
LINE_FIELDS = ("custom_id", "model", "instances", "parameters")


@dataclass(frozen=True)
class Line:
    number: int  # 1-based
    end_offset: int  # the byte just past this line's newline: where a resumed feeder starts
    data: bytes | None  # None: longer than the limit (skipped)
    start_offset: int = 0  # where the line's bytes begin (the blank lines before it skipped)
    refused: ApiError | None = None  # a table row that is not a line (`tables.row_line`): an error line as it is


def read_lines(stream: BinaryIO, start_offset: int, start_number: int, max_line_bytes: int) -> Iterator[Line]:
    """Lines from `start_offset` (the stream is positioned there by the caller), numbered after `start_number`;
    blank lines are skipped but counted in the offsets."""
    partial, offset, number, too_long = b"", start_offset, start_number, False  # `offset`: where `partial` begins
    long_began = start_offset
    while chunk := stream.read(CHUNK_BYTES):
        data, start = partial + chunk, 0
        while (newline := data.find(b"\n", start)) >= 0:
            raw, began, end = data[start:newline], offset + start, offset + newline + 1
            start = newline + 1
            if too_long:
                too_long, number = False, number + 1
                yield Line(number, end, None, long_began)
            elif raw.strip():
                number += 1
                yield Line(number, end, raw if len(raw) <= max_line_bytes else None, began)
        offset, partial = offset + start, data[start:]
        if len(partial) > max_line_bytes:
            if not too_long:
                long_began = offset
            offset, partial, too_long = offset + len(partial), b"", True  # refused as it comes, never held whole
    if too_long or partial.strip():
        number += 1
        began = long_began if too_long else offset
        yield Line(number, offset + len(partial), None if too_long or len(partial) > max_line_bytes else partial, began)


def line_request_id(batch_id: str, custom_id: str) -> str:
    """Deterministic per (batch, custom_id): a line published again is the same request, answered once by the
    worker's result store."""
    return f"{batch_id}-{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


def custom_id_digest(custom_id: str) -> str:
    return hashlib.sha256(custom_id.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class InvalidLine:
    custom_id: str | None
    error: ApiError


def custom_id_of(data: bytes | None) -> str | None:
    """The line's custom_id when it has a usable one (for its error line), else None."""
    if data is None:
        return None
    try:
        value = json.loads(data).get("custom_id")
    except (ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, str) and 0 < len(value) <= MAX_CUSTOM_ID_LENGTH else None


# Reads one image named by URI: (uri, field, max_bytes) -> its bytes, or an ApiError (`BatchInputPolicy.read_image`).
ImageReader = Callable[[str, str, int], bytes]


def image_fields(payload: dict) -> Iterator[tuple[dict, str, str]]:
    """Every place a line names an image: (the object holding it, its key, the field's name in errors)."""
    instances = payload.get("instances")
    for index, instance in enumerate(instances if isinstance(instances, list) else []):
        for key in ("image", "mask"):
            if isinstance(instance, dict) and key in instance:
                yield instance, key, f"instances.{index}.{key}"
    parameters = payload.get("parameters")
    for group in ("controls", "image_prompts"):
        entries = parameters.get(group) if isinstance(parameters, dict) else None
        for index, entry in enumerate(entries if isinstance(entries, list) else []):
            if isinstance(entry, dict) and "image" in entry:
                yield entry, "image", f"parameters.{group}.{index}.image"


def inline_images(payload: dict, read: ImageReader, room: int) -> None:
    """Each image the line names by `gs://` URI, read and put in its place as base64: the line as if sent inline,
    so its images take no more than `room` bytes as base64 (the line limit less the line), as inline ones would."""
    for holder, key, field in image_fields(payload):
        value = holder[key]
        if not isinstance(value, str) or not value.startswith("gs://"):
            continue  # base64 (or not a string): predict's checks judge it
        room += len(value)  # the URI's place in the line becomes the image's
        data = read(value, field, max(room, 0) * 3 // 4)
        holder[key] = base64.b64encode(data).decode("ascii")
        room -= len(holder[key])


def validate_line(
    serving: ServingStage,
    flows: FlowService | None,
    batch_id: str,
    line: Line,
    caller: Caller,
    max_line_bytes: int,
    read_image: ImageReader | None = None,
) -> PreparedRequest | InvalidLine:
    """The line as the predict route would take its body: the same checks in the same order (model or flow, then
    body), the same status and message; a batch line's own rules (custom_id, no priority, no webhook) first. Its
    images named by `gs://` URI are read by `read_image` (`inline_images`); without one, such a URI is refused as
    predict refuses it."""
    if line.refused is not None:
        return InvalidLine(custom_id_of(line.data), line.refused)
    if line.data is None:
        return InvalidLine(None, ApiError(413, f"request body exceeds {max_line_bytes} bytes"))
    try:
        payload = json.loads(line.data)
    except (ValueError, RecursionError):
        return InvalidLine(None, ApiError(400, "body must be a JSON object (Content-Type: application/json)"))
    if not isinstance(payload, dict):
        return InvalidLine(None, ApiError(400, "body must be a JSON object (Content-Type: application/json)"))
    custom_id = payload.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_LENGTH:
        message = f"custom_id: a string of 1 to {MAX_CUSTOM_ID_LENGTH} characters, unique in the batch"
        return InvalidLine(None, ApiError(422, message, "custom_id"))
    try:
        unknown = sorted(set(payload) - set(LINE_FIELDS))
        if unknown:
            raise ApiError(422, f"{unknown[0]}: not a batch line field; expected {', '.join(LINE_FIELDS)}", unknown[0])
        if not isinstance(payload.get("model"), str):
            raise ApiError(422, "model: a model of GET /v1/models", "model")
        parameters = payload.get("parameters", {})
        if isinstance(parameters, dict) and "priority" in parameters:
            raise ApiError(422, "parameters.priority: a batch line runs at batch priority", "parameters.priority")
        request_id = line_request_id(batch_id, custom_id)
        if flows is not None and (flow := flows.get(payload["model"])) is not None:
            # A flow: each stage's unit chosen as the predict route chooses it (api_server/flows/serving.py).
            call = flows.call(flow, request_id, caller)
            spec, options = call.spec, {"flow": call}
        else:
            spec, options = serving.model(payload["model"], request_id, caller), {}
        if read_image is not None:  # once the model is known: a line for no model reads nothing
            inline_images(payload, read_image, max_line_bytes - len(line.data))
        body = {key: payload[key] for key in ("instances", "parameters") if key in payload}
        prepared = serving.prepare(spec, body, request_id, caller, **options)
    except ApiError as error:
        return InvalidLine(custom_id, error)
    return replace(prepared, priority="batch", payload=None)
