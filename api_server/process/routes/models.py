"""The model catalog as clients see it, and a model's traffic split (changed by admin keys only)."""

from __future__ import annotations

from flask import Blueprint, jsonify, request
from spectree import Response

from api_server.core.errors import ApiError
from api_server.process.openapi import ADMIN_ONLY, ModelDetail, ModelList, TrafficBody, TrafficView, documented, errors
from api_server.process.routes.access import authenticated, require_admin
from api_server.process.state import app_state
from contract.model_spec import TASK_INPUTS

bp = authenticated(Blueprint("models", __name__))


def _public(spec, versions) -> dict:
    """A model as every listing shows it: its stable version's settings, and every live version's name."""
    return {
        "name": spec.name,
        "version": spec.version,
        "versions": [version.version for version in versions],
        "task": spec.task,
        "inputs": list(TASK_INPUTS[spec.task]),
        "family": spec.family.name if spec.family else None,
        "guidance": spec.guidance_mode,
        "size_multiple": spec.family.size_multiple if spec.family else 8,
        "max_instances_per_request": spec.max_instances_per_request,
        "request_timeout_seconds": spec.request_timeout_seconds,
        "defaults": spec.defaults.model_dump(exclude_none=True),
        "limits": spec.limits.model_dump(),
        "memory_plan": app_state().catalog.memory_plan(spec),
        "control_kinds": list(spec.family.controls) if spec.controls is not None and spec.family else [],
    }


@bp.get("/v1/models")
@documented(Response(HTTP_200=ModelList, **errors(401)), tags=["models"])
def list_models():
    """The catalog: names, versions, tasks, defaults and limits; flows too, each with its stages"""
    state = app_state()
    views = (state.serving.model_view(name) for name in sorted(state.catalog.models))
    listed = [_public(stable, versions) for stable, versions, _ in views]
    if state.flows is not None:
        listed += [state.flows.view(state.flows.get(name)) for name in state.flows.names()]
    return jsonify({"models": listed})


@bp.get("/v1/models/<model:model>")
@documented(Response(HTTP_200=ModelDetail, **errors(401, 404, 503)), tags=["models"])
def get_model(model: str):
    """One model of the catalog, its versions and the traffic split in force (a flow: its stages)"""
    flows = app_state().flows
    if flows is not None and (flow := flows.get(model)) is not None:
        view = flows.view(flow)
        return jsonify({**view, "stable_version": view["version"], "sticky": None, "traffic": None})
    state = app_state()
    stable, versions, split = state.serving.model_view(model)
    rollout = state.catalog.rollout(model)
    controls = state.controls.listing(stable) if stable.controls is not None and state.controls else []
    return jsonify(
        {
            **_public(stable, versions),
            "stable_version": stable.version,
            "sticky": rollout.sticky if rollout else None,
            "traffic": split,
            "controls": [record.model_dump() for record in controls],
        }
    )


@bp.put("/v1/models/<model:model>/traffic")
@documented(
    Response(HTTP_200=TrafficView, **errors(400, 401, 403, 404, 409, 422, 503)),
    json=TrafficBody,
    tags=["models"],
    security=ADMIN_ONLY,
)
def put_traffic(model: str):
    """Set a model's traffic split (admin key)

    In force on every API process within about a second, audited in BigQuery; DELETE returns to the
    catalog's split (also the one-call rollback)."""
    admin = require_admin(f"PUT /v1/models/{model}/traffic")
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object {traffic, shadow, reason} (Content-Type: application/json)")
    return jsonify(app_state().serving.set_traffic(model, body, admin.key_id))


@bp.delete("/v1/models/<model:model>/traffic")
@documented(Response(HTTP_200=TrafficView, **errors(401, 403, 404, 409, 503)), tags=["models"], security=ADMIN_ONLY)
def delete_traffic(model: str):
    """Return a model to the catalog's traffic split (admin key)"""
    admin = require_admin(f"DELETE /v1/models/{model}/traffic")
    return jsonify(app_state().serving.reset_traffic(model, admin.key_id))
