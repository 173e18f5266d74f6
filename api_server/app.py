"""The Flask app factory: settings in, app out; nothing connects at import time."""

from __future__ import annotations

import logging

from flask import Flask, g, request

from api_server.errors import register_error_handlers
from api_server.routes import health, models, predict
from api_server.services import Services, build_services
from contract.settings import Settings

log = logging.getLogger("api_server")


def create_app(settings: Settings | None = None, services: Services | None = None) -> Flask:
    settings = settings or Settings.from_env()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json.sort_keys = False
    app.extensions["maas"] = services or build_services(settings)
    register_error_handlers(app)
    for blueprint in (health.bp, models.bp, predict.bp):
        app.register_blueprint(blueprint)

    @app.after_request
    def _access_log(response):
        if request.path not in ("/healthz", "/readyz"):
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
                        },
                        "request_id": g.get("request_id"),
                        "logging.googleapis.com/trace": request.headers.get("X-Cloud-Trace-Context", "").split("/")[0]
                        or None,
                    }
                },
            )
        return response

    return app
