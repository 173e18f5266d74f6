"""Inference requests over HTTP: POST /v1/models/<model>:predict and POST /v1/models/<model>/jobs.

Only HTTP lives here: which mode the caller asked for, the JSON body and its headers in; the serving stage's
`Answer` out as bytes. Around each request, in order: its log row is opened (so refusals are logged too),
the caller authenticated, the model chosen and the key's limits applied before the body is read; after
it, the lease is released and the records stage closes the row.
"""

from __future__ import annotations

from flask import Blueprint, Response, g, request

from api_server.core.errors import ApiError
from api_server.inference_log.records import InferenceCall
from api_server.predict.schemas import PredictBody
from api_server.predict.serving import Answer, Mode
from api_server.process.openapi import INFERENCE_RESPONSES, InferenceHeaders, documented
from api_server.process.routes.access import authenticated, caller
from api_server.process.state import app_state

bp = Blueprint("predict", __name__)
JOB_ENDPOINT = "predict.submit_job"


@bp.before_request
def open_record() -> None:
    """The call's log row, opened before anything can refuse it (a 401 is logged too)."""
    model = (request.view_args or {}).get("model", "")
    g.inference = app_state().records.open(g.request_id, model, _mode(), started=g.started)


authenticated(bp)


@bp.before_request
def _admit() -> None:
    args = request.view_args or {}
    admit(args["model"], args.get("version"))


def admit(model: str, version: str | None = None) -> None:
    """The model (or flow, or pinned version) that serves the call, and the key's lease on it (or a 4xx)."""
    call: InferenceCall = g.inference
    call.caller = caller()
    serving = app_state().serving
    flows = app_state().flows
    if version is not None:
        call.spec = serving.pinned(model, version)
    elif flows is not None and (flow := flows.get(model)) is not None:
        # A flow: each stage's unit chosen as for a single call to its model; then served like a model.
        call.flow = flows.call(flow, g.request_id, call.caller)
        call.spec = call.flow.spec
    else:
        call.spec = serving.model(model, g.request_id, call.caller)
    call.lease = serving.admit(call.caller, call.spec)


@bp.after_request
def close_record(response: Response) -> Response:
    """The lease released and the call's log row closed, whatever the answer (a refusal included)."""
    call: InferenceCall = g.inference
    state = app_state()
    state.serving.release(call.lease)
    error = None
    if response.status_code >= 400 and response.is_json:
        error = (response.get_json(silent=True) or {}).get("error", {}).get("message")
    state.records.close(call, response.status_code, error)
    return response


@bp.post("/v1/models/<model:model>:predict")
@documented(INFERENCE_RESPONSES, json=PredictBody, headers=InferenceHeaders, tags=["inference"])
def predict(model: str):
    """Generate images

    Waits for the worker's reply: 200 with the images, or 202 with a job if the wait runs out (its body says
    how to poll it), or at once with `Prefer: respond-async` (always a job, like POST /jobs)."""
    return _serve()


@bp.post("/v1/models/<model:model>/versions/<model:version>:predict")
@documented(INFERENCE_RESPONSES, json=PredictBody, headers=InferenceHeaders, tags=["inference"])
def predict_version(model: str, version: str):
    """Generate images with one version

    Like :predict, on the version named whatever the model's traffic split (404 for a version it does not
    have)."""
    return _serve()


@bp.post("/v1/models/<model:model>/jobs")
@documented(INFERENCE_RESPONSES, json=PredictBody, headers=InferenceHeaders, tags=["jobs"])
def submit_job(model: str):
    """Submit a job

    Always answers 202 with a job and its `Location`: `queued`, or `succeeded` at once when the result cache
    already holds the answer (`X-Cache: hit`)."""
    return _serve()


def _mode() -> Mode:
    if request.endpoint == JOB_ENDPOINT or "respond-async" in request.headers.get("Prefer", "").lower():
        return Mode.JOB
    return Mode.SYNC


def _serve() -> Response:
    return _render(serve(_json_body()))


def serve(payload: object) -> Answer:
    """A predict body (`payload`) served for the admitted call: validated, then answered by the serving stage."""
    call: InferenceCall = g.inference
    state = app_state()
    serving = state.serving
    call.prepared = serving.prepare(
        call.spec,
        payload,
        g.request_id,
        call.caller,
        idempotency_key=request.headers.get("Idempotency-Key"),
        fresh="no-cache" in request.headers.get("Cache-Control", "").lower(),
        received=call.started,
        arrived_ms=call.arrived_ms,
        pinned="version" in (request.view_args or {}),
        log_row=lambda: state.records.pending_row(call),
        flow=call.flow,
    )
    call.answer = serving.answer(call.prepared, call.mode)
    return call.answer


def _json_body() -> object:
    try:
        payload = request.get_json(silent=True)
    except RecursionError:  # nested deeper than the parser's recursion limit
        raise ApiError(400, "body: JSON nested too deeply") from None
    if payload is None:
        raise ApiError(400, "body must be a JSON object (Content-Type: application/json)")
    return payload


def _render(answer: Answer) -> Response:
    record = answer.record
    response = Response(record.body, status=record.status, headers=record.headers)
    if answer.cache:
        response.headers["X-Cache"] = answer.cache
    return response
