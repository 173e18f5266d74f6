"""What each API feature adds to a sync predict at concurrency 1, timed in-process around its own calls.

    MAAS_STACK_DIR=/tmp/stack-f .venv/bin/python -m bench.api_overhead [--requests 300]

The real app (`create_app`) against a running stack, called through Flask's test client one request at a
time on the `noop` model with every feature in use: a fresh seed (cache lookup and coalescing lease, a miss
each time), an `Idempotency-Key`, per-key rate and concurrency limits (one Lua script on admit, one ZREM on
release) and a `traceparent`. Each feature's calls are wrapped with a timer (the model run they enclose
excluded), and the JSON logs go to /dev/null through the real formatter. Then the same requests without
any feature (no seed, no key, no limits) for the end-to-end difference, which the Pub/Sub round trip's
noise mostly hides.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import uuid
from collections import defaultdict

from api_server.process.app import create_app
from api_server.process.state import app_state
from bench.api_common import KEY, running_stack
from bench.loadgen import percentile
from contract.jsonlog import JsonFormatter, bind_context, unbind_context
from contract.settings import Settings
from contract.tracing import trace_from_headers

FEATURES = ("rate and concurrency limits", "cache lookup + coalescing lease", "idempotency", "logging")


class Timers:
    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.requests: list[dict[str, float]] = []

    def add(self, feature: str, seconds: float) -> None:
        self.current[feature] += seconds * 1000

    def next_request(self) -> None:
        self.requests.append(dict(self.current))
        self.current.clear()

    def wrap(self, owner, name: str, feature: str, excludes_compute: bool = False) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            inner = [0.0]
            if excludes_compute:  # (key, fingerprint, compute, policy): the model run is not the feature's cost
                compute = args[2]

                def counted():
                    started = time.perf_counter()
                    try:
                        return compute()
                    finally:
                        inner[0] += time.perf_counter() - started

                args = (*args[:2], counted, *args[3:])
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(feature, time.perf_counter() - started - inner[0])

        setattr(owner, name, timed)


def app_for(stack, features: bool):
    env = {
        **stack.service_env(),
        "MAAS_API_KEYS": KEY,
        "MAAS_LOG_SPOOL_DIR": str(stack.stack_dir / f"bench-overhead-spool-{uuid.uuid4().hex[:6]}"),
    }
    if features:
        env.update({"MAAS_RATE_LIMIT_PER_MINUTE": "1000000", "MAAS_CONCURRENCY_LIMIT": "1000"})
    return create_app(Settings.from_env(env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    stack = running_stack()
    os.environ.update(stack.client_env())  # the Google clients find the emulators through these
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - for the process's life
    handler.setFormatter(JsonFormatter())
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger().setLevel(logging.INFO)

    timers = Timers()
    app = app_for(stack, features=True)
    state = app_state(app)
    timers.wrap(state.limiter, "admit", FEATURES[0])
    timers.wrap(state.limiter, "release", FEATURES[0])
    timers.wrap(state.cache_flights, "run", FEATURES[1], excludes_compute=True)
    timers.wrap(state.flights, "run", FEATURES[2], excludes_compute=True)
    timers.wrap(state.inference_log, "write", FEATURES[3])
    timers.wrap(logging.getLogger("api_server"), "info", FEATURES[3])  # the access line
    client = app.test_client()
    headers = {"Authorization": f"Bearer {KEY}", "traceparent": f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"}
    seed = int(time.time())
    featured_ms: list[float] = []
    for number in range(args.requests + 20):
        body = {"instances": [{"prompt": "overhead"}], "parameters": {"seed": seed + number}}
        started = time.perf_counter()
        response = client.post(
            "/v1/models/noop:predict", json=body, headers={**headers, "Idempotency-Key": uuid.uuid4().hex}
        )
        elapsed = (time.perf_counter() - started) * 1000
        assert response.status_code == 200 and response.headers.get("X-Cache") == "miss", response.status_code
        timers.next_request()
        if number >= 20:  # warm-up
            featured_ms.append(elapsed)
    measured = timers.requests[20:]

    # Trace header parsing and binding the log context: microseconds, timed directly.
    rounds = 10000
    started = time.perf_counter()
    for _ in range(rounds):
        trace = trace_from_headers(headers)
        unbind_context(bind_context({"request_id": "x", **trace.log_fields("p")}))
    trace_ms = (time.perf_counter() - started) * 1000 / rounds

    plain = app_for(stack, features=False).test_client()
    plain_ms: list[float] = []
    for number in range(args.requests + 20):
        started = time.perf_counter()
        response = plain.post(
            "/v1/models/noop:predict",
            json={"instances": [{"prompt": f"overhead {number}"}]},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        assert response.status_code == 200, response.status_code
        if number >= 20:
            plain_ms.append((time.perf_counter() - started) * 1000)

    print(f"sync predict on noop, concurrency 1, {args.requests} requests, every feature in use (cache misses)")
    print(f"{'feature':>34} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}")
    for feature in FEATURES:
        values = [request.get(feature, 0.0) for request in measured]
        print(f"{feature:>34} {percentile(values, 0.5):>8.3f} {percentile(values, 0.9):>8.3f} "
              f"{sum(values) / len(values):>8.3f}")  # fmt: skip
    print(f"{'trace parse + log context':>34} {trace_ms:>8.3f}")
    totals = [sum(request.values()) for request in measured]
    print(f"{'all features (sum per request)':>34} {percentile(totals, 0.5) + trace_ms:>8.3f} "
          f"{percentile(totals, 0.9) + trace_ms:>8.3f} {sum(totals) / len(totals) + trace_ms:>8.3f}")  # fmt: skip
    print(f"end to end p50: {percentile(featured_ms, 0.5):.2f} ms with every feature, "
          f"{percentile(plain_ms, 0.5):.2f} ms with none (noise: the Pub/Sub round trip)")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.2f}")
    for candidate in (app, plain.application):
        app_state(candidate).close()


if __name__ == "__main__":
    main()
