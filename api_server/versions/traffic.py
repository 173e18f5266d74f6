"""The traffic split in force for each versioned model: the catalog's, or the one an admin set at run time.

A split set with PUT /v1/models/{m}/traffic is stored in Redis (`maas:traffic:{model}`); every API process
re-reads those keys every `MAAS_TRAFFIC_REFRESH_SECONDS` on a thread of its own, so a change is in force
everywhere within about that long. When Redis cannot be read, a process keeps the last split it saw. A
request's version is a pure function of its request id (or of its API key, for `sticky: api_key`), so a
split of 90/10 sends 10% of ids to the canary, and the same id always gets the same version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime

import redis

from contract import naming
from contract.catalog import ModelCatalog, Rollout, Shadow, split_problem

log = logging.getLogger(__name__)


def _point(key: str) -> float:
    """A uniform point in [0, 100) drawn from `key`: the same key gives the same point in every process."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 * 100


def choose_version(traffic: dict[str, float], key: str) -> str:
    """The version `key` lands on: versions in name order take consecutive slices of [0, 100) by share."""
    point, cumulative, last = _point(key), 0.0, None
    for version in sorted(traffic):
        share = traffic[version]
        if share <= 0:
            continue
        cumulative += share
        last = version
        if point < cumulative:
            return version
    if last is None:
        raise ValueError("a split with no version above 0%")
    return last  # rounding at the top of the range


def shadowed(shadow: Shadow | None, request_id: str) -> bool:
    """Whether this request is also sent to the shadow version (a draw independent of the version's)."""
    return shadow is not None and _point(f"shadow:{request_id}") < shadow.percent


@dataclass(frozen=True)
class Split:
    """The traffic shares per version and the optional shadow, with where they come from."""

    traffic: dict[str, float]
    shadow: Shadow | None = None
    source: str = "catalog"  # or "runtime": set with PUT /v1/models/{m}/traffic
    set_by: str | None = None
    set_at: str | None = None
    reason: str | None = None

    def to_json(self) -> dict:
        return {
            "traffic": self.traffic,
            "shadow": self.shadow.model_dump() if self.shadow else None,
            "source": self.source,
            "set_by": self.set_by,
            "set_at": self.set_at,
            "reason": self.reason,
        }


def catalog_split(rollout: Rollout) -> Split:
    return Split(dict(rollout.traffic), rollout.shadow)


class InvalidSplitError(ValueError):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


def validated_split(rollout: Rollout, traffic: object, shadow: object) -> tuple[dict[str, float], Shadow | None]:
    """The body of a PUT as a split, or InvalidSplitError naming the field (known versions, sum 100, ...)."""
    if not isinstance(traffic, dict) or not traffic:
        raise InvalidSplitError("traffic", "traffic must be an object of version: percent")
    shares: dict[str, float] = {}
    for version, share in traffic.items():
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 100:
            raise InvalidSplitError(f"traffic.{version}", f"traffic.{version} must be a number from 0 to 100")
        shares[str(version)] = float(share)
    parsed: Shadow | None = None
    if shadow is not None:
        if not isinstance(shadow, dict):
            raise InvalidSplitError("shadow", "shadow must be an object {version, percent} or null")
        if not isinstance(shadow.get("version"), str):
            raise InvalidSplitError("shadow.version", "shadow.version must be a version name")
        percent = shadow.get("percent")
        if isinstance(percent, bool) or not isinstance(percent, int | float) or not 0 < percent <= 100:
            raise InvalidSplitError("shadow.percent", "shadow.percent must be a number above 0 and at most 100")
        unknown = set(shadow) - {"version", "percent"}
        if unknown:
            raise InvalidSplitError("shadow", f"shadow has unknown fields {sorted(unknown)}")
        parsed = Shadow(version=shadow["version"], percent=float(percent))
    problem = split_problem(rollout.versions, shares, parsed, rollout.stable)
    if problem:
        raise InvalidSplitError(*problem)
    return shares, parsed


@dataclass
class TrafficSplits:
    """Per versioned model, the split this process applies; refreshed from Redis on a thread of its own."""

    catalog: ModelCatalog
    redis: redis.Redis
    refresh_seconds: float = 0.5
    _splits: dict[str, Split] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._splits = {name: catalog_split(rollout) for name, rollout in self.catalog.rollouts.items()}

    def start(self) -> None:
        if not self.catalog.rollouts or self._thread is not None:
            return
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="traffic-splits", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def split(self, model: str) -> Split:
        return self._splits[model]

    def refresh(self) -> bool:
        """Reads every runtime split; False (and the last ones kept) when Redis cannot be read."""
        names = list(self.catalog.rollouts)
        try:
            values = self.redis.mget([naming.traffic_key(name) for name in names])
        except redis.RedisError as exc:
            log.warning("traffic splits not refreshed, keeping the last seen (%s)", type(exc).__name__)
            return False
        for name, value in zip(names, values, strict=True):
            self._splits[name] = self._parse(name, value)
        return True

    def _parse(self, name: str, value: bytes | None) -> Split:
        rollout = self.catalog.rollouts[name]
        if value is None:
            return catalog_split(rollout)
        try:
            stored = json.loads(value)
            traffic, shadow = validated_split(rollout, stored["traffic"], stored.get("shadow"))
        except (ValueError, KeyError, TypeError) as exc:  # a split for versions the catalog no longer has
            log.error("ignoring stored split for %s (%s); the catalog's applies", name, exc)
            return catalog_split(rollout)
        return Split(traffic, shadow, "runtime", stored.get("set_by"), stored.get("set_at"), stored.get("reason"))

    def put(self, model: str, traffic: dict[str, float], shadow: Shadow | None, who: str, reason: str) -> Split:
        """Stores a split for every process (raises redis errors); this process applies it at once."""
        split = Split(traffic, shadow, "runtime", who, datetime.now(UTC).isoformat(), reason)
        self.redis.set(naming.traffic_key(model), json.dumps(split.to_json()))
        self._splits[model] = split
        return split

    def reset(self, model: str) -> Split:
        """Back to the catalog's split (raises redis errors)."""
        self.redis.delete(naming.traffic_key(model))
        self._splits[model] = catalog_split(self.catalog.rollouts[model])
        return self._splits[model]

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            self.refresh()
