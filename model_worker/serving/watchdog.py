"""Re-dispatches a dead worker's requests within seconds, and ends every request nobody ran at its deadline.

It runs in every worker process, but only one at a time across the fleet sweeps: the one holding the
watchdog lease in Redis (renewed every sweep, as long as a holder lease, so a dead leader is replaced as
fast as a dead worker's requests lapse). A sweep looks at two things the API and the workers keep in Redis
(`contract.stores.inflight`):

- requests whose holder lease lapsed with no stored result: the holder died (or stalled). The kept message is
  published again, its re-dispatch counted (the worker adds it to the delivery attempt); after the model's
  `max_delivery_attempts` it is answered `failed` instead, as the dead-letter responder would. Whoever takes
  the new copy takes a new holder lease; a stalled holder that wakes up finds the answer stored and only acks.
- requests past their deadline that nobody holds and nobody answered: answered `expired` (stored, published),
  so a waiting client, a job and its log row end at the deadline, not at a client's timeout.
- requests published (or re-dispatched) that no worker has taken within twice the model's ack deadline: published
  again, the wait doubling each time. A copy a worker pulled but died before taking (no holder lease yet) is
  invisible to the lapse check, and the emulator has been seen never to deliver it again: before this, such a
  request (a sync request turned job, deadline 15 minutes away) waited for its deadline, its client long gone.
  Not while it is only queued behind busy workers (`contract.stores.pullers`: its topic's pullers are alive,
  none found the queue empty and none died since it was published): under overload, admission admits requests
  expected to start up to their deadline, and a copy would only lengthen the queue. It is looked at again an
  ack deadline later.

A flow's answer (expired or dead-lettered) names the flow and the stage it was at, as a worker's would, and
carries the reports its finished stages kept in Redis: their rows are written, and past the deadline between
two worker groups the error says the flow was waiting in the next stage's queue.

Why in the workers and not the API: workers run all the time on GKE, where the API on Cloud Run may scale to
zero or have its CPU throttled between requests; they already hold the catalog and a reply publisher. If Redis
is down nothing is swept (logged once): a dead worker's requests then come back by the broker's redelivery.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis
from google.cloud import pubsub_v1

from contract.catalog import ModelCatalog
from contract.messages import Attr, InferenceReply, StageReport
from contract.stores.inflight import InflightState, InflightStore, KeptRequest, RedisOutage, claim_wait_ms
from contract.stores.pullers import PullerStore, TopicPullers
from contract.stores.results import ResultStore
from model_worker.flows.stages import unanswered_flow_reply
from model_worker.serving.finisher import ReplyFinisher
from model_worker.serving.intake import PULL_WAIT_SECONDS
from model_worker.serving.metrics import WorkerMetrics

log = logging.getLogger(__name__)
PUBLISH_TIMEOUT_SECONDS = 10
# A lapsed holder's requests are published again only this long after its lease ran out. A holder that stalled (a
# frozen process, a host paused) may still have a pull open, and the broker hands a copy published then to that pull,
# where it sits unread until its ack deadline; by a pull's wait after the lapse, every pull it opened has ended (the
# stalled-holder and killed-worker tests lost copies to such a pull once the pull wait grew past the holder lease).
LAPSE_GRACE_SECONDS = PULL_WAIT_SECONDS
# Models missing from this worker's catalog (another deployment's newer entry) get the catalog's usual limit.
DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_ACK_DEADLINE_SECONDS = 15


class Watchdog:
    def __init__(
        self,
        inflight: InflightStore,
        results: ResultStore,
        publisher: pubsub_v1.PublisherClient,
        finisher: ReplyFinisher,
        catalog: ModelCatalog,
        worker_id: str,
        lease_seconds: float,
        metrics: WorkerMetrics,
        flow_reports: Callable[[str], list[StageReport]] | None = None,
        pullers: PullerStore | None = None,
    ) -> None:
        """`flow_reports(request_id)`: the reports a flow's finished stages left in Redis (`FlowCheckpoints.reports`),
        so an answer for a flow names the stage it was at and carries those stages (their rows). `pullers`: who
        pulls each topic (`model_worker.serving.presence`); without it every untaken request is copied."""
        self._pullers = pullers
        self._flow_reports = flow_reports
        self._inflight = inflight
        self._results = results
        self._publisher = publisher
        self._finisher = finisher
        self._catalog = catalog
        self.worker_id = worker_id
        self._lease_seconds = lease_seconds
        self._metrics = metrics
        # Several sweeps per holder lease: a lapse is found well within a second of it.
        self._interval = min(0.5, lease_seconds / 6)
        self._outage = RedisOutage("the watchdog")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                if self._inflight.lead(self.worker_id, self._lease_seconds):
                    self.sweep()
                self._outage.succeeded()
            except redis.RedisError as exc:
                self._outage.failed(exc)
            except Exception:  # noqa: BLE001 - the next sweep tries again
                log.exception("watchdog sweep failed")

    def sweep(self) -> tuple[int, int]:
        """One pass; returns (re-dispatched, ended) counts."""
        redispatched = ended = 0
        now_ms = int(time.time() * 1000)
        for state in self._inflight.lapsed(grace_ms=int(LAPSE_GRACE_SECONDS * 1000)):
            if state.held:
                continue  # its holder's heartbeat came in since the index was read
            if self._settled(state):
                continue
            if state.kept.deadline_ms <= now_ms:
                ended += self._expire(state.kept)
            else:
                redispatched += self._redispatch(state.kept)
        for state in self._inflight.overdue(now_ms):
            # A live holder answers its own request at the deadline (the device loop abandons it).
            if not state.held and not self._settled(state):
                ended += self._expire(state.kept)
        topics: dict[str, TopicPullers] = {}  # read once per sweep
        for state in self._inflight.unclaimed(now_ms):
            if state.held or state.kept is None or state.kept.deadline_ms <= now_ms:
                self._inflight.unclaim(state.request_id)  # taken, or ended (the sweeps above see to it)
            elif self._settled(state):
                continue
            elif self._queued_behind_busy(state.kept, now_ms, topics):
                self._inflight.await_claim(state.request_id, now_ms + self.claim_wait_ms(state.kept) // 2)
                self._metrics.watchdog.labels(action="left_queued").inc()
            else:
                redispatched += self._republish_unclaimed(state.kept, now_ms)
        return redispatched, ended

    def _queued_behind_busy(self, kept: KeptRequest, now_ms: int, topics: dict[str, TopicPullers]) -> bool:
        """True when an untaken request only waits its turn (`TopicPullers.queued_behind_busy`): no copy."""
        if self._pullers is None or kept.published_ms is None:
            return False  # no way to tell: copied, as before
        topic = kept.topic.rsplit("/", 1)[-1]
        if topic not in topics:
            topics[topic] = self._pullers.pullers(topic)
        return topics[topic].queued_behind_busy(kept.published_ms, now_ms, int(self._lease_seconds * 1000))

    def claim_wait_ms(self, kept: KeptRequest) -> int:
        """How long a published copy may go untaken before it is published again: twice the model's ack deadline
        (by then the broker would have delivered it again, had a worker pulled it and died)."""
        spec = self._catalog.get(kept.attributes.get(Attr.MODEL, ""))
        return claim_wait_ms(spec.ack_deadline_seconds if spec is not None else DEFAULT_ACK_DEADLINE_SECONDS)

    def _republish_unclaimed(self, kept: KeptRequest, now_ms: int) -> int:
        """Publishes again a request nobody took (not a delivery attempt: no worker ran it)."""
        times = self._inflight.unclaimed_republishes(kept.request_id)
        try:
            self._publisher.publish(kept.topic, kept.data, **kept.attributes).result(timeout=PUBLISH_TIMEOUT_SECONDS)
        except Exception as exc:  # noqa: BLE001 - publish futures raise transport and timeout errors alike
            log.warning("could not publish untaken %s again (%s); trying again at the next sweep", kept.request_id, exc)
            return 0
        self._inflight.await_claim(
            kept.request_id, now_ms + self.claim_wait_ms(kept) * 2 ** (times + 1), True, published_ms=now_ms
        )
        model = kept.attributes.get(Attr.MODEL, "")
        log.warning("request %s of %s published again: no worker took it (time %d)", kept.request_id, model, times + 1)
        self._metrics.watchdog.labels(action="republished_untaken").inc()
        return 1

    def _settled(self, state: InflightState) -> bool:
        """True (and the record ended) when there is nothing to do: answered, or no message kept to publish."""
        if state.answered or state.kept is None:
            self._inflight.forget(state.request_id)
            return True
        return False

    def _redispatch(self, kept: KeptRequest) -> int:
        """Publishes the kept message again, then counts it: the request leaves the held index only once its copy
        is out, and only if no worker holds it by then. A leader killed between the two, or a worker taking the
        request meanwhile, must never leave a held-by-nobody request out of the index, where no sweep finds it."""
        count = kept.redispatches + 1
        spec = self._catalog.get(kept.attributes.get(Attr.MODEL, ""))
        attempts = spec.max_delivery_attempts if spec is not None else DEFAULT_MAX_ATTEMPTS
        if count >= attempts:
            # Every worker that held it died: a request that kills its worker must not take down the fleet.
            log.error("request %s: its holder died %d times; answering failed", kept.request_id, count)
            error = f"failed after {count} delivery attempts (each worker holding it stopped)"
            return self._answer(kept, "error", "dead_lettered", error, "failed")
        attributes = {**kept.attributes, Attr.REDISPATCHES: str(count)}
        try:
            self._publisher.publish(kept.topic, kept.data, **attributes).result(timeout=PUBLISH_TIMEOUT_SECONDS)
        except Exception as exc:  # noqa: BLE001 - publish futures raise transport and timeout errors alike
            # Still in the held index, lapsed: the next sweep tries again.
            log.warning("could not re-dispatch %s (%s); trying again at the next sweep", kept.request_id, exc)
            return 0
        self._inflight.count_redispatch(kept.request_id)
        # The new copy can be lost the same way (pulled by a worker that dies before taking it): watched too.
        published_ms = int(time.time() * 1000)
        self._inflight.await_claim(kept.request_id, published_ms + self.claim_wait_ms(kept), published_ms=published_ms)
        log.warning("request %s re-dispatched (attempt %d): its holder's lease lapsed", kept.request_id, count + 1)
        self._metrics.watchdog.labels(action="redispatched").inc()
        return 1

    def _expire(self, kept: KeptRequest) -> int:
        return self._answer(kept, "expired", "expired", "deadline passed before any worker ran it", "expired")

    def _kept_reports(self, request_id: str) -> list[StageReport]:
        if self._flow_reports is None:
            return []
        try:
            return self._flow_reports(request_id)
        except (redis.RedisError, ValueError) as exc:  # answered without them: the flow's own row still says how
            log.warning("the kept stages of %s could not be read (%s)", request_id, exc)
            return []

    def _answer(self, kept: KeptRequest, status: str, kind: str, error: str, action: str) -> int:
        reply = InferenceReply(
            request_id=kept.request_id,
            model=kept.attributes.get(Attr.MODEL, ""),
            model_version=kept.attributes.get(Attr.MODEL_VERSION, ""),
            status=status,  # type: ignore[arg-type]
            error_kind=kind,
            error=error,
            worker_id=self.worker_id,
            attempt=kept.redispatches + 1,
            # A job's end (`finished_at`) and its row's: the finisher stamps its answers; this one is stored here.
            answered_ms=int(time.time() * 1000),
        )
        reply = unanswered_flow_reply(kept.data, reply, self._kept_reports(kept.request_id))
        if self._results.put(reply):
            try:
                self._finisher.publish_reply(reply, kept.attributes).result(timeout=PUBLISH_TIMEOUT_SECONDS)
            except Exception as exc:  # noqa: BLE001 - stored: waiters and jobs read it from the result store
                log.warning("answer for %s stored but not published: %s", kept.request_id, exc)
            log.info("request %s answered %s by the watchdog", kept.request_id, status)
            self._metrics.watchdog.labels(action=action).inc()
        self._inflight.forget(kept.request_id)
        return 1
