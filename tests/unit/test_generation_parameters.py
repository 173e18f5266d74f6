"""One generation-parameter type (`contract/generation.py`): the API's input model, the catalog's defaults, the
log row, the BigQuery schema and the worker's batch key all derive from it or agree with it."""

from __future__ import annotations

from dataclasses import fields

from api_server.inference_log.writer import InferenceLogRow
from api_server.predict.schemas import ParametersIn
from contract.generation import LOGGED_PARAMETERS, PER_CALL_PARAMETERS, ROLES, AdapterRef, GenerationParameters
from contract.log_schema import log_schema_fields
from contract.model_spec import GenerationDefaults
from model_worker.model.runners import batch_key

BIGQUERY_TYPES = {int: "INTEGER", float: "FLOAT", str: "STRING"}
PARAMS = GenerationParameters(seed=1, num_inference_steps=4, guidance_scale=7.5, width=64, height=64)


def test_every_parameter_has_one_role():
    assert list(ROLES) == list(GenerationParameters.model_fields)


def test_the_api_accepts_every_parameter_optionally_and_priority_and_outpaint_besides():
    accepted = ParametersIn.model_fields
    assert set(accepted) == set(ROLES) | {"priority", "outpaint", "image_prompts"}
    assert all(not field.is_required() for field in accepted.values())


def test_the_catalog_defaults_are_the_parameters_with_a_default_role():
    defaults = GenerationDefaults.model_fields
    assert set(defaults) == {name for name, role in ROLES.items() if role.default}
    assert {name for name, field in defaults.items() if field.is_required()} == {
        name for name, role in ROLES.items() if role.default == "required"
    }


def test_logged_parameters_are_log_row_fields_and_bigquery_columns_of_their_type():
    row_fields = {field.name for field in fields(InferenceLogRow)}
    columns = {column["name"]: column for column in log_schema_fields()}
    assert LOGGED_PARAMETERS and set(LOGGED_PARAMETERS) <= row_fields
    for name in LOGGED_PARAMETERS:
        annotation = GenerationParameters.model_fields[name].annotation
        assert columns[name]["type"] == BIGQUERY_TYPES[annotation], name


ADAPTER = AdapterRef(name="style", version="1", scale=0.8, sha256="0" * 64)


def test_requests_share_a_pipeline_call_unless_a_per_call_parameter_differs():
    assert batch_key(PARAMS) == batch_key(PARAMS.model_copy(update={"seed": 99}))
    for name in PER_CALL_PARAMETERS:
        value = getattr(PARAMS, name)
        changed = PARAMS.model_copy(update={name: 0.5 if value is None else value * 2 or (ADAPTER,)})
        assert batch_key(changed) != batch_key(PARAMS), name
    assert batch_key(PARAMS.model_copy(update={"negative_prompt": "blur"})) != batch_key(PARAMS)
