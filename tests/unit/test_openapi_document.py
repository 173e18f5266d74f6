"""The OpenAPI document as `/openapi.json` serves it, made from the routes without a running stack."""

from __future__ import annotations

from flask import Flask

from api_server.process.app import BLUEPRINTS, ModelNameConverter
from api_server.process.openapi import ADMIN_ONLY, openapi_document


def documented_operations() -> dict[str, dict]:
    """The API's operations by label (`PUT /v1/models/{model}/traffic`), from the document the routes make."""
    app = Flask(__name__)
    app.url_map.converters["model"] = ModelNameConverter
    for blueprint in BLUEPRINTS:
        app.register_blueprint(blueprint)
    with app.app_context():
        document = openapi_document(["noop"])
    return {f"{method.upper()} {path}": op for path, ops in document["paths"].items() for method, op in ops.items()}


def test_the_admin_operations_say_they_take_an_admin_key():
    admin = {label for label, operation in documented_operations().items() if operation.get("security") == [ADMIN_ONLY]}
    assert admin == {
        "PUT /v1/models/{model}/traffic", "DELETE /v1/models/{model}/traffic", "PUT /v1/models/{model}/adapters/{name}",
        "PUT /v1/models/{model}/controls/{name}",
    }  # fmt: skip


def test_an_operation_checking_its_query_documents_its_422():
    operations = documented_operations()
    assert "422" in operations["GET /v1/jobs"]["responses"]  # a bad limit, state or cursor
    assert "422" not in operations["GET /v1/models"]["responses"]  # it takes no input to refuse
