"""Whether the API can serve: Redis answers, the request and reply topics exist, the log table exists."""

from __future__ import annotations

import logging
import threading
import time

from google.api_core import exceptions

from contract import google_clients, naming

log = logging.getLogger(__name__)

# /readyz is polled (Cloud Run, the local stack, tests); the answer is reused this long.
READINESS_CACHE_SECONDS = 2.0
# Each dependency gets this long to answer, so a dead one makes /readyz slow by seconds, not minutes.
CHECK_TIMEOUT_SECONDS = 2.0


class Readiness:
    """Whether the API can serve: Redis answers, the request and reply topics exist, the log table exists.

    Checked at most once per READINESS_CACHE_SECONDS; concurrent probes share one check.
    """

    def __init__(self, services, bigquery=None, clock=time.monotonic) -> None:
        self._services = services
        self._bigquery = bigquery  # built on first use unless given
        self._clock = clock
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        self._problems: list[str] = []
        self._topics_unlistable = False

    def problems(self) -> list[str]:
        with self._lock:
            now = self._clock()
            if self._checked_at is None or now - self._checked_at >= READINESS_CACHE_SECONDS:
                self._problems = [*self._redis(), *self._pubsub(), *self._log_table()]
                self._checked_at = self._clock()
            return list(self._problems)

    def _redis(self) -> list[str]:
        try:
            self._services.redis.ping()
        except Exception as exc:  # noqa: BLE001 - any Redis failure means not ready
            return [f"redis unreachable ({type(exc).__name__})"]
        return []

    def _pubsub(self) -> list[str]:
        settings = self._services.settings
        needed = {naming.REPLIES_TOPIC} | {
            naming.request_topic(spec.queue, priority)
            for spec in self._services.catalog.units()
            for priority in naming.PRIORITIES
        }
        if self._topics_unlistable:
            return []
        try:
            # One call, not one per topic: topic reads count against the project's admin-operation quota.
            pages = self._services.publisher.list_topics(
                request={"project": f"projects/{settings.project_id}"}, timeout=CHECK_TIMEOUT_SECONDS, retry=None
            )
            existing = {topic.name.rsplit("/", 1)[-1] for topic in pages}
        except exceptions.PermissionDenied:
            # Production grants the API publish rights on its topics, not pubsub.topics.list: nothing to check.
            log.warning("readiness: not allowed to list topics; the topic check is skipped")
            self._topics_unlistable = True
            return []
        except exceptions.GoogleAPICallError as exc:
            return [f"pubsub unreachable ({type(exc).__name__})"]
        missing = sorted(needed - existing)
        if not missing:
            return []
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return [f"pubsub topic {missing[0]}{more} missing (run the bootstrap)"]

    def _log_table(self) -> list[str]:
        settings = self._services.settings
        table = f"{settings.project_id}.{settings.dataset}.{settings.log_table}"
        try:
            if self._bigquery is None:
                self._bigquery = google_clients.bigquery_client(settings)
            self._bigquery.get_table(table, retry=None, timeout=CHECK_TIMEOUT_SECONDS)
        except exceptions.NotFound:
            return [f"bigquery table {table} missing (run the bootstrap)"]
        except Exception as exc:  # noqa: BLE001 - connection errors come from requests, not google.api_core
            return [f"bigquery unreachable ({type(exc).__name__})"]
        return []
