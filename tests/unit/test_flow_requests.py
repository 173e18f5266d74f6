"""A flow on the API's request path (api_server/flows/serving.py) and the rows it leaves (api_server/flows/rows.py): the
flow as a model for the serving stage, its request validated and planned, one message to its first stage's unit,
a unit chosen per stage, and one row per stage that ran linked to the flow's row."""

from __future__ import annotations

import base64
import io
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
import yaml
from PIL import Image

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.flows.rows import rows_of
from api_server.flows.serving import FlowService
from api_server.inference_log.writer import InferenceLogRow
from api_server.predict.cache import cache_key
from api_server.predict.inference import InferenceService
from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog
from contract.generation import AdapterRef
from contract.messages import InferenceReply, StageReport
from contract.payloads import PayloadCodec

HIRES = {
    "stages": [
        {"name": "base", "model": "sd15-txt2img", "fixes": {"num_inference_steps": 8},
         "resize": {"scale": 2, "space": "pixel"}},
        {"name": "hires", "model": "sd15-img2img", "fixes": {"strength": 0.5}},
    ]
}  # fmt: skip
# Issue 51: a draft repainted under the request's mask, and a flow starting with an inpaint of the request's image.
REPAINT = {"stages": [{"name": "draft", "model": "sd15-txt2img"}, {"name": "repaint", "model": "sd15-inpaint"}]}
INPAINT_FIRST = {"stages": [{"name": "inpaint", "model": "sd15-inpaint"},
                            {"name": "hires", "model": "sd15-img2img", "fixes": {"strength": 0.5}}]}  # fmt: skip
CALLER = Caller("key-1", "digest-1")


@pytest.fixture(scope="module")
def catalog(tmp_path_factory) -> ModelCatalog:
    overlay = tmp_path_factory.mktemp("flows") / "flows.yaml"
    flows = {"sd15-hires": HIRES, "repaint": REPAINT, "inpaint-first": INPAINT_FIRST}
    overlay.write_text(yaml.safe_dump({"flows": flows}))
    return ModelCatalog.from_yaml(DEFAULT_CATALOG_PATH, overlay)


def flows(catalog: ModelCatalog, canary: dict[str, str] | None = None) -> FlowService:
    """Each stage's unit as the split would choose it: the stable one, or the version `canary` names."""

    def choose(model: str, _request_id: str, _caller: Caller):
        spec = catalog.get(model)
        if canary and model in canary:
            spec = spec.model_copy(update={"version": canary[model], "versioned": True})
        return spec

    return FlowService(catalog, choose)


def prepared(catalog, body: dict, canary: dict[str, str] | None = None, flow: str = "sd15-hires"):
    service = flows(catalog, canary)
    call = service.call(catalog.flow(flow), "req-1", CALLER)
    inline = PayloadCodec(SimpleNamespace(bucket=lambda name: None), "payloads", 1 << 20)  # type: ignore[arg-type]
    inference = InferenceService(None, inline, 900)  # type: ignore[arg-type]
    return inference, inference.prepare(call.spec, body, "req-1", CALLER, flow=call)


def test_a_flow_is_a_model_published_to_its_first_stage_and_carrying_every_stage_plan(catalog):
    inference, request = prepared(catalog, {"instances": [{"prompt": "a fox"}], "parameters": {"seed": 7, "width": 256,
                                                                                              "height": 192}})  # fmt: skip
    spec = request.spec
    assert (spec.name, spec.queue, spec.version) == ("sd15-hires", "sd15-txt2img", "base=1,hires=1")
    units = [catalog.get("sd15-txt2img"), catalog.get("sd15-img2img")]
    assert spec.request_timeout_seconds == sum(unit.request_timeout_seconds for unit in units)
    message = inference.message(request)
    assert (message.model, message.model_version, message.request_id) == ("sd15-txt2img", "1", "req-1")
    assert message.parameters.num_inference_steps == 8 and message.parameters.seed == 7
    base, hires = message.flow.stages
    assert (message.flow.flow, message.flow.stage, base.queue, hires.queue) == (
        "sd15-hires", 0, "sd15-txt2img", "sd15-img2img",
    )  # fmt: skip
    assert (base.parameters.width, base.parameters.height) == (256, 192)
    assert (hires.parameters.width, hires.parameters.height, hires.parameters.strength) == (512, 384, 0.5)
    assert hires.parameters.seed == 7 and base.steps == 8 and hires.steps == hires.parameters.num_inference_steps // 2


def test_what_no_stage_takes_is_refused_naming_the_stage_that_fixes_it(catalog):
    with pytest.raises(ApiError) as refused:
        prepared(catalog, {"instances": [{"prompt": "x"}], "parameters": {"num_inference_steps": 20}})
    assert refused.value.status == 422 and refused.value.field == "parameters.num_inference_steps"
    assert "stage base fixes it" in refused.value.message
    with pytest.raises(ApiError) as too_large:
        prepared(catalog, {"instances": [{"prompt": "x"}], "parameters": {"width": 1024}})
    assert too_large.value.field == "parameters.width"  # twice 1024 is beyond sd15-img2img's limit


def test_a_canary_is_chosen_per_stage_and_the_cache_tells_the_versions_apart(catalog):
    body = {"instances": [{"prompt": "x"}], "parameters": {"seed": 3}}
    _, stable = prepared(catalog, body)
    inference, canary = prepared(catalog, body, canary={"sd15-img2img": "2"})
    assert canary.spec.version == "base=1,hires=2"
    hires = inference.message(canary).flow.stages[1]
    assert (hires.model_version, hires.queue) == ("2", "sd15-img2img--2")
    key = cache_key(stable.spec, stable.params, stable.prompts, stable.images)
    assert key != cache_key(canary.spec, canary.params, canary.prompts, canary.images)


def test_get_models_lists_the_flow_with_its_stages(catalog):
    view = flows(catalog).view(catalog.flow("sd15-hires"))
    assert view["kind"] == "flow" and view["task"] == "text-to-image"
    assert [(s["name"], s["model"], s["resize"]) for s in view["stages"]] == [
        ("base", "sd15-txt2img", {"scale": 2, "space": "pixel"}), ("hires", "sd15-img2img", None),
    ]  # fmt: skip
    assert view["stages"][1]["fixes"] == {"strength": 0.5} and "seed" in view["stages"][0]["takes"]


def png_b64(size: tuple[int, int], box: tuple[int, int, int, int] | None = None, mode: str = "L") -> str:
    """A PNG: black with `box` white (a mask), or an RGB image when `mode` is RGB."""
    image = Image.new(mode, size, 0)
    if box is not None:
        image.paste(255, box)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


SIZE = {"width": 96, "height": 64}
MASK = png_b64((96, 64), (0, 0, 48, 32))  # a quarter repainted


def test_a_flow_with_an_inpaint_stage_carries_the_masks_to_its_stages_and_its_cache_key(catalog):
    """The draft's mask is the request's size (the draft is); it rides on the flow's message to the inpaint stage, and
    masks told apart are cache keys told apart. A flow starting with an inpaint takes the image and mask as predict."""
    body = {"instances": [{"prompt": "a fox", "mask": MASK}], "parameters": {"seed": 4, **SIZE}}
    inference, request = prepared(catalog, body, flow="repaint")
    assert request.spec.takes_mask and request.images == [None] and request.masks == [base64.b64decode(MASK)]
    message = inference.message(request)
    assert base64.b64decode(message.instances[0].mask.b64) == base64.b64decode(MASK) and message.model == "sd15-txt2img"
    draft, repaint = message.flow.stages
    assert (repaint.model, repaint.parameters.width, repaint.parameters.height) == ("sd15-inpaint", 96, 64)
    other = {**body, "instances": [{"prompt": "a fox", "mask": png_b64((96, 64), (48, 32, 96, 64))}]}
    _, moved = prepared(catalog, other, flow="repaint")
    assert cache_key(request.spec, request.params, request.prompts, request.images, request.masks) != cache_key(
        moved.spec, moved.params, moved.prompts, moved.images, moved.masks
    )
    first = {"instances": [{"prompt": "a fox", "image": png_b64((96, 64), mode="RGB"), "mask": MASK}],
             "parameters": {"seed": 4, **SIZE}}  # fmt: skip
    inference, request = prepared(catalog, first, flow="inpaint-first")
    message = inference.message(request)
    assert message.model == "sd15-inpaint" and message.instances[0].image and message.instances[0].mask
    view = flows(catalog).view(catalog.flow("repaint"))
    assert view["inputs"] == ["prompt", "mask"] and "mask" in view["stages"][1]["takes"]
    assert flows(catalog).view(catalog.flow("inpaint-first"))["inputs"] == ["prompt", "image", "mask"]


@pytest.mark.parametrize(
    ("flow", "instance", "parameters", "field", "words"),
    [
        ("repaint", {"prompt": "p"}, {}, "instances.0.mask", "required by flow repaint, whose stage repaint repaints"),
        ("repaint", {"prompt": "p", "mask": png_b64((32, 32), (0, 0, 8, 8))}, {}, "instances.0.mask",
         "32x32 is not the size of the image it repaints 96x64 (parameters.width x parameters.height)"),
        ("repaint", {"prompt": "p", "mask": base64.b64encode(b"not a png").decode()}, {}, "instances.0.mask",
         "not a PNG"),
        ("repaint", {"prompt": "p", "mask": png_b64((96, 64))}, {}, "instances.0.mask", "nothing to repaint"),
        ("repaint", {"prompt": "p", "mask": MASK, "image": png_b64((96, 64), mode="RGB")}, {}, "instances.0.image",
         "not accepted by text-to-image model repaint"),
        ("repaint", {"prompt": "p"}, {"outpaint": {"left": 8}}, "parameters.outpaint", "no stage takes it"),
        ("sd15-hires", {"prompt": "p", "mask": MASK}, {}, "instances.0.mask", "takes no mask"),
        ("inpaint-first", {"prompt": "p", "mask": MASK}, {}, "instances.0.image", "required by inpaint model"),
        ("inpaint-first", {"prompt": "p", "image": png_b64((96, 64), mode="RGB"), "mask": png_b64((64, 96), (0, 0, 8, 8))},
         {}, "instances.0.mask", "not the image's size 96x64"),
    ],
)  # fmt: skip
def test_a_bad_mask_to_a_flow_is_the_422_predict_gives_naming_its_field(catalog, flow, instance, parameters, field,
                                                                         words):  # fmt: skip
    # prepare refuses before a message exists: nothing is published (its service has no dispatcher).
    with pytest.raises(ApiError) as refused:
        prepared(catalog, {"instances": [instance], "parameters": {"seed": 1, **SIZE, **parameters}}, flow=flow)
    assert (refused.value.status, refused.value.field) == (422, field) and words in refused.value.message, (
        refused.value.message
    )


def test_only_an_inpaint_stage_row_has_the_requests_mask_fraction(catalog):
    stages = [report("draft", 0, "sd15-txt2img", 400.0, 1), report("repaint", 1, "sd15-inpaint", 300.0, 1)]
    reply = InferenceReply(request_id="req-1", model="repaint", model_version="", status="ok", stages=stages)
    row = flow_row()
    row.model, row.flow, row.mask_fraction = "repaint", "repaint", 0.25
    flow, draft, repaint = rows_of(row, reply, catalog)
    assert [(r.task, r.mask_fraction) for r in (draft, repaint)] == [("text-to-image", None), ("inpaint", 0.25)]
    assert flow.mask_fraction == 0.25  # the request carried it


def report(stage: str, index: int, model: str, inference_ms: float, batch_size: int) -> StageReport:
    return StageReport(stage=stage, index=index, model=model, model_version="1", worker_id="w1", queue_ms=5.0,
                       inference_ms=inference_ms, worker_started_ms=1_700_000_000_000, batch_id=f"b{index}",
                       batch_size=batch_size, attempt=1, steps=8)  # fmt: skip


def flow_row() -> InferenceLogRow:
    return InferenceLogRow(request_id="req-1", created_at=datetime.now(UTC), model="sd15-hires", status="ok",
                           http_status=200, model_version="base=1,hires=1", num_images=1, api_key_id="key-1",
                           flow="sd15-hires")  # fmt: skip


def test_every_stage_that_ran_has_one_row_linked_to_the_flow_which_sums_their_gpu_seconds(catalog):
    stages = [report("base", 0, "sd15-txt2img", 400.0, 1), report("hires", 1, "sd15-img2img", 600.0, 2)]
    reply = InferenceReply(request_id="req-1", model="sd15-hires", model_version="", status="ok",
                           stages=[*stages, stages[1]])  # a stage reported twice is still one row  # fmt: skip
    flow, base, hires = rows_of(flow_row(), reply, catalog)
    assert [row.request_id for row in (flow, base, hires)] == ["req-1", "req-1:base", "req-1:hires"]
    assert (base.model, base.stage, base.stage_index, base.flow_request_id, base.flow) == (
        "sd15-txt2img", "base", 0, "req-1", "sd15-hires",
    )  # fmt: skip
    assert (base.gpu_seconds, hires.gpu_seconds, flow.gpu_seconds) == (0.4, 0.3, 0.7)
    assert hires.batch_id == "b1" and hires.num_inference_steps == 8 and flow.stage is None
    assert (base.endpoint, hires.endpoint) == ("stage", "stage")
    # Each stage's row has its own unit's task and family (the catalog's), not NULL.
    assert [(row.task, row.model_family) for row in (base, hires)] == [("text-to-image", "sd15"),
                                                                        ("image-to-image", "sd15")]  # fmt: skip
    for row in (flow, base, hires):
        row.to_json()  # each a valid row of the log's schema


def test_a_failed_stage_row_carries_the_flows_error_and_a_model_reply_has_no_stage_rows(catalog):
    failed = flow_row()
    failed.status, failed.error, failed.error_kind = "error", "stage hires (sd15-img2img): out of memory", "worker"
    ended = report("hires", 1, "sd15-img2img", 10.0, 1).model_copy(
        update={"status": "error", "error_kind": "inference_failed"}
    )
    reply = InferenceReply(request_id="req-1", model="sd15-hires", model_version="", status="error",
                           error=failed.error, stages=[report("base", 0, "sd15-txt2img", 400.0, 1), ended])  # fmt: skip
    _, base, hires = rows_of(failed, reply, catalog)
    assert (base.status, hires.status, hires.error_kind, hires.error) == (
        "ok", "error", "inference_failed", "stage hires (sd15-img2img): out of memory",
    )  # fmt: skip
    assert base.error is None and hires.request_id == "req-1:hires"
    plain = InferenceReply(request_id="r", model="sd15-txt2img", model_version="1", status="ok")
    assert len(rows_of(flow_row(), plain, catalog)) == 1


def test_the_sdk_names_a_flows_running_stage_to_a_callback_that_takes_it_and_the_cli_lists_its_stages(catalog):
    from rich.console import Console

    from maas_client._core import ProgressGate
    from maas_client.cli import print_models
    from maas_client.types import JobView, ModelInfo

    def view(step: int, stage: str) -> JobView:
        return JobView.model_validate({"id": "j", "status": "running", "model": "sd15-hires", "model_version": "",
                                       "created_at": "2026-11-25T00:00:00+00:00", "links": {"self": "/v1/jobs/j"},
                                       "progress": {"step": step, "total": 12, "stage": stage, "stage_index": 1}})  # fmt: skip

    staged, plain = [], []
    for gate in (ProgressGate(lambda step, total, stage: staged.append((step, stage))),
                 ProgressGate(lambda step, total: plain.append(step))):  # fmt: skip
        gate.update(view(9, "hires"))
    assert (staged, plain) == ([(9, "hires")], [9])
    listed = ModelInfo.model_validate(flows(catalog).view(catalog.flow("sd15-hires")))
    buffer = io.StringIO()
    print_models([listed], Console(file=buffer, width=40, force_terminal=False, color_system=None))
    assert buffer.getvalue().splitlines()[1].split()[2] == "flow:sd15-txt2img>sd15-img2img"


def test_adapters_are_resolved_for_each_stage_that_takes_them_against_its_own_model(catalog):
    class Registry:
        """Each model's adapter at a version of its own: a stage's adapters are its model's registration."""

        def __init__(self) -> None:
            self.asked: list[str] = []

        def resolve(self, spec, requested):
            self.asked.append(spec.name)
            return tuple(AdapterRef(name=a.name, version=f"{spec.name}-v1", scale=a.scale, sha256="0" * 64)
                         for a in requested)  # fmt: skip

    registry = Registry()
    call = flows(catalog).call(catalog.flow("sd15-hires"), "req-2", CALLER)
    body = {"instances": [{"prompt": "x"}], "parameters": {"seed": 1, "adapters": [{"name": "ink", "scale": 0.5}]}}
    inference = InferenceService(None, None, 900, adapters=registry)  # type: ignore[arg-type]
    message = inference.message(inference.prepare(call.spec, body, "req-2", CALLER, flow=call))
    assert registry.asked == ["sd15-txt2img", "sd15-img2img"]  # both stages take adapters (models.yaml serves them)
    base, hires = message.flow.stages
    assert [a.version for a in base.parameters.adapters] == ["sd15-txt2img-v1"]
    assert [a.version for a in hires.parameters.adapters] == ["sd15-img2img-v1"]
    assert message.parameters.adapters == base.parameters.adapters  # the first stage's, on the message itself


def test_controls_are_resolved_for_each_stage_that_takes_them_as_predict_resolves_them(catalog):
    """A flow's ControlNets and image prompts: resolved against each taking stage's own model (both of sd15-hires:
    a later stage takes them by default), in each stage's plan with the images once on the message; the flow's row
    and cache key list them once; a bad one is predict's own 422, naming its field."""
    import base64

    from api_server.inference_log.records import listed
    from api_server.predict.controls import ControlService
    from contract.messages import Payload
    from contract.stores.control_registry import ControlRecord
    from tests.unit.test_control_registry import png

    class Registry:
        """Each model's ControlNet `edges` and IP-Adapter `style`, at a version of its own."""

        def __init__(self) -> None:
            self.asked: list[str] = []

        def resolve(self, spec, name):
            self.asked.append(spec.name)
            kind = {"edges": "controlnet", "style": "ip_adapter"}.get(name)
            return kind and ControlRecord(name=name, kind=kind, version=f"{spec.name}-v1", sha256=name, bytes=1,
                                          tensors=1)  # fmt: skip

    class Inline:
        def pack(self, data: bytes, name: str, content_type: str):
            return Payload(b64=base64.b64encode(data).decode())

    registry = Registry()
    inference = InferenceService(None, Inline(), 900, controls=ControlService(registry))  # type: ignore[arg-type]

    def prepare(parameters: dict):
        call = flows(catalog).call(catalog.flow("sd15-hires"), "req-3", CALLER)
        body = {"instances": [{"prompt": "x"}], "parameters": {"seed": 1, **parameters}}
        return inference.prepare(call.spec, body, "req-3", CALLER, flow=call)

    asked = {"controls": [{"name": "edges", "image": png(), "scale": 0.5}],
             "image_prompts": [{"name": "style", "image": png(color=(0, 0, 255)), "scale": 0.7}]}  # fmt: skip
    request = prepare(asked)
    message = inference.message(request)
    assert registry.asked == ["sd15-txt2img", "sd15-txt2img", "sd15-img2img", "sd15-img2img"]
    base, hires = message.flow.stages
    assert [(c.name, c.kind, c.version, c.scale) for c in base.parameters.controls] == [
        ("edges", "controlnet", "sd15-txt2img-v1", 0.5), ("style", "ip_adapter", "sd15-txt2img-v1", 0.7),
    ]  # fmt: skip
    assert [c.version for c in hires.parameters.controls] == ["sd15-img2img-v1"] * 2
    assert message.parameters.controls == base.parameters.controls and len(message.control_images) == 2
    assert listed(request.params.controls) == (
        "edges@sd15-txt2img-v1:0.5,style@sd15-txt2img-v1:0.7,edges@sd15-img2img-v1:0.5,style@sd15-img2img-v1:0.7"
    )
    other = prepare({**asked, "controls": [{"name": "edges", "image": png(), "scale": 0.6}]})
    assert cache_key(request.spec, request.params, ["x"], [None]) != cache_key(other.spec, other.params, ["x"], [None])
    for parameters, field in (({"controls": [{"name": "nothing", "image": png()}]}, "parameters.controls.0.name"),
                              ({"controls": [{"name": "edges", "image": png(), "scale": 9.0}]},
                               "parameters.controls.0.scale"),
                              ({"image_prompts": [{"name": "edges", "image": png()}]},
                               "parameters.image_prompts.0.name")):  # fmt: skip
        with pytest.raises(ApiError) as refused:
            prepare(parameters)
        assert (refused.value.status, refused.value.field) == (422, field)


def test_a_stage_on_a_step_cached_model_logs_its_step_cache_and_the_steps_it_skipped():
    from emulators.stack import local_catalog

    local = local_catalog(test_fixtures=True)
    draft = report("draft", 0, "flux-schnell-cached", 100.0, 1).model_copy(update={"steps_skipped": 3})
    edit = report("edit", 1, "flux-kontext", 100.0, 1)
    reply = InferenceReply(request_id="req-1", model="flux-cached-draft-edit", model_version="", status="ok",
                           stages=[draft, edit])  # fmt: skip
    flow, drafted, edited = rows_of(flow_row(), reply, local)
    assert (drafted.step_cache, drafted.steps_skipped) == ("first_block", 3)
    assert (edited.step_cache, edited.steps_skipped) == (None, None)  # its model has no cache
    turned_off = reply.model_copy(update={"stages": [draft.model_copy(update={"steps_skipped": None}), edit]})
    assert rows_of(flow_row(), turned_off, local)[1].step_cache is None  # no count: it ran without
    for row in (flow, drafted, edited):
        row.to_json()
