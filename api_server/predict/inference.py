"""The inference service: validates a predict body, submits it to its model's queue and awaits the reply.

Its refusals are `ApiError`s (a status and a message naming the field), the API's one error type; the
serving stage (`serving.py`) builds the cache, coalescing, idempotency and jobs on `prepare`, `submit` and
`run` as separate steps.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.jobs.webhooks import WebhookTargetPolicy
from api_server.predict.adapters import AdapterService
from api_server.predict.controls import ControlService
from api_server.predict.dispatch import DispatchTimings, InferenceDispatcher
from api_server.predict.masks import checked_mask, outpainted
from api_server.predict.schemas import PredictBody, decode_input_image, parse_body, resolve_parameters
from contract import naming
from contract.images import decode_input_image as decode_image
from contract.messages import GenerationParameters, InferenceReply, InferenceRequest, RequestInstance
from contract.model_spec import ModelSpec
from contract.payloads import PayloadCodec, PayloadError

if TYPE_CHECKING:
    from api_server.flows.serving import FlowCall


@dataclass
class PreparedRequest:
    """A validated request: parameters resolved, input images decoded, nothing uploaded or published yet."""

    request_id: str
    spec: ModelSpec
    body: PredictBody
    params: GenerationParameters
    images: list[bytes | None]
    priority: naming.Priority
    caller: Caller
    # The body as sent: what an Idempotency-Key's fingerprint covers.
    payload: object = None
    webhook_url: str | None = None
    idempotency_key: str | None = None
    # `Cache-Control: no-cache`: run the model again and refresh the cache entry.
    fresh: bool = False
    # perf_counter() when the request arrived (the answer's `timings_ms.total`).
    received: float = field(default_factory=time.perf_counter)
    # Asked for one version by name (POST .../versions/{v}:predict): no shadow copy.
    pinned: bool = False
    # Its partial inference log row (the records stage's), kept in Redis with the published request so that
    # another API process writes it if this one dies before answering.
    log_row: Callable[[], dict] | None = None
    # A call to a flow (api_server/flows/serving.py): its stages' units and plans; published to its first stage's unit.
    flow: FlowCall | None = None
    # An inpaint request's masks, one per instance (white repaints); None for other tasks.
    masks: list[bytes | None] = field(default_factory=list)
    # Its control models' images (ControlNets' control images, then image prompts), in `params.controls`' order.
    control_images: list[bytes] = field(default_factory=list)
    # When it arrived, epoch ms, read off the wall clock once: its log row's `created_at`, and its job's if it becomes
    # one. Derived again from `received` later, a wall clock adjusted meanwhile (seen: 5 ms on a VM) gave the job and
    # the row two different times. None: derived from `received` (a call without a log row).
    arrived_ms: int | None = None

    def for_version(self, spec: ModelSpec, request_id: str, **changes) -> PreparedRequest:
        """This request asked of another version under an id of its own (a fallback, a shadow copy): no
        Idempotency-Key, no webhook and no kept row of its own, which all belong to the caller's request."""
        return replace(
            self, request_id=request_id, spec=spec, idempotency_key=None, webhook_url=None, log_row=None, **changes
        )

    @property
    def deterministic(self) -> bool:
        """An explicit seed makes the output a function of the request: cacheable and coalescible."""
        return self.body.parameters.seed is not None

    @property
    def prompts(self) -> list[str]:
        return [instance.prompt for instance in self.body.instances]


class InferenceService:
    def __init__(
        self,
        dispatcher: InferenceDispatcher,
        payloads: PayloadCodec,
        job_deadline_seconds: int,
        high_priority_keys: frozenset[str] = frozenset(),
        webhook_targets: WebhookTargetPolicy | None = None,
        adapters: AdapterService | None = None,
        controls: ControlService | None = None,
    ) -> None:
        self._adapters = adapters
        self._controls = controls
        self._webhook_targets = webhook_targets or WebhookTargetPolicy(enabled=False)
        self._dispatcher = dispatcher
        self._payloads = payloads
        self._job_deadline_seconds = job_deadline_seconds
        self._high_priority_keys = high_priority_keys

    def prepare(
        self,
        spec: ModelSpec,
        payload: object,
        request_id: str,
        caller: Caller,
        idempotency_key: str | None = None,
        fresh: bool = False,
        received: float | None = None,
        pinned: bool = False,
        log_row: Callable[[], dict] | None = None,
        flow: FlowCall | None = None,
        arrived_ms: int | None = None,
    ) -> PreparedRequest:
        body = parse_body(payload)
        params = resolve_parameters(body, spec)
        control_images: list[bytes] = []
        if flow is not None:  # its adapters and controls are each stage's that takes them, planned with its stages
            flow.check(body, params, self._adapters, self._controls)
            params, control_images = params.model_copy(update={"controls": flow.logged_controls}), flow.control_images
        else:
            if body.parameters.adapters:
                if self._adapters is None:
                    raise ApiError(422, "parameters.adapters: not served here", "parameters.adapters")
                params = params.model_copy(update={"adapters": self._adapters.resolve(spec, body.parameters.adapters)})
            if body.parameters.controls or body.parameters.image_prompts:
                if self._controls is None:
                    field = "parameters.controls" if body.parameters.controls else "parameters.image_prompts"
                    raise ApiError(422, f"{field}: not served here", field)
                # IP-Adapters ride after the ControlNets, their images after theirs.
                refs, control_images = self._controls.resolve_all(spec, body.parameters.controls,
                                                                   body.parameters.image_prompts)  # fmt: skip
                params = params.model_copy(update={"controls": refs})
        priority = body.parameters.priority or "normal"
        if priority == "high" and caller.digest not in self._high_priority_keys:
            raise ApiError(403, "parameters.priority: 'high' is not enabled for this API key", "parameters.priority")
        images = [
            decode_input_image(instance.image, f"instances.{index}.image", spec.limits.max_input_pixels)
            if instance.image
            else None
            for index, instance in enumerate(body.instances)
        ]
        masks: list[bytes | None] = [None] * len(images)
        if spec.takes_mask:
            images, masks, params = inpaint_inputs(body, params, images, spec)
        webhook_url = self._webhook_targets.check(body.webhook_url) if body.webhook_url is not None else None
        return PreparedRequest(
            request_id,
            spec,
            body,
            params,
            images,
            priority,
            caller,
            payload,
            webhook_url,
            idempotency_key,
            fresh,
            time.perf_counter() if received is None else received,
            pinned,
            log_row,
            flow,
            masks,
            control_images,
            arrived_ms,
        )

    def job_deadline_ms(self) -> int:
        return int((time.time() + self._job_deadline_seconds) * 1000)

    def publish(
        self,
        message: InferenceRequest,
        spec: ModelSpec,
        deadline_ms: int,
        priority: naming.Priority,
        log_row: dict | None = None,
        reply_to: str | None = None,
    ) -> bool:
        """Publishes a request message (`message`) and returns at once (a job); raises 503 if the queue is
        unreachable. True when its partial log row (`log_row`) was kept with it (see `run`). `reply_to`: a reply
        topic of its own (a batch line's)."""
        return self._dispatcher.submit(message, spec, deadline_ms, priority, log_row, reply_to)

    def run(
        self, prepared: PreparedRequest, timings: DispatchTimings, deadline_ms: int, wait_seconds: float | None = None
    ) -> InferenceReply | None:
        """Publishes and waits up to the model's request timeout (or `wait_seconds`); None if no reply came by then.
        The request's partial log row is kept with it, so that its row is written even if this process dies."""
        log_row = prepared.log_row() if prepared.log_row is not None else None
        return self._dispatcher.run(
            self.message(prepared), prepared.spec, timings, prepared.priority, deadline_ms, wait_seconds, log_row
        )

    def predictions(self, reply: InferenceReply) -> list[dict]:
        return [self._prediction_json(prediction) for prediction in reply.predictions]

    def message(self, prepared: PreparedRequest) -> InferenceRequest:
        """The request as its model's queue takes it (input images packed: inline, or uploaded to GCS)."""
        masks = prepared.masks or [None] * len(prepared.images)
        instances = [
            RequestInstance(
                prompt=prompt,
                image=None
                if image is None
                else self._payloads.pack(
                    image,
                    naming.input_object(prepared.request_id, index),
                    content_type="application/octet-stream",
                ),
                mask=None
                if mask is None
                else self._payloads.pack(
                    mask,
                    naming.input_object(prepared.request_id, index) + "-mask",
                    content_type="application/octet-stream",
                ),
            )
            for index, (prompt, image, mask) in enumerate(zip(prepared.prompts, prepared.images, masks, strict=True))
        ]
        request = InferenceRequest(
            request_id=prepared.request_id,
            model=prepared.spec.name,
            model_version=prepared.spec.version,
            instances=instances,
            parameters=prepared.params,
            control_images=[
                self._payloads.pack(
                    image,
                    naming.input_object(prepared.request_id, 0) + f"-control-{index}",
                    content_type="application/octet-stream",
                )
                for index, image in enumerate(prepared.control_images)
            ],  # fmt: skip
        )
        return request if prepared.flow is None else prepared.flow.message(request)

    def _prediction_json(self, prediction) -> dict:
        try:
            png = self._payloads.unpack(prediction.image)
        except PayloadError as exc:
            raise ApiError(500, f"result unavailable: {exc}") from exc
        return {
            "image_b64": base64.b64encode(png).decode("ascii"),
            "mime_type": "image/png",
            "seed": prediction.seed,
            "width": prediction.width,
            "height": prediction.height,
        }


def inpaint_inputs(
    body: PredictBody, params: GenerationParameters, images: list[bytes | None], spec: ModelSpec
) -> tuple[list[bytes | None], list[bytes | None], GenerationParameters]:
    """An inpaint request's images and masks, checked (api_server/predict/masks.py); with `outpaint`, each image
    padded and its mask made, and the output size the padded image's unless the request names one. A flow with an
    inpaint stage takes masks too: the request's image's size, or without one (the flow drafts it) its own size."""
    max_pixels = spec.limits.max_input_pixels
    outpaint = body.parameters.outpaint
    images, masks = list(images), []
    for index, instance in enumerate(body.instances):
        image = images[index]
        if outpaint is None:
            field_name = f"instances.{index}.mask"
            mask = decode_input_image(instance.mask or "", field_name, max_pixels)
            # A flow that drafts before it repaints takes no image: the mask is the draft's size, the request's.
            checked_mask(mask, field_name, image if image is not None else (params.width, params.height), max_pixels)
            masks.append(mask)
            continue
        assert image is not None  # outpainting is an inpaint model's, which requires the image (resolve_parameters)
        images[index], mask = outpainted(image, outpaint)
        masks.append(mask)
    if outpaint is None:
        return images, masks, params
    sizes = {decode_image(image).size for image in images if image is not None}
    width, height = max(sizes)
    if body.parameters.width is None and body.parameters.height is None:
        if len(sizes) > 1:
            raise ApiError(422, "parameters.outpaint: the padded images differ in size; send width and height",
                           "parameters.outpaint")  # fmt: skip
        params = params.model_copy(update={"width": width, "height": height})
    limits, multiple = spec.limits, spec.family.size_multiple if spec.family else 8
    problem = None
    if width * height > max_pixels:
        problem = f"the padded image is {width}x{height}, past the model's {max_pixels} input pixels"
    elif params.width > limits.max_width or params.height > limits.max_height:
        problem = (
            f"the output {params.width}x{params.height} is past the model's {limits.max_width}x{limits.max_height}"
        )
    elif params.width % multiple or params.height % multiple:
        problem = f"the output {params.width}x{params.height} is not a multiple of {multiple}; pad to one"
    if problem is not None:
        raise ApiError(422, f"parameters.outpaint: {problem}", "parameters.outpaint")
    return images, masks, params
