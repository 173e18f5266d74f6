"""GET /v1/status: each model's load as admission sees it (waiting by priority, held, rate, predicted wait), the
numbers the local status page (`/status`) draws as a small chart per model."""

from __future__ import annotations

from flask import Blueprint, jsonify
from pydantic import BaseModel, Field
from spectree import Response

from api_server.core.errors import ApiError
from api_server.process.openapi import documented, errors
from api_server.process.routes.access import authenticated
from api_server.process.state import app_state

bp = authenticated(Blueprint("status", __name__))


class ModelLoad(BaseModel):
    model: str
    model_version: str
    admission: bool = Field(description="admission by predicted wait is on for it (the catalog's `admission`)")
    waiting: dict[str, int] = Field(description="requests published and not yet taken by a worker, by priority")
    held: int = Field(description="requests its workers hold: running, or next in a worker's hands")
    workers: int = Field(
        description="its ready workers (each says so while it serves); before any says so, the most workers seen "
        "holding its requests at once lately"
    )
    answered_per_second: float = Field(description="requests answered per second over MAAS_ADMISSION_WINDOW_SECONDS")
    rate_per_second: float | None = Field(description="the rate admission divides by (None: not known yet)")
    run_seconds: float | None = Field(
        description="its recent call time per request, a busy worker's gaps between calls included (None: no reply "
        "seen yet)"
    )
    run_spread_seconds: float = Field(description="the mean deviation of that call time (admission's margin)")
    predicted_start_seconds: float | None = Field(description="the wait a normal-priority request would have now")


class FleetStatus(BaseModel):
    models: list[ModelLoad]


@bp.get("/v1/status")
@documented(Response(HTTP_200=FleetStatus, **errors(401, 503)), tags=["models"])
def status():
    """The fleet's load

    Per served model (each version of a versioned one): what admission by predicted wait reads from Redis."""
    state = app_state()
    if state.admission is None:
        raise ApiError(503, "status unavailable: no admission state in this process")
    return jsonify({"models": state.admission.fleet(state.catalog.units())})
