"""Every error leaves the API as one JSON shape: {"error": {"code", "message", "field"?, "request_id"?}}."""

from __future__ import annotations

import logging

from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException

from api_server.core.redis_state import RedisPoolExhaustedError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.headers = headers or {}


def error_body(status: int, message: str, field: str | None = None, request_id: str | None = None) -> dict:
    body: dict = {"code": status, "message": message}
    if field:
        body["field"] = field
    if request_id:
        body["request_id"] = request_id
    return {"error": body}


def error_response(status: int, message: str, field: str | None = None, headers: dict | None = None):
    response = jsonify(error_body(status, message, field, g.get("request_id")))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(error: ApiError):
        return error_response(error.status, error.message, error.field, error.headers)

    @app.errorhandler(HTTPException)
    def _http_error(error: HTTPException):
        if error.code == 413:
            return error_response(413, f"request body exceeds {app.config['MAX_CONTENT_LENGTH']} bytes")
        # werkzeug's own headers (a 405's Allow) without its HTML content type
        headers = {name: value for name, value in error.get_headers() if name.lower() != "content-type"}
        if error.code == 405:
            return error_response(
                405, f"{request.method} is not allowed here; allowed: {headers.get('Allow')}", None, headers
            )
        return error_response(error.code or 500, error.description or error.name, None, headers)

    @app.errorhandler(RedisPoolExhaustedError)
    def _redis_pool_exhausted(error: RedisPoolExhaustedError):
        log.warning("%s", error)
        return error_response(503, str(error), None, {"Retry-After": "1"})

    @app.errorhandler(Exception)
    def _unexpected(error: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal error")
