"""Typed errors: one class per kind of answer, each carrying the API's own message and the field it names."""

from __future__ import annotations


class MaasError(Exception):
    """Any failure the SDK reports; `status` is the HTTP status (None when no answer came)."""

    status: int | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        field: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status if status is not None else type(self).status
        self.field = field
        self.request_id = request_id
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.message} ({self.field})" if self.field else self.message


class BadRequest(MaasError):
    status = 400


class ValidationError(BadRequest):
    """422: a field is invalid; `field` names it (e.g. `parameters.width`)."""

    status = 422


class Unauthorized(MaasError):
    status = 401


class Forbidden(MaasError):
    status = 403


class NotFound(MaasError):
    status = 404


class Conflict(MaasError):
    status = 409


class PayloadTooLarge(MaasError):
    status = 413


class RateLimited(MaasError):
    """429: over the key's rate or concurrency limit; `retry_after` is the server's advice in seconds."""

    status = 429


class ServerError(MaasError):
    """5xx: the model worker or the API failed."""

    status = 500


class ServiceUnavailable(ServerError):
    status = 503


class Timeout(MaasError):
    """504 (the request expired in the queue), or no answer within the client's own timeout."""

    status = 504


class ConnectionFailed(MaasError):
    """The API could not be reached (refused, reset, DNS): no HTTP answer at all."""


class JobFailed(MaasError):
    """A job ended `failed` or `expired`; `status` is the HTTP status its error maps to."""


class JobCancelled(MaasError):
    status = 409


class InputError(MaasError, ValueError):
    """A bad argument caught before any request (a missing image file, a malformed size)."""


BY_STATUS: dict[int, type[MaasError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationError,
    429: RateLimited,
    503: ServiceUnavailable,
    504: Timeout,
}


def error_for(status: int, body: object, retry_after: float | None = None) -> MaasError:
    """The typed error for an HTTP answer; `body` is its parsed JSON (the API's `{"error": {...}}`) or text."""
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, dict):
        message = str(detail.get("message") or f"HTTP {status}")
        field, request_id = detail.get("field"), detail.get("request_id")
    else:
        message, field, request_id = (str(body)[:200] if body else f"HTTP {status}"), None, None
    cls = BY_STATUS.get(status) or (ServerError if status >= 500 else MaasError)
    return cls(message, status=status, field=field, request_id=request_id, retry_after=retry_after)
