"""Python SDK for the Model-as-a-Service image API: sync `Client` and asyncio `AsyncClient`, same surface."""

from maas_client.aio import AsyncClient, AsyncJob
from maas_client.batches import Batches
from maas_client.client import Client, Job
from maas_client.errors import (
    BadRequest,
    Conflict,
    ConnectionFailed,
    Forbidden,
    InputError,
    JobCancelled,
    JobFailed,
    MaasError,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServerError,
    ServiceUnavailable,
    Timeout,
    Unauthorized,
    ValidationError,
)
from maas_client.types import BatchView, Control, ImagePrompt, JobList, JobView, ModelDetail, ModelInfo, Result, Usage

__all__ = [
    "AsyncClient", "AsyncJob", "BadRequest", "Batches", "BatchView", "Client", "Conflict", "ConnectionFailed", "Control",
    "Forbidden", "ImagePrompt", "InputError", "Job", "JobCancelled", "JobFailed", "JobList", "JobView", "MaasError",
    "ModelDetail", "ModelInfo", "NotFound", "PayloadTooLarge",
    "RateLimited", "Result", "ServerError", "ServiceUnavailable", "Timeout", "Unauthorized", "Usage",
    "ValidationError",
]  # fmt: skip
