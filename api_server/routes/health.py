"""Liveness and readiness for Cloud Run and the local stack."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify

from api_server.errors import ApiError

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    services = current_app.extensions["maas"]
    try:
        services.redis.ping()
    except Exception as exc:  # noqa: BLE001 - any Redis failure means not ready
        raise ApiError(503, f"redis unavailable: {type(exc).__name__}") from exc
    return jsonify({"status": "ready", "reply_mode": services.waiter.mode, "models": services.catalog.names()})
