"""Reply waiting, measured side by side against the Pub/Sub emulator: the bare echo floor, per-request and per-instance.

An echo responder stands in for the model, so the numbers isolate the messaging: each mode publishes a
request and waits for its reply through the same code the API uses (`api_server.predict.reply_waiter`).

    .venv/bin/python -m bench.reply_modes --requests 200 --concurrency 1 32
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from api_server.predict.reply_waiter import PerInstanceReplyWaiter, PerRequestReplyWaiter
from contract import google_clients, naming
from contract.messages import Attr, InferenceReply
from contract.stores.results import ResultStore
from emulators.bootstrap import ensure_subscription, ensure_topic
from emulators.processes import ProcessRegistry
from emulators.stack import StackConfig, bootstrap_resources, start_emulators

ECHO_TOPIC = "bench-echo-requests"


class EchoResponder:
    """Answers every request on ECHO_TOPIC with a reply on the replies topic, as a worker would."""

    def __init__(self, project: str) -> None:
        self.publisher = google_clients.publisher_client()
        self.subscriber = google_clients.subscriber_client()
        self.topic = self.publisher.topic_path(project, ECHO_TOPIC)
        self.subscription = self.subscriber.subscription_path(project, f"{ECHO_TOPIC}-workers")
        self.replies = self.publisher.topic_path(project, naming.REPLIES_TOPIC)
        ensure_topic(self.publisher, self.topic)
        ensure_subscription(self.subscriber, {"name": self.subscription, "topic": self.topic})
        self.future = self.subscriber.subscribe(self.subscription, self._answer)

    def _answer(self, message) -> None:
        request_id = message.attributes[Attr.REQUEST_ID]
        reply = InferenceReply(request_id=request_id, model="echo", model_version="1", status="ok")
        attributes = {Attr.REQUEST_ID: request_id}
        if Attr.INSTANCE in message.attributes:
            attributes[Attr.INSTANCE] = message.attributes[Attr.INSTANCE]
        self.publisher.publish(self.replies, reply.model_dump_json().encode(), **attributes).result(10)
        message.ack()

    def close(self) -> None:
        self.future.cancel()


class BareEcho:
    """The floor: a fixed subscription on the replies topic, no reply routing at all."""

    def __init__(self, project: str) -> None:
        self.subscriber = google_clients.subscriber_client()
        self.subscription = self.subscriber.subscription_path(project, "bench-bare-replies")
        ensure_subscription(
            self.subscriber, {"name": self.subscription, "topic": f"projects/{project}/topics/{naming.REPLIES_TOPIC}"}
        )
        self.lock = threading.Lock()
        self.events: dict[str, threading.Event] = {}
        self.future = self.subscriber.subscribe(self.subscription, self._route)

    def _route(self, message) -> None:
        message.ack()
        with self.lock:
            event = self.events.get(message.attributes.get(Attr.REQUEST_ID, ""))
        if event:
            event.set()

    def close(self) -> None:
        self.future.cancel()
        self.subscriber.delete_subscription(request={"subscription": self.subscription})


def one_round_trip(publisher, topic: str, waiter, bare: BareEcho | None) -> float:
    request_id = uuid.uuid4().hex
    started = time.perf_counter()
    if bare is not None:
        event = threading.Event()
        with bare.lock:
            bare.events[request_id] = event
        publisher.publish(topic, b"{}", **{Attr.REQUEST_ID: request_id}).result(10)
        ok = event.wait(30)
        with bare.lock:
            bare.events.pop(request_id, None)
    else:
        pending = waiter.expect(request_id)
        try:
            publisher.publish(topic, b"{}", **{Attr.REQUEST_ID: request_id, **waiter.request_attributes()}).result(10)
            ok = pending.wait(30) is not None
        finally:
            pending.close()
    if not ok:
        raise RuntimeError(f"no reply for {request_id}")
    return (time.perf_counter() - started) * 1000


def measure(name: str, round_trip: Callable[[], float], requests: int, concurrency: int) -> dict:
    for _ in range(min(5, requests)):
        round_trip()  # warm channels and subscriptions
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = sorted(pool.map(lambda _: round_trip(), range(requests)))
    elapsed = time.perf_counter() - started
    return {
        "mode": name,
        "concurrency": concurrency,
        "p50_ms": statistics.median(latencies),
        "p95_ms": latencies[int(0.95 * (len(latencies) - 1))],
        "rps": requests / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--port-offset", type=int, default=20000)
    args = parser.parse_args()

    config = StackConfig(stack_dir=Path(tempfile.mkdtemp(prefix="maas-bench-")), port_offset=args.port_offset)
    registry = ProcessRegistry(config.stack_dir)
    try:
        start_emulators(config, registry)
        bootstrap_resources(config)
        project = config.project_id
        results = ResultStore(redis.Redis.from_url(f"redis://127.0.0.1:{config.redis_port}/0"), 60)
        responder = EchoResponder(project)
        publisher = google_clients.publisher_client()
        bare = BareEcho(project)
        per_request = PerRequestReplyWaiter(google_clients.subscriber_client(), project, results)
        per_instance = PerInstanceReplyWaiter(google_clients.subscriber_client(), project, "bench", results)
        modes = {
            "bare echo (floor)": lambda: one_round_trip(publisher, responder.topic, None, bare),
            "per-request": lambda: one_round_trip(publisher, responder.topic, per_request, None),
            "per-instance": lambda: one_round_trip(publisher, responder.topic, per_instance, None),
        }
        rows = [measure(name, fn, args.requests, c) for c in args.concurrency for name, fn in modes.items()]
        print(f"\nReply waiting against the Pub/Sub emulator, {args.requests} requests per row")
        print(f"{'mode':<20}{'conc':>6}{'p50 ms':>10}{'p95 ms':>10}{'req/s':>10}{'x floor rps':>13}")
        for row in rows:
            floor = next(r for r in rows if r["concurrency"] == row["concurrency"] and r["mode"].startswith("bare"))
            print(
                f"{row['mode']:<20}{row['concurrency']:>6}{row['p50_ms']:>10.1f}{row['p95_ms']:>10.1f}"
                f"{row['rps']:>10.1f}{row['rps'] / floor['rps']:>13.2f}"
            )
        per_instance.close()
        bare.close()
        responder.close()
    finally:
        registry.stop_all([["pubsub", "gcs", "bigquery", "redis"]])


if __name__ == "__main__":
    main()
