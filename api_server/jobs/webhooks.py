"""Job webhooks: a job's `webhook_url` is called once when the job ends, signed, retried with backoff.

- **Refused targets (SSRF).** Only `https://` URLs whose host resolves, every address of it, to a public
  address: private, loopback, link-local (the metadata server is 169.254.169.254), multicast, reserved
  and unspecified addresses are a 422 when the job is submitted, and checked again before each delivery
  (a name that re-resolves to a private address since is not called). IPv6 forms that carry an IPv4 address
  (mapped, 6to4 `2002::/16`) are judged by that address; NAT64 and Teredo, whose translator reaches addresses
  we cannot see, never pass. Each delivery connects to the address it just checked (TLS still verifies the
  URL's host name, sent as SNI and `Host`): the name is not resolved a second time, so a DNS answer that changes
  between the check and the connection (rebinding) cannot point the call at an internal address.
- **Once.** Like the job log rows (`job_log.py`), every API process looks at the jobs with a webhook once
  a second; an ended job is claimed with ZREM, which succeeds in exactly one process, and delivered from
  a small thread pool. A process that dies mid-retry loses that delivery: at most once, never twice.
- **Signature.** `X-MaaS-Timestamp: <unix seconds>` and `X-MaaS-Signature: v1=<hex>`, the HMAC-SHA256 of
  `{timestamp}.{body}` with `MAAS_WEBHOOK_SIGNING_SECRET`; receivers recompute it and refuse old timestamps.
- **Retries.** Up to `MAAS_WEBHOOK_ATTEMPTS` tries while the receiver answers 5xx, 408, 429 or cannot be
  reached: 1 s, 2 s, 4 s... (at most 60 s) apart. A 2xx ends it; any other answer is final.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import certifi
import redis
import urllib3

from api_server.core.errors import ApiError
from api_server.jobs.service import JobState, JobStore, job_view
from contract.digits import ascii_digits

log = logging.getLogger(__name__)
MAX_URL_LENGTH = 2048
RETRYABLE = {408, 429}
MAX_BACKOFF_SECONDS = 60.0
TIMEOUT_SECONDS = 10.0
# IPv6 ranges whose traffic a translator or tunnel sends on to an IPv4 address the check cannot judge: NAT64's
# well-known and local-use prefixes (RFC 6052, 8215), Teredo (RFC 4380) and the deprecated IPv4-compatible form.
TRANSLATED = tuple(
    ipaddress.ip_network(network) for network in ("64:ff9b::/96", "64:ff9b:1::/48", "2001::/32", "::/96")
)


@dataclass(frozen=True)
class WebhookTarget:
    """A checked URL and the one address it is called at: the delivery connects there and nowhere else."""

    url: str
    host: str
    port: int
    address: str
    path: str
    host_header: str


def sign(secret: str, timestamp: int, body: bytes) -> str:
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"v1={digest}"


def verify(secret: str, timestamp: str, body: bytes, signature: str, tolerance_seconds: int = 300) -> bool:
    """What a receiver does: the signature matches and the timestamp is recent."""
    if not ascii_digits(timestamp) or abs(time.time() - int(timestamp)) > tolerance_seconds:
        return False
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)


class WebhookTargetPolicy:
    """Which URLs a webhook may call: https, and hosts with public addresses only (loopback in tests)."""

    def __init__(self, enabled: bool, allow_loopback: bool = False) -> None:
        self._enabled = enabled
        self._allow_loopback = allow_loopback

    def check(self, url: str, field: str = "webhook_url") -> str:
        """The URL, or a 422 naming why it is refused."""
        return self.resolve(url, field).url

    def resolve(self, url: str, field: str = "webhook_url") -> WebhookTarget:
        """The URL and the address to call it at (every address of its host checked), or a 422 naming why not."""
        if not self._enabled:
            raise ApiError(422, f"{field}: webhooks are not enabled on this server", field)
        parts = urlsplit(url) if len(url) <= MAX_URL_LENGTH else None
        if parts is None or parts.scheme != "https" or not parts.hostname:
            raise ApiError(422, f"{field}: must be an https:// URL of at most {MAX_URL_LENGTH} characters", field)
        if parts.username or parts.password:
            raise ApiError(422, f"{field}: must not carry credentials", field)
        try:
            port = parts.port or 443
            addresses = sorted(
                {info[4][0] for info in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)}
            )
        except (OSError, ValueError, UnicodeError) as exc:
            raise ApiError(422, f"{field}: host {parts.hostname!r} does not resolve", field) from exc
        for address in addresses:
            if not self._public(ipaddress.ip_address(address.split("%")[0])):
                raise ApiError(422, f"{field}: {parts.hostname!r} resolves to a non-public address", field)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return WebhookTarget(url, parts.hostname, port, addresses[0], path, parts.netloc)

    def _public(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped:
                return self._public(address.ipv4_mapped)
            if address.sixtofour:  # 6to4 relays deliver to the IPv4 address inside: judged as that one, never loopback
                return not address.sixtofour.is_loopback and self._public(address.sixtofour)
            if any(address in network for network in TRANSLATED):
                return False
        if address.is_loopback:
            return self._allow_loopback
        return address.is_global and not (address.is_multicast or address.is_reserved or address.is_link_local)


class WebhookNotifier:
    """Finds ended jobs with a webhook, claims each once across processes and delivers it."""

    def __init__(
        self,
        jobs: JobStore,
        predictions,
        policy: WebhookTargetPolicy,
        secret: str,
        attempts: int = 5,
        backoff_seconds: float = 1.0,
        ca_file: str | None = None,
        interval: float = 1.0,
    ) -> None:
        self._jobs = jobs
        self._predictions = predictions
        self._policy = policy
        self._secret = secret
        self._attempts = attempts
        self._backoff = backoff_seconds
        self._ca_file = ca_file or certifi.where()
        self._interval = interval
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="webhook")
        self._thread = threading.Thread(target=self._run, name="webhooks", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                for job, url in self._jobs.ended_with_webhook():
                    if self._jobs.claim_webhook(job.job_id):
                        self._pool.submit(self.deliver, job, url)
            except redis.RedisError as exc:
                log.debug("webhooks wait for Redis: %s", exc)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("could not look for ended jobs with webhooks")

    def deliver(self, job: JobState, url: str) -> bool:
        """Calls the webhook until it answers 2xx, a final refusal or the attempts run out."""
        fields = {"job_id": job.job_id, "webhook_host": urlsplit(url).hostname}
        try:
            body = json.dumps(job_view(job, self._predictions), separators=(",", ":")).encode()
        except Exception:  # noqa: BLE001 - e.g. the result's payload object is gone
            log.exception("webhook body for job %s could not be built", job.job_id, extra={"fields": fields})
            return False
        return self.send(url, body, job.job_id)

    def send_later(self, url: str, body: bytes, resource_id: str, id_header: str) -> None:
        """`send` from the delivery pool (a batch's end: `batches/runner.py`, claimed once by its caller)."""
        self._pool.submit(self.send, url, body, resource_id, id_header)

    def send(self, url: str, body: bytes, resource_id: str, id_header: str = "X-MaaS-Job-Id") -> bool:
        """Posts `body`, signed, until a 2xx, a final refusal or the attempts run out."""
        fields = {"job_id": resource_id, "webhook_host": urlsplit(url).hostname}
        for attempt in range(1, self._attempts + 1):
            outcome = self._attempt(url, body, resource_id, id_header)
            if outcome == "delivered":
                log.info("webhook delivered", extra={"fields": {**fields, "attempt": attempt}})
                return True
            if outcome == "final" or attempt == self._attempts or self._stopped.is_set():
                break
            time.sleep(min(self._backoff * 2 ** (attempt - 1), MAX_BACKOFF_SECONDS))
        log.warning("webhook not delivered after %d attempts", attempt, extra={"fields": fields})
        return False

    def _attempt(self, url: str, body: bytes, job_id: str, id_header: str = "X-MaaS-Job-Id") -> str:
        try:
            target = self._policy.resolve(url)  # the name may resolve elsewhere since the job was submitted
        except ApiError as exc:
            log.warning("webhook refused: %s", exc.message, extra={"fields": {"job_id": job_id}})
            return "final"
        timestamp = int(time.time())
        headers = {
            "Host": target.host_header,
            "Content-Type": "application/json",
            "User-Agent": "maas-webhooks/1",
            id_header: job_id,
            "X-MaaS-Timestamp": str(timestamp),
            "X-MaaS-Signature": sign(self._secret, timestamp, body),
        }
        try:
            status = self._post(target, body, headers)
        except urllib3.exceptions.HTTPError as exc:
            log.info("webhook attempt failed: %s", type(exc).__name__, extra={"fields": {"job_id": job_id}})
            return "retry"
        if 200 <= status < 300:
            return "delivered"
        return "retry" if status >= 500 or status in RETRYABLE else "final"

    def _post(self, target: WebhookTarget, body: bytes, headers: dict[str, str]) -> int:
        """POSTs to the checked address itself; TLS sends and verifies the URL's host name (SNI, certificate)."""
        with urllib3.HTTPSConnectionPool(
            target.address,
            target.port,
            server_hostname=target.host,
            assert_hostname=target.host,
            cert_reqs="CERT_REQUIRED",
            ca_certs=self._ca_file,
            timeout=urllib3.Timeout(TIMEOUT_SECONDS),
            retries=False,
            maxsize=1,
        ) as pool:
            response = pool.urlopen("POST", target.path, body=body, headers=headers, redirect=False, retries=False)
            return response.status

    def stop(self) -> None:
        self._stopped.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
