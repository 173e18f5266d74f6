"""Deletes per-request reply subscriptions leaked by API processes that died while waiting.

A per-request subscription (`maas-reply-{request_id}`, labelled `maas-purpose=reply-wait`) lives from just
before its request is published until the reply arrives or the model's timeout passes: at most the longest
catalog request timeout plus the publish and delete timeouts. One older than that was leaked (the process
was killed mid-wait); its expiration policy would remove it a day later, the janitor does it sooner.

- **Age.** Pub/Sub does not expose when a subscription was created, so the API labels it at creation with
  `maas-created=<epoch seconds>` (`reply_waiter.CREATED_LABEL`). A reply subscription without that label (or
  with a malformed one) is left to its expiration policy, never guessed at.
- **Safety.** Only names starting `maas-reply-` that carry the reply-wait label are considered; per-instance
  subscriptions (`maas-replies-instance-*`) live as long as their process, so their age says nothing and
  they are left to their expiration policy too. The threshold may not be shorter than the longest request
  timeout plus `MIN_MARGIN_SECONDS`, so a live wait is never deleted.

A request whose API process is known dead (its liveness key lapsed: `contract/stores/inflight.py`) needs no age: the
process that adopts its log row deletes its subscription at once (`delete_orphaned_subscription`).

`python -m api_server.jobs.janitor [--older-than SECONDS] [--dry-run]` runs one sweep (a Cloud Run job on a Cloud
Scheduler trigger in production); `MAAS_JANITOR_INTERVAL_SECONDS` runs it inside the API process instead.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass, field

import redis
from google.api_core import exceptions
from google.cloud import pubsub_v1

from api_server.predict.reply_waiter import CREATED_LABEL
from contract import naming
from contract.catalog import ModelCatalog
from contract.digits import ascii_digits
from contract.settings import MAX_PUBLISH_TIMEOUT_SECONDS, Settings

log = logging.getLogger(__name__)
REPLY_PREFIX = naming.reply_subscription("")
# Publish and delete timeouts (at most MAAS_PUBLISH_TIMEOUT_SECONDS's limit each) plus clock skew between the API and
# the janitor.
MIN_MARGIN_SECONDS = int(2 * MAX_PUBLISH_TIMEOUT_SECONDS + 40)
DEFAULT_MARGIN_SECONDS = 600
LEASE_KEY = "maas:janitor:lease"


def longest_request_timeout(catalog: ModelCatalog) -> int:
    return max(spec.request_timeout_seconds for spec in catalog.units())


def minimum_age(catalog: ModelCatalog) -> int:
    """The youngest a subscription may be and still be deleted: no live wait is ever this old."""
    return longest_request_timeout(catalog) + MIN_MARGIN_SECONDS


def default_age(catalog: ModelCatalog) -> int:
    return longest_request_timeout(catalog) + DEFAULT_MARGIN_SECONDS


@dataclass
class Sweep:
    """What one sweep found: deleted (or, dry, would delete) names with their ages, and what it left."""

    deleted: list[tuple[str, int]] = field(default_factory=list)
    young: int = 0
    undated: int = 0
    failed: int = 0


class ReplySubscriptionJanitor:
    def __init__(self, subscriber: pubsub_v1.SubscriberClient, project_id: str, older_than_seconds: int) -> None:
        self._subscriber = subscriber
        self._project = f"projects/{project_id}"
        self.older_than_seconds = older_than_seconds

    def close(self) -> None:
        """Closes the subscriber's channel (the API's task owns it; the `janitor` command closes its own)."""
        self._subscriber.close()

    def sweep(self, dry_run: bool = False, now: float | None = None) -> Sweep:
        now = time.time() if now is None else now
        result = Sweep()
        for subscription in self._subscriber.list_subscriptions(request={"project": self._project}, timeout=30):
            if not self._is_reply_wait(subscription):
                continue
            created = _created(subscription)
            if created is None:
                result.undated += 1
                continue
            age = int(now - created)
            if age < self.older_than_seconds:
                result.young += 1
                continue
            if not dry_run and not self._delete(subscription.name):
                result.failed += 1
                continue
            result.deleted.append((subscription.name, age))
        return result

    @staticmethod
    def _is_reply_wait(subscription) -> bool:
        labels = subscription.labels
        return subscription.name.rpartition("/")[2].startswith(REPLY_PREFIX) and all(
            labels.get(key) == value for key, value in naming.REPLY_SUBSCRIPTION_LABEL.items()
        )

    def _delete(self, name: str) -> bool:
        return _delete_subscription(self._subscriber, name)


def delete_orphaned_subscription(subscriber: pubsub_v1.SubscriberClient, project_id: str, request_id: str) -> bool:
    """Deletes the reply subscription of a request whose API process died waiting on it: leaked, whatever its age."""
    return _delete_subscription(
        subscriber, subscriber.subscription_path(project_id, naming.reply_subscription(request_id))
    )


def _delete_subscription(subscriber: pubsub_v1.SubscriberClient, name: str) -> bool:
    try:
        subscriber.delete_subscription(request={"subscription": name}, timeout=10)
    except exceptions.NotFound:
        pass  # deleted meanwhile: by its own request's cleanup, or another janitor
    except exceptions.GoogleAPICallError as exc:
        log.warning("janitor could not delete %s: %s", name, exc)
        return False
    log.info("deleted leaked reply subscription", extra={"fields": {"subscription": name}})
    return True


def _created(subscription) -> float | None:
    value = subscription.labels.get(CREATED_LABEL, "")
    return float(value) if ascii_digits(value) and len(value) <= 12 else None


class JanitorTask:
    """The sweep as a background thread in the API process: every interval, in one process of all of them
    (a Redis lease per interval; while Redis is down every process sweeps, which is harmless)."""

    def __init__(self, janitor: ReplySubscriptionJanitor, redis_client: redis.Redis, interval: float) -> None:
        self._janitor = janitor
        self._redis = redis_client
        self._interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if not self._leased():
                continue
            try:
                swept = self._janitor.sweep()
            except Exception:  # noqa: BLE001 - the next interval tries again
                log.exception("reply subscription sweep failed")
                continue
            if swept.deleted or swept.failed:
                log.info(
                    "reply subscription sweep",
                    extra={"fields": {"deleted": len(swept.deleted), "failed": swept.failed, "young": swept.young}},
                )

    def _leased(self) -> bool:
        try:
            return bool(self._redis.set(LEASE_KEY, "1", nx=True, ex=max(1, int(self._interval * 0.9))))
        except redis.RedisError:
            return True

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._janitor.close()


def janitor_age(settings: Settings, catalog: ModelCatalog, older_than: int | None = None) -> int:
    """The threshold to use: the one asked for (refused below the minimum), else the setting, else the default."""
    age = older_than if older_than is not None else (settings.janitor_older_than_seconds or default_age(catalog))
    if age < minimum_age(catalog):
        raise ValueError(
            f"older-than {age} s could delete live waits: the longest request timeout is "
            f"{longest_request_timeout(catalog)} s, so use at least {minimum_age(catalog)} s"
        )
    return age


def build_janitor_task(settings: Settings, catalog: ModelCatalog, redis_client: redis.Redis) -> JanitorTask | None:
    if settings.janitor_interval_seconds <= 0:
        return None
    from contract import google_clients

    janitor = ReplySubscriptionJanitor(
        google_clients.subscriber_client(), settings.project_id, janitor_age(settings, catalog)
    )
    return JanitorTask(janitor, redis_client, settings.janitor_interval_seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api_server.jobs.janitor", description=__doc__.split("\n")[0])
    parser.add_argument("--older-than", type=int, help="seconds (default: longest request timeout + 600)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    catalog = settings.catalog()
    try:
        age = janitor_age(settings, catalog, args.older_than)
    except ValueError as exc:
        parser.error(str(exc))
    from contract import google_clients

    subscriber = google_clients.subscriber_client()
    with contextlib.closing(subscriber):
        try:
            swept = ReplySubscriptionJanitor(subscriber, settings.project_id, age).sweep(dry_run=args.dry_run)
        except exceptions.GoogleAPICallError as exc:
            print(f"cannot list subscriptions of {settings.project_id}: {exc}", file=sys.stderr)
            return 1
    verb = "would delete" if args.dry_run else "deleted"
    for name, seconds in swept.deleted:
        print(f"{verb} {name} (age {seconds} s)")
    print(
        f"{verb} {len(swept.deleted)}; kept {swept.young} younger than {age} s and {swept.undated} without a "
        f"{CREATED_LABEL} label (left to their 1-day expiration policy); {swept.failed} failed"
    )
    return 1 if swept.failed else 0


if __name__ == "__main__":
    sys.exit(main())
