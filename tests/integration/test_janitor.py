"""The reply-subscription janitor against the real Pub/Sub emulator: leaked waits go, live ones and others stay."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid

import pytest
import redis
from google.api_core import exceptions

from api_server.jobs.janitor import (
    JanitorTask,
    ReplySubscriptionJanitor,
    default_age,
    janitor_age,
    minimum_age,
)
from api_server.predict.reply_waiter import CREATED_LABEL, PerRequestReplyWaiter, reply_subscription_request
from contract import google_clients, naming
from contract.stores.results import ResultStore
from emulators.stack import ROOT

pytestmark = pytest.mark.stack
DAY = 24 * 3600


@pytest.fixture
def subscriber():
    client = google_clients.subscriber_client()
    yield client
    client.close()


@pytest.fixture
def created(subscriber, settings):
    """Creates subscriptions on the replies topic as the API (or someone else) would; deletes what is left."""
    names: list[str] = []
    topic = f"projects/{settings.project_id}/topics/{naming.REPLIES_TOPIC}"

    def create(short_name: str, age_seconds: float | None = 0, labels: dict[str, str] | None = None) -> str:
        name = subscriber.subscription_path(settings.project_id, short_name)
        request = reply_subscription_request(
            name, topic, "request_id", short_name, created=time.time() - (age_seconds or 0)
        )
        if age_seconds is None:
            del request["labels"][CREATED_LABEL]
        if labels is not None:
            request["labels"] = labels
        subscriber.create_subscription(request=request)
        names.append(name)
        return name

    yield create
    for name in names:
        with contextlib.suppress(exceptions.NotFound):
            subscriber.delete_subscription(request={"subscription": name})


def exists(subscriber, name: str) -> bool:
    try:
        subscriber.get_subscription(request={"subscription": name})
        return True
    except exceptions.NotFound:
        return False


def test_subscription_left_by_a_crash_is_deleted_and_everything_else_is_kept(subscriber, settings, created):
    age = default_age(settings.catalog())
    leaked = created(naming.reply_subscription(uuid.uuid4().hex), age_seconds=age + 60)
    fresh = created(naming.reply_subscription(uuid.uuid4().hex), age_seconds=5)
    undated = created(naming.reply_subscription(uuid.uuid4().hex), age_seconds=None)
    # Old and labelled reply-wait, but not a per-request subscription: per-instance, or another name entirely.
    instance = created(naming.instance_reply_subscription(f"janitor-{uuid.uuid4().hex[:8]}"), age_seconds=DAY)
    other = created(f"other-{uuid.uuid4().hex}", age_seconds=DAY)
    # A per-request name without the reply-wait label is not ours to delete.
    unlabelled = created(
        naming.reply_subscription(uuid.uuid4().hex), labels={CREATED_LABEL: str(int(time.time()) - DAY)}
    )

    janitor = ReplySubscriptionJanitor(subscriber, settings.project_id, age)
    dry = janitor.sweep(dry_run=True)
    assert leaked in [name for name, _ in dry.deleted] and exists(subscriber, leaked)

    swept = janitor.sweep()
    deleted = [name for name, _ in swept.deleted]
    assert leaked in deleted and not exists(subscriber, leaked)
    assert not {fresh, undated, instance, other, unlabelled} & set(deleted)
    assert all(exists(subscriber, name) for name in (fresh, undated, instance, other, unlabelled))
    assert swept.young >= 1 and swept.undated >= 1


def test_a_live_wait_is_never_old_enough_to_be_deleted(subscriber, settings):
    waiter = PerRequestReplyWaiter(
        subscriber, settings.project_id, ResultStore(redis.Redis.from_url(settings.redis_url), 60)
    )
    pending = waiter.expect(uuid.uuid4().hex)
    try:
        catalog = settings.catalog()
        longest = max(spec.request_timeout_seconds for spec in catalog.models.values())
        janitor = ReplySubscriptionJanitor(subscriber, settings.project_id, minimum_age(catalog))
        # Even at the end of the longest wait the subscription is younger than the smallest threshold allowed.
        swept = janitor.sweep(now=time.time() + longest + 20)
        assert pending.subscription not in [name for name, _ in swept.deleted]
        assert exists(subscriber, pending.subscription)
    finally:
        pending.close()
    with pytest.raises(ValueError, match="live waits"):
        janitor_age(settings, catalog, older_than=longest)


def test_command_deletes_leaked_subscriptions_and_dry_run_only_lists_them(subscriber, settings, created):
    age = default_age(settings.catalog())
    leaked = created(naming.reply_subscription(uuid.uuid4().hex), age_seconds=age + 60)
    command = [sys.executable, "-m", "api_server.jobs.janitor"]

    dry = subprocess.run([*command, "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert f"would delete {leaked}" in dry.stdout and exists(subscriber, leaked)

    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"deleted {leaked}" in run.stdout and not exists(subscriber, leaked)

    refused = subprocess.run([*command, "--older-than", "60"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "live waits" in refused.stderr


def test_background_task_deletes_a_leaked_subscription(subscriber, settings, created):
    age = default_age(settings.catalog())
    leaked = created(naming.reply_subscription(uuid.uuid4().hex), age_seconds=age + 60)
    fresh = created(naming.reply_subscription(uuid.uuid4().hex), age_seconds=1)
    redis_client = redis.Redis.from_url(settings.redis_url)
    # The task owns its subscriber (it closes it on stop), like the API's.
    own = google_clients.subscriber_client()
    task = JanitorTask(ReplySubscriptionJanitor(own, settings.project_id, age), redis_client, interval=0.5)
    task.start()
    try:
        deadline = time.monotonic() + 15
        while exists(subscriber, leaked) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not exists(subscriber, leaked)
        assert exists(subscriber, fresh)
    finally:
        task.stop()
