"""GET /metrics: Prometheus exposition (see `api_server.metrics` for the multiprocess setup)."""

from __future__ import annotations

from flask import Blueprint, Response

from api_server import metrics

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def exposition():
    body, content_type = metrics.exposition()
    return Response(body, content_type=content_type)
