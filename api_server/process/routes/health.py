"""Liveness and readiness for Cloud Run and the local stack."""

from __future__ import annotations

from flask import Blueprint, jsonify
from spectree import Response

from api_server.core.errors import ApiError
from api_server.process.openapi import PUBLIC, Health, Ready, documented, errors
from api_server.process.readiness import READINESS_CACHE_SECONDS, Readiness
from api_server.process.state import app_state

__all__ = ["READINESS_CACHE_SECONDS", "Readiness", "bp"]
bp = Blueprint("health", __name__)


@bp.get("/healthz")
@documented(Response(HTTP_200=Health), security=PUBLIC, tags=["operations"])
def healthz():
    """Liveness"""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
@documented(Response(HTTP_200=Ready, **errors(503)), security=PUBLIC, tags=["operations"])
def readyz():
    """Readiness: 503 naming what is missing unless Redis, the topics and the log table are there"""
    state = app_state()
    readiness = state.lazy.setdefault("readiness", Readiness(state))
    problems = readiness.problems()
    if problems:
        raise ApiError(503, "not ready: " + "; ".join(problems), headers={"Retry-After": "2"})
    return jsonify({"status": "ready", "reply_mode": state.waiter.mode, "models": state.catalog.names()})
