"""Signed URLs of answered images (the OpenAI Images API's `response_format: url`): each PNG is written to the
payload bucket once and linked by a V4 signed GET URL that expires.

Signing needs a key: a service-account key's own, or, on Cloud Run and GKE (whose credentials hold no key), the
runtime service account signing through the IAM Credentials API (`service_account_email` + an access token;
the account needs `iam.serviceAccounts.signBlob` on itself). Against the GCS emulator, which checks no signature,
a throwaway key made at start signs: the URL has the production form and the emulator serves it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import google.auth
import google.auth.transport.requests
from google.auth.credentials import Credentials
from google.cloud import storage


class ResultLinks:
    def __init__(self, client: storage.Client, bucket: str, ttl_seconds: int) -> None:
        self._bucket = client.bucket(bucket)
        self._ttl = timedelta(seconds=ttl_seconds)
        self._emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        self._credentials: Credentials | None = _throwaway_signer() if self._emulator else None

    def links(self, request_id: str, pngs: list[bytes]) -> list[str]:
        """One signed URL per PNG, written under the request's id (a repeated answer rewrites the same objects)."""
        urls = []
        for index, png in enumerate(pngs):
            blob = self._bucket.blob(link_object(request_id, index))
            blob.upload_from_string(png, content_type="image/png")
            urls.append(self._signed(blob))
        return urls

    def _signed(self, blob: storage.Blob) -> str:
        if self._emulator:
            return blob.generate_signed_url(
                version="v4", expiration=self._ttl, method="GET", credentials=self._credentials,
                api_access_endpoint=self._emulator,
            )  # fmt: skip
        credentials, _ = google.auth.default()
        if hasattr(credentials, "sign_bytes") and getattr(credentials, "signer_email", None):
            return blob.generate_signed_url(version="v4", expiration=self._ttl, method="GET", credentials=credentials)
        credentials.refresh(google.auth.transport.requests.Request())
        return blob.generate_signed_url(
            version="v4", expiration=self._ttl, method="GET",
            service_account_email=credentials.service_account_email, access_token=credentials.token,
        )  # fmt: skip


def link_object(request_id: str, index: int) -> str:
    """Under `results/`: the payload bucket's lifecycle rule deletes it with the request's other objects."""
    return f"results/links/{request_id}/{index}.png"


def _throwaway_signer() -> Credentials:
    """A service-account credential with a key made now: signs URLs for the emulator, which never checks them."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from google.oauth2 import service_account

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    info = {
        "type": "service_account",
        "client_email": "maas-local@emulator.iam.gserviceaccount.com",
        "private_key": pem,
        "token_uri": "https://oauth2.googleapis.com/token",
    }
    return service_account.Credentials.from_service_account_info(info)
