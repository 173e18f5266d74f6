"""The Flask app factory: settings in, app out; nothing connects at import time."""

from __future__ import annotations

import time
import uuid

from flask import Flask, g, request
from werkzeug.routing import BaseConverter

from api_server.core.errors import register_error_handlers
from api_server.inference_log import records
from api_server.process.chunked import ChunkedBodyReader
from api_server.process.routes import (
    adapters,
    batches,
    controls,
    docs,
    events,
    health,
    images,
    jobs,
    models,
    playground,
    predict,
    usage,
)
from api_server.process.routes import metrics as metrics_routes
from api_server.process.routes import status as status_routes
from api_server.process.state import AppState, build_app_state, install
from api_server.process.wsgi_bridge import EVERY_RESPONSE_HEADERS, RECEIVED_AT
from contract.jsonlog import bind_context, unbind_context
from contract.settings import Settings
from contract.tracing import reset_current_trace, set_current_trace, trace_from_headers


class ModelNameConverter(BaseConverter):
    regex = "[^/:]+"


# Every route of the API, in the order they are registered (their views also make the OpenAPI document).
BLUEPRINTS = (
    health.bp,
    models.bp,
    adapters.bp,
    controls.bp,
    predict.bp,
    images.bp,
    jobs.bp,
    batches.bp,
    events.bp,
    usage.bp,
    status_routes.bp,
    playground.bp,
    metrics_routes.bp,
    docs.bp,
)


def create_app(settings: Settings | None = None, state: AppState | None = None) -> Flask:
    """The app with its state built and started; `app_state(app).close()` stops it (gunicorn's worker_exit)."""
    settings = settings or Settings.from_env()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json.sort_keys = False
    # A model name never holds ':', so GET /v1/models/noop:predict is the predict path's 405, not a 404 model.
    app.url_map.converters["model"] = ModelNameConverter
    state = state or build_app_state(settings)
    install(app, state)
    register_error_handlers(app)
    app.wsgi_app = ChunkedBodyReader(app.wsgi_app, settings.max_request_bytes)
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)

    @app.before_request
    def _start():
        g.request_id = uuid.uuid4().hex
        # From when the request was whole, before it waited for a thread (wsgi_bridge.py): its deadline runs from then.
        g.started = request.environ.get(RECEIVED_AT) or time.perf_counter()
        # Every line logged while this request is handled carries its id and trace (contract/jsonlog.py).
        trace = trace_from_headers(request.headers)
        fields = {"request_id": g.request_id, **(trace.log_fields(settings.project_id) if trace else {})}
        g.log_context = bind_context(fields)
        g.trace_context = set_current_trace(trace)  # carried to the worker on the request message

    @app.teardown_request
    def _end(_error):
        if (token := g.pop("log_context", None)) is not None:
            unbind_context(token)
        if (token := g.pop("trace_context", None)) is not None:
            reset_current_trace(token)

    @app.after_request
    def _record(response):
        response.headers.setdefault("X-Request-Id", g.get("request_id", ""))
        for name, value in EVERY_RESPONSE_HEADERS:
            response.headers.setdefault(name, value)
        started = g.get("started", time.perf_counter())
        records.count_request(request, response, started)
        records.access_line(request, response, started)
        return response

    state.start()
    return app
