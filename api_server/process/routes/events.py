"""GET /v1/jobs/<id>/events: a job's status as Server-Sent Events, until its one terminal event."""

from __future__ import annotations

import threading

from flask import Blueprint, Response, request
from pydantic import BaseModel, Field
from pydantic.json_schema import SkipJsonSchema
from spectree import Response as SpecResponse

from api_server.core import metrics
from api_server.core.errors import ApiError
from api_server.jobs.events import (
    InvalidLastEventIdError,
    JobEventStream,
    JobWatchHub,
    StreamCursor,
    async_job_event_stream,
    job_event_stream,
)
from api_server.jobs.service import job_view
from api_server.process.openapi import documented, errors
from api_server.process.routes.access import authenticated, caller
from api_server.process.state import AppState, app_state
from api_server.process.wsgi_bridge import ASYNC_BODY
from contract.outcomes import FINISHED_JOB_STATES

bp = authenticated(Blueprint("events", __name__))
_hub_lock = threading.Lock()
EVENT_STREAM = "text/event-stream; charset=utf-8"


class EventStreamHeaders(BaseModel):
    """The request header a reconnecting EventSource sends."""

    last_event_id: str | SkipJsonSchema[None] = Field(
        default=None,
        alias="Last-Event-ID",
        max_length=16,
        description="the last event's id: the stream resumes after it (`end`: nothing is left, 204)",
    )


@bp.get("/v1/jobs/<job_id>/events")
@documented(
    SpecResponse("HTTP_200", "HTTP_204", **errors(401, 404, 422, 503)), headers=EventStreamHeaders, tags=["jobs"]
)
def job_events(job_id: str):
    """Stream a job's status (Server-Sent Events)

    `text/event-stream`: `queued` (id `0`; `position` is null, Pub/Sub does not tell it), `running` (id
    = the step, at most about four a second), then exactly one terminal event with id `end`: `succeeded`
    (with `result`), `failed` or `expired` (with `error`), `cancelled`, or `deadline` when the job outlived
    its deadline without ending; then the stream closes. Each event's data is the job as `GET /v1/jobs/{id}`
    shows it. A comment line every 15 s keeps an idle stream open. Reconnecting with `Last-Event-ID`
    resumes after that event; after `end` the answer is 204 (an EventSource stops reconnecting)."""
    try:
        cursor = StreamCursor.from_last_event_id(request.headers.get("Last-Event-ID"))
    except InvalidLastEventIdError as exc:
        raise ApiError(422, str(exc), "Last-Event-ID") from None
    state = app_state()
    job = state.serving.job(job_id, caller())
    if cursor.ended:
        return Response(status=204)
    jobs, predictions = state.jobs, state.inference.predictions
    metrics.JOB_STATES.labels(job.status).inc()

    def view(state):  # the body streams outside the request context: nothing here reads current_app
        return job_view(state, predictions)

    hub, stream = job_hub(state), JobEventStream(job, cursor, view)

    def read_job():
        return jobs.get(job_id, None)

    if job.status not in FINISHED_JOB_STATES:
        # Under gunicorn (`api_server/process/asgi.py`) the body is served on the event loop, so a watcher holds no
        # thread; a plain WSGI server iterates the generator below instead.
        request.environ[ASYNC_BODY] = lambda: async_job_event_stream(hub, stream, read_job)
    body = job_event_stream(hub, stream, read_job)
    headers = {"Content-Type": EVENT_STREAM, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # A bare iterable, not a Response: spectree's wrapper reads a Response's whole body (`get_data`).
    return body, 200, headers


@bp.after_request
def _keep_streaming(response: Response) -> Response:
    """Hooks that ask for the length (the access line) would otherwise read the whole stream first."""
    if response.content_type == EVENT_STREAM:
        response.implicit_sequence_conversion = False
    return response


def job_hub(state: AppState) -> JobWatchHub:
    """This process's hub, made on the first stream (after gunicorn forked: its thread is this worker's)."""
    hub = state.lazy.get("job_hub")
    if hub is None:
        with _hub_lock:
            hub = state.lazy.setdefault("job_hub", JobWatchHub(state.jobs))
    return hub
