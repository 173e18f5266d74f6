"""The Flask app factory: settings in, app out; nothing connects at import time."""

from __future__ import annotations

import logging
import time
import uuid

from flask import Flask, g, request
from werkzeug.routing import BaseConverter

from api_server import metrics
from api_server.chunked import ChunkedBodyReader
from api_server.errors import register_error_handlers
from api_server.routes import docs, events, health, jobs, models, playground, predict, usage
from api_server.routes import metrics as metrics_routes
from api_server.services import Services, build_services
from api_server.serving import build_serving
from api_server.tracing import trace_from_headers
from contract.jsonlog import bind_context, unbind_context
from contract.settings import Settings

log = logging.getLogger("api_server")


class ModelNameConverter(BaseConverter):
    regex = "[^/:]+"


def create_app(settings: Settings | None = None, services: Services | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json.sort_keys = False
    # A model name never holds ':', so GET /v1/models/noop:predict is the predict path's 405, not a 404 model.
    app.url_map.converters["model"] = ModelNameConverter
    services = services or build_services(settings)
    app.extensions["maas"] = services
    app.extensions["maas_serving"] = build_serving(settings, services)
    register_error_handlers(app)
    app.wsgi_app = ChunkedBodyReader(app.wsgi_app, settings.max_request_bytes)
    for blueprint in (
        health.bp,
        models.bp,
        predict.bp,
        jobs.bp,
        events.bp,
        usage.bp,
        playground.bp,
        metrics_routes.bp,
        docs.bp,
    ):
        app.register_blueprint(blueprint)

    @app.before_request
    def _start():
        g.request_id = uuid.uuid4().hex
        g.started = time.perf_counter()
        # Every line logged while this request is handled carries its id and trace (contract/jsonlog.py).
        trace = trace_from_headers(request.headers)
        fields = {"request_id": g.request_id, **(trace.log_fields(settings.project_id) if trace else {})}
        g.log_context = bind_context(fields)

    @app.teardown_request
    def _end(_error):
        if (token := g.pop("log_context", None)) is not None:
            unbind_context(token)

    @app.after_request
    def _measure(response):
        response.headers.setdefault("X-Request-Id", g.get("request_id", ""))
        route = request.url_rule.rule.replace("<model:model>", "<model>") if request.url_rule else "unmatched"
        if route != "/metrics":
            metrics.REQUESTS.labels(route, request.method, str(response.status_code)).inc()
            metrics.LATENCY.labels(route).observe(time.perf_counter() - g.get("started", time.perf_counter()))
        return response

    @app.after_request
    def _access_log(response):
        if request.path not in ("/healthz", "/readyz"):
            latency = time.perf_counter() - g.get("started", time.perf_counter())
            log.info(
                "%s %s %d",
                request.method,
                request.path,
                response.status_code,
                extra={
                    "fields": {
                        "httpRequest": {
                            "requestMethod": request.method,
                            "requestUrl": request.path,
                            "status": response.status_code,
                            "responseSize": str(response.calculate_content_length() or 0),
                            "latency": f"{latency:.6f}s",
                        },
                    }
                },
            )
        return response

    return app
