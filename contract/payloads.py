"""Moves bytes inline (base64) when small and through the payload bucket when large (Pub/Sub caps messages at 10 MB)."""

from __future__ import annotations

import base64
import binascii

from google.cloud import storage

from contract.messages import Payload


class PayloadError(ValueError):
    """A payload that cannot be read: bad base64, a missing object, a foreign bucket."""


class PayloadCodec:
    def __init__(self, client: storage.Client, bucket: str, inline_limit: int) -> None:
        self._bucket = client.bucket(bucket)
        self._bucket_name = bucket
        self._inline_limit = inline_limit

    def pack(self, data: bytes, object_name: str, content_type: str = "image/png") -> Payload:
        if len(data) <= self._inline_limit:
            return Payload(b64=base64.b64encode(data).decode("ascii"))
        blob = self._bucket.blob(object_name)
        blob.upload_from_string(data, content_type=content_type)
        return Payload(uri=f"gs://{self._bucket_name}/{object_name}")

    def unpack(self, payload: Payload) -> bytes:
        if payload.b64 is not None:
            try:
                return base64.b64decode(payload.b64, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise PayloadError("payload is not valid base64") from exc
        if payload.uri is None:
            raise PayloadError("payload has neither b64 nor uri")
        prefix = f"gs://{self._bucket_name}/"
        if not payload.uri.startswith(prefix):
            raise PayloadError(f"payload uri must be in {prefix}")
        blob = self._bucket.blob(payload.uri[len(prefix) :])
        try:
            return blob.download_as_bytes()
        except Exception as exc:  # google.api_core NotFound and transport errors alike
            raise PayloadError(f"cannot read {payload.uri}: {exc}") from exc
