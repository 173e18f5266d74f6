"""A batch line's images by `gs://` URI: read under the key's batch input locations only (the `input_file` rule), put
inline before the line is validated as predict validates a body, limited as inline images are; a missing, forbidden
or oversized object or one that is not an image fails that line alone, with an error naming the field."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import pytest
from google.api_core import exceptions
from PIL import Image

from api_server.batches.inputs import BatchInputPolicy
from api_server.batches.lines import InvalidLine, Line, inline_images, validate_line
from api_server.core.auth import Caller
from api_server.predict.inference import InferenceService
from contract.settings import Settings, api_key_digest
from emulators.stack import local_catalog
from tests.unit import batch_harness
from tests.unit.batch_harness import Harness

redis_server = batch_harness.redis_server  # one redis-server for the module (the runner's test below)
KEY_A, KEY_B = api_key_digest("key-a"), api_key_digest("key-b")
A, B = Caller(KEY_A[:12], KEY_A), Caller(KEY_B[:12], KEY_B)
CATALOG = local_catalog(test_fixtures=True)
MAX_LINE_BYTES = 64 * 1024


def png(mode: str, fill, box=None) -> bytes:
    image = Image.new(mode, (64, 64), 0 if box else fill)
    if box:
        image.paste(fill, box)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


IMAGE, MASK = png("RGB", (200, 80, 40)), png("L", 255, box=(8, 8, 24, 24))
OWN, OTHER = f"gs://inputs/{A.key_id}/", f"gs://inputs/{B.key_id}/"


class Storage:
    """Buckets of objects (name -> bytes); a name in `forbidden` raises as GCS does for an object the service may
    not read."""

    def __init__(self, objects: dict[str, bytes], forbidden: set[str] = frozenset()) -> None:
        self.objects, self.forbidden, self.downloads = objects, forbidden, []

    def bucket(self, name: str):
        storage = self

        class Bucket:
            def get_blob(self, blob_name: str):
                uri = f"gs://{name}/{blob_name}"
                if uri in storage.forbidden:
                    raise exceptions.Forbidden("403 caller does not have storage.objects.get access")
                if uri not in storage.objects:
                    return None
                data = storage.objects[uri]

                def download_as_bytes() -> bytes:
                    storage.downloads.append(uri)
                    return data

                return SimpleNamespace(size=len(data), download_as_bytes=download_as_bytes)

        return Bucket()


STORAGE = Storage(
    {
        f"{OWN}photo.png": IMAGE,
        f"{OWN}mask.png": MASK,
        f"{OWN}notes.txt": b"not an image at all",
        f"{OWN}large.png": IMAGE + b"\0" * MAX_LINE_BYTES,  # a PNG with trailing bytes, past the line's room
        f"{OTHER}photo.png": IMAGE,
        "gs://acme-maas-payloads/batches/batch-aaaa/images/00000001-0.png": IMAGE,
    },
    forbidden={f"{OWN}locked.png"},
)


def policy() -> BatchInputPolicy:
    settings = Settings.from_env({"MAAS_PROJECT_ID": "acme", "MAAS_BATCH_INPUTS": "*=gs://inputs/{key_id}/"})
    return BatchInputPolicy(STORAGE, settings.batch_inputs, {settings.model_bucket, settings.payload_bucket})


SERVING = SimpleNamespace(
    model=lambda name, request_id, caller: CATALOG.get(name),
    prepare=InferenceService(None, None, 900).prepare,  # type: ignore[arg-type]
)


def checked(image: str, mask: str, caller: Caller = A, read: bool = True):
    instance = {"prompt": "a window", "image": image, "mask": mask}
    payload = {"custom_id": "c1", "model": "sd15-inpaint", "instances": [instance],
               "parameters": {"width": 64, "height": 64, "seed": 1}}  # fmt: skip
    line = Line(1, 0, json.dumps(payload).encode())
    read_image = (lambda uri, field, room: policy().read_image(caller, uri, field, room)) if read else None
    return validate_line(SERVING, None, "batch-x", line, caller, MAX_LINE_BYTES, read_image)  # type: ignore[arg-type]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_an_image_and_a_mask_under_the_keys_location_are_read_and_checked_as_inline_ones():
    by_uri = checked(f"{OWN}photo.png", f"{OWN}mask.png")
    inline = checked(b64(IMAGE), b64(MASK))
    assert not isinstance(by_uri, InvalidLine) and not isinstance(inline, InvalidLine)
    assert by_uri.images == inline.images == [IMAGE] and by_uri.masks == inline.masks == [MASK]
    mixed = checked(b64(IMAGE), f"{OWN}mask.png")
    assert not isinstance(mixed, InvalidLine) and mixed.masks == [MASK]


@pytest.mark.parametrize(
    "uri",
    [
        f"{OWN}missing.png",  # no such object
        f"{OWN}locked.png",  # one the service may not read
        f"{OTHER}photo.png",  # another key's input
        "gs://acme-maas-payloads/batches/batch-aaaa/images/00000001-0.png",  # another batch's result, in the service's bucket
        f"{OWN}../{B.key_id}/photo.png",  # out of its prefix by a dot segment
    ],
)
def test_a_missing_forbidden_or_foreign_object_fails_the_line_with_the_one_refusal_naming_the_field(uri):
    downloads = len(STORAGE.downloads)
    refused = checked(b64(IMAGE), uri)
    assert isinstance(refused, InvalidLine) and refused.custom_id == "c1"
    error = refused.error
    assert (error.status, error.field) == (422, "instances.0.mask")
    assert error.message == (f"instances.0.mask: {uri} is not a readable object in this key's batch input locations "
                             f"(this key's: {OWN})")  # fmt: skip
    assert len(STORAGE.downloads) == downloads  # nothing read


def test_an_object_past_the_lines_room_is_a_413_and_is_not_downloaded():
    downloads = len(STORAGE.downloads)
    refused = checked(f"{OWN}large.png", b64(MASK))
    assert isinstance(refused, InvalidLine)
    assert (refused.error.status, refused.error.field) == (413, "instances.0.image")
    assert "past the" in refused.error.message and "MAAS_MAX_REQUEST_BYTES" in refused.error.message
    assert len(STORAGE.downloads) == downloads


def test_images_that_fit_alone_but_not_together_are_limited_as_the_same_line_inline():
    read = lambda uri, field, room: policy().read_image(A, uri, field, room)  # noqa: E731
    payload = {"instances": [{"prompt": "p", "image": f"{OWN}photo.png", "mask": f"{OWN}mask.png"}]}
    inline_images(payload, read, room=len(b64(IMAGE)) + len(b64(MASK)) + 10)
    assert payload["instances"][0] == {"prompt": "p", "image": b64(IMAGE), "mask": b64(MASK)}
    tight = {"instances": [{"prompt": "p", "image": f"{OWN}photo.png", "mask": f"{OWN}mask.png"}]}
    with pytest.raises(Exception) as refused:
        inline_images(tight, read, room=len(b64(IMAGE)) + 10)
    assert (refused.value.status, refused.value.field) == (413, "instances.0.mask")  # type: ignore[attr-defined]


def test_an_object_that_is_not_an_image_is_refused_as_an_inline_one_is():
    by_uri = checked(b64(IMAGE), f"{OWN}notes.txt")
    inline = checked(b64(IMAGE), b64(b"not an image at all"))
    assert isinstance(by_uri, InvalidLine) and isinstance(inline, InvalidLine)
    assert (by_uri.error.status, by_uri.error.field, by_uri.error.message) == (
        inline.error.status, inline.error.field, inline.error.message,
    ) == (422, "instances.0.mask", "instances.0.mask: not a PNG, JPEG or WebP image")  # fmt: skip


def test_every_image_field_of_a_line_is_read_and_a_uri_without_a_reader_is_predicts_refusal():
    seen = []

    def read(uri: str, field: str, room: int) -> bytes:
        seen.append(field)
        return IMAGE

    payload = {
        "instances": [{"prompt": "p", "image": f"{OWN}photo.png"}, {"prompt": "q", "image": b64(IMAGE)}],
        "parameters": {"controls": [{"name": "edges", "image": f"{OWN}edges.png"}],
                       "image_prompts": [{"name": "style", "image": f"{OWN}style.png"}]},
    }  # fmt: skip
    inline_images(payload, read, room=MAX_LINE_BYTES)
    assert seen == ["instances.0.image", "parameters.controls.0.image", "parameters.image_prompts.0.image"]
    assert payload["parameters"]["controls"][0]["image"] == b64(IMAGE)
    refused = checked(f"{OWN}photo.png", b64(MASK), read=False)
    assert isinstance(refused, InvalidLine)
    assert (refused.error.status, refused.error.message) == (422, "instances.0.image: not valid base64")


def test_gcs_failing_for_its_own_reason_is_no_refusal_and_the_line_is_read_again_from_the_cursor(monkeypatch):
    """A 503 (or no answer) from GCS is not the caller's doing: it raises through, not a 422, and the runner reads
    the line again at its next step from the cursor, so no line is lost nor taken twice."""
    flaky = Storage({f"{OWN}photo.png": IMAGE}, forbidden=set())
    calls = []

    def get_blob_once_unavailable(bucket_name: str):
        bucket = Storage.bucket(flaky, bucket_name)
        original = bucket.get_blob

        def get_blob(name: str):
            calls.append(name)
            if len(calls) == 1:
                raise exceptions.ServiceUnavailable("503 backend unavailable")
            return original(name)

        bucket.get_blob = get_blob
        return bucket

    monkeypatch.setattr(flaky, "bucket", get_blob_once_unavailable)
    settings = Settings.from_env({"MAAS_PROJECT_ID": "acme", "MAAS_BATCH_INPUTS": "*=gs://inputs/{key_id}/"})
    checks = BatchInputPolicy(flaky, settings.batch_inputs, {settings.model_bucket, settings.payload_bucket})
    with pytest.raises(exceptions.ServiceUnavailable):
        checks.read_image(A, f"{OWN}photo.png", "instances.0.image", MAX_LINE_BYTES)
    assert checks.read_image(A, f"{OWN}photo.png", "instances.0.image", MAX_LINE_BYTES) == IMAGE


class FlakyImages:
    """A line image reader whose `fail_at`-th read raises as GCS does when it is unavailable."""

    def __init__(self, fail_at: int) -> None:
        self.reads, self.fail_at = 0, fail_at

    def read_image(self, caller: Caller, uri: str, field: str, max_bytes: int) -> bytes:
        self.reads += 1
        if self.reads == self.fail_at:
            raise exceptions.ServiceUnavailable("503 backend unavailable")
        return IMAGE


def test_a_line_whose_image_gcs_could_not_serve_is_read_again_and_no_line_is_lost_or_taken_twice(redis_server):
    redis_server.flushall()
    harness = Harness(redis_server)
    ids = [f"i{index}" for index in range(1, 6)]
    batch_id = harness.submit(ids)
    lines = [{"custom_id": custom_id, "model": "sleep",
              "instances": [{"prompt": custom_id, "image": f"{OWN}photo.png"}]} for custom_id in ids]  # fmt: skip
    harness.bucket.objects[f"batches/{batch_id}/input.jsonl"] = "".join(
        json.dumps(line) + "\n" for line in lines
    ).encode()
    harness.runner._inputs = FlakyImages(fail_at=3)  # the third line's image, once
    failures = 0
    while harness.fields(batch_id).get("feed_done") != "1":
        assert failures <= 1 and harness.store.acquire(batch_id, harness.runner._token, 10) is not None
        try:
            harness.runner.step(batch_id)
        except exceptions.ServiceUnavailable:  # the runner's loop logs it and steps again
            failures += 1
    assert failures == 1 and harness.fields(batch_id)["total"] == "5", "every line read, none counted twice"
    assert len(harness.inference.published) == len(set(harness.inference.published)) == 5
    for custom_id in ids:
        harness.answer(batch_id, custom_id)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")
    assert sorted(item["custom_id"] for item in harness.output(batch_id, "results")) == ids
