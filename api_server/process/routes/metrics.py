"""GET /metrics: Prometheus exposition (see `api_server.core.metrics` for the multiprocess setup)."""

from __future__ import annotations

from flask import Blueprint, Response
from spectree import Response as SpecResponse

from api_server.core import metrics
from api_server.process.openapi import PUBLIC, documented

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
@documented(SpecResponse("HTTP_200"), security=PUBLIC, tags=["operations"])
def exposition():
    """Prometheus metrics (text exposition format)"""
    body, content_type = metrics.exposition()
    return Response(body, content_type=content_type)
