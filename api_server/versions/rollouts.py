"""Rollouts: changing a model's split at run time (audited), and the rollback guard that takes a failing canary
to 0% by itself.

The guard measures from the API's own observations, not the log: every sync answer that reached a model
version (its reply, an error reply or a timeout; both attempts of a fallback to the stable version; cache hits
and refusals excluded) and every submitted job when it ends (`job_log.py`) is added to a Redis sorted set per
version, `maas:rollout:obs:{model}:{version}`, scored by time, so every API process's calls count.
One API process at a time (a Redis lease) compares, over the catalog's `rollback.window_seconds`, each
canary's error rate and p95 total latency with the stable version's; a breach moves the canary's share to
the stable version, logs an ERROR and writes an audit row naming the breach. Recovery is a PUT or DELETE.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

from contract import naming
from contract.catalog import ModelCatalog, RollbackPolicy, Rollout

log = logging.getLogger(__name__)
GUARD_ACTOR = "rollback-guard"
AUDIT_TIMEOUT_SECONDS = 10


def observations_key(model: str, version: str) -> str:
    return f"{naming.PREFIX}:rollout:obs:{model}:{version}"


class AuditLog:
    """Writes one row per split change to the BigQuery audit table (streaming insert: rare, small rows)."""

    def __init__(self, client, table: str, instance_id: str) -> None:
        self._client = client
        self._table = table
        self._instance_id = instance_id

    def record(self, model: str, action: str, actor: str, before: dict, after: dict, reason: str | None) -> bool:
        row = {
            "at": datetime.now(UTC).isoformat(),
            "model": model,
            "action": action,
            "actor": actor,
            "from_split": json.dumps(before, sort_keys=True),
            "to_split": json.dumps(after, sort_keys=True),
            "reason": reason,
            "api_instance": self._instance_id,
        }
        try:
            errors = self._client.insert_rows_json(
                self._table, [row], row_ids=[uuid.uuid4().hex], timeout=AUDIT_TIMEOUT_SECONDS
            )
        except Exception as exc:  # noqa: BLE001 - transport errors of every kind: the change stands, logged in full
            errors = [str(exc)]
        if errors:
            log.error("audit row not written (%s): %s", errors, json.dumps(row))
            return False
        return True


@dataclass(frozen=True)
class Window:
    """What one version did over the window: calls, the share that failed, the p95 of their total latency."""

    requests: int
    error_rate: float
    p95_ms: float


def window_of(members: list[bytes]) -> Window:
    latencies, errors = [], 0
    for member in members:
        _, latency, ok = member.decode().rsplit("|", 2)
        latencies.append(float(latency))
        errors += ok != "1"
    if not latencies:
        return Window(0, 0.0, 0.0)
    latencies.sort()
    p95 = latencies[max(0, math.ceil(0.95 * len(latencies)) - 1)]
    return Window(len(latencies), errors / len(latencies), p95)


def breach(policy: RollbackPolicy, stable: Window, canary: Window) -> str | None:
    """Why the canary must go, or None (also None until both versions have `min_requests` in the window)."""
    if stable.requests < policy.min_requests or canary.requests < policy.min_requests:
        return None
    if canary.error_rate - stable.error_rate > policy.max_error_rate_delta:
        return (
            f"error rate {canary.error_rate:.1%} vs stable {stable.error_rate:.1%} over {canary.requests}/"
            f"{stable.requests} requests exceeds max_error_rate_delta {policy.max_error_rate_delta:g}"
        )
    if stable.p95_ms > 0 and canary.p95_ms / stable.p95_ms > policy.max_p95_ratio:
        return (
            f"p95 {canary.p95_ms:.0f} ms vs stable {stable.p95_ms:.0f} ms exceeds max_p95_ratio "
            f"{policy.max_p95_ratio:g}"
        )
    return None


class RolloutObservations:
    """Each versioned model's answered calls, kept in Redis for the rollback guard's window."""

    def __init__(self, catalog: ModelCatalog, client: redis.Redis) -> None:
        self._catalog = catalog
        self._redis = client

    def observe(self, model: str, version: str, request_id: str, total_ms: float, ok: bool) -> None:
        rollout = self._catalog.rollout(model)
        if rollout is None or rollout.rollback is None:
            return
        now = time.time()
        key = observations_key(model, version)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.zadd(key, {f"{request_id}|{total_ms:.1f}|{int(ok)}": now})
            pipe.zremrangebyscore(key, "-inf", now - rollout.rollback.window_seconds)
            pipe.expire(key, rollout.rollback.window_seconds * 2)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("rollout observation for %s not kept (%s)", model, type(exc).__name__)

    def window(self, model: str, version: str, seconds: int) -> Window:
        now = time.time()
        return window_of(self._redis.zrangebyscore(observations_key(model, version), now - seconds, "+inf"))

    def forget(self, model: str, version: str) -> None:
        self._redis.delete(observations_key(model, version))


class RollbackGuard:
    """A thread in every API process; the holder of the Redis lease checks every canary each interval."""

    def __init__(self, rollouts: Rollouts, client: redis.Redis, interval_seconds: float, instance_id: str) -> None:
        self._rollouts = rollouts
        self._redis = client
        self._interval = interval_seconds
        self._instance = instance_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if any(r.rollback for r in self._rollouts.catalog.rollouts.values()) and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollback-guard", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if self._lead():
                    self.check()
            except redis.RedisError as exc:
                log.warning("rollback guard skipped a check (%s)", type(exc).__name__)

    def _lead(self) -> bool:
        lease_ms = int(self._interval * 3000)
        key = naming.ROLLBACK_LEADER_KEY
        if self._redis.set(key, self._instance, nx=True, px=lease_ms):
            return True
        if self._redis.get(key) == self._instance.encode():
            self._redis.pexpire(key, lease_ms)
            return True
        return False

    def check(self) -> list[str]:
        """Rolls back every breaching canary; returns the models rolled back."""
        rolled = []
        for name, rollout in self._rollouts.catalog.rollouts.items():
            if rollout.rollback is not None and self._check_model(name, rollout):
                rolled.append(name)
        return rolled

    def _check_model(self, name: str, rollout: Rollout) -> bool:
        policy = rollout.rollback
        assert policy is not None
        split = self._rollouts.splits.split(name)
        observations = self._rollouts.observations
        stable = observations.window(name, rollout.stable, policy.window_seconds)
        for canary in rollout.canaries:
            if split.traffic.get(canary, 0) <= 0:
                continue
            why = breach(policy, stable, observations.window(name, canary, policy.window_seconds))
            if why:
                self._rollouts.roll_back(name, canary, why)
                return True
        return False


class Rollouts:
    """The admin operations on a model's split, each audited, and the rollback itself."""

    def __init__(self, catalog: ModelCatalog, splits, observations: RolloutObservations, audit: AuditLog) -> None:
        self.catalog = catalog
        self.splits = splits
        self.observations = observations
        self._audit = audit

    def set(self, model: str, traffic: dict[str, float], shadow, actor: str, reason: str | None) -> dict:
        before = self.splits.split(model).to_json()
        after = self.splits.put(model, traffic, shadow, actor, reason or "").to_json()
        self._audit.record(model, "set", actor, before, after, reason)
        log.warning("traffic split of %s set by %s: %s -> %s", model, actor, before["traffic"], after["traffic"])
        return after

    def reset(self, model: str, actor: str, reason: str | None) -> dict:
        before = self.splits.split(model).to_json()
        after = self.splits.reset(model).to_json()
        self._audit.record(model, "reset", actor, before, after, reason)
        log.warning("traffic split of %s reset to the catalog's by %s", model, actor)
        return after

    def roll_back(self, model: str, canary: str, why: str) -> dict:
        rollout = self.catalog.rollouts[model]
        split = self.splits.split(model)
        traffic = dict(split.traffic)
        traffic[rollout.stable] = traffic.get(rollout.stable, 0) + traffic.get(canary, 0)
        traffic[canary] = 0.0
        shadow = split.shadow if split.shadow is None or split.shadow.version != canary else None
        reason = f"automatic rollback of {model} version {canary}: {why}"
        before = split.to_json()
        after = self.splits.put(model, traffic, shadow, GUARD_ACTOR, reason).to_json()
        self.observations.forget(model, canary)
        log.error(reason, extra={"fields": {"model": model, "version": canary, "from": before, "to": after}})
        self._audit.record(model, "rollback", GUARD_ACTOR, before, after, reason)
        return after
