"""The API's readiness: each missing or unreachable dependency is named, and the answer is cached briefly."""

from __future__ import annotations

from types import SimpleNamespace

from google.api_core import exceptions

from api_server.process.routes.health import READINESS_CACHE_SECONDS, Readiness
from contract import naming
from contract.settings import Settings

MODELS = ["noop", "sleep"]


class Dependencies:
    """Redis, Pub/Sub and BigQuery as the readiness check sees them, with a count of the calls made."""

    def __init__(self) -> None:
        self.redis_up = True
        self.pubsub_error: Exception | None = None
        self.topics = {naming.REPLIES_TOPIC} | {naming.request_topic(m, p) for m in MODELS for p in naming.PRIORITIES}
        self.table_error: Exception | None = None
        self.calls = 0

    def ping(self) -> bool:
        self.calls += 1
        if not self.redis_up:
            raise ConnectionError("refused")
        return True

    def list_topics(self, request, timeout, retry):
        assert timeout <= 5 and retry is None  # a dead dependency must not hold the probe for long
        if self.pubsub_error:
            raise self.pubsub_error
        return [SimpleNamespace(name=f"{request['project']}/topics/{topic}") for topic in sorted(self.topics)]

    def get_table(self, table, retry, timeout):
        if self.table_error:
            raise self.table_error
        return table


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def readiness(deps: Dependencies, clock: Clock | None = None) -> Readiness:
    services = SimpleNamespace(
        settings=Settings(),
        redis=deps,
        publisher=deps,
        catalog=SimpleNamespace(units=lambda: [SimpleNamespace(queue=name) for name in MODELS]),
    )
    return Readiness(services, bigquery=deps, clock=clock or Clock())


def test_ready_when_redis_the_topics_and_the_table_are_there():
    assert readiness(Dependencies()).problems() == []


def test_each_missing_or_unreachable_dependency_is_named():
    deps = Dependencies()
    deps.redis_up = False
    deps.topics.discard(naming.request_topic("noop", "high"))
    deps.table_error = exceptions.NotFound("no table")
    assert readiness(deps).problems() == [
        "redis unreachable (ConnectionError)",
        "pubsub topic maas-requests-noop-high missing (run the bootstrap)",
        "bigquery table maas-local.maas.inference_log missing (run the bootstrap)",
    ]


def test_an_unreachable_pubsub_is_not_ready():
    deps = Dependencies()
    deps.pubsub_error = exceptions.ServiceUnavailable("connection refused")
    assert readiness(deps).problems() == ["pubsub unreachable (ServiceUnavailable)"]


def test_without_permission_to_list_topics_the_topic_check_is_skipped():
    deps = Dependencies()
    deps.pubsub_error = exceptions.PermissionDenied("pubsub.topics.list")
    assert readiness(deps).problems() == []


def test_the_answer_is_reused_for_a_moment_then_checked_again():
    deps, clock = Dependencies(), Clock()
    check = readiness(deps, clock)
    assert check.problems() == [] and deps.calls == 1
    deps.redis_up = False
    clock.now += READINESS_CACHE_SECONDS / 2
    assert check.problems() == [] and deps.calls == 1
    clock.now += READINESS_CACHE_SECONDS
    assert check.problems() == ["redis unreachable (ConnectionError)"] and deps.calls == 2
