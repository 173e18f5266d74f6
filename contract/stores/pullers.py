"""Which workers pull each request topic, and when each last found it empty, kept in Redis for the watchdog.

A request nobody has taken for a while is either queued behind others (every worker pulling its topic is busy:
the broker still has it, and a copy would only lengthen the queue) or lost (a worker pulled it and died before
taking its holder lease, and the emulator has been seen never to deliver such a message again). The two look
the same from the request's record; they differ in what its pullers did since it was published:

- a puller whose waiting pull came back empty after the request was published saw a queue without it: lost;
- a puller that stopped beating since then may have pulled it and died with it: lost;
- otherwise, while some puller is alive, every live puller has been too busy to pull, or pulled others first:
  queued behind busy workers, so no copy is made.

Each worker process beats for the topics it pulls (`beat`, a few times per holder lease) and says so when it
leaves cleanly (`leave`): a drained worker hands its requests back, so its going is not a death. Members whose
beat is an hour old are dropped, and the keys expire with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from contract import naming

# A lapsed puller is remembered this long (a death explains the loss of what was published up to then).
FORGET_AFTER_MS = 3_600_000
# An empty pull that began this soon after a publish may not have seen the message yet (clocks differ by
# milliseconds; the broker makes a message deliverable within about 50 ms locally).
PUBLISH_VISIBLE_MS = 1_000


@dataclass(frozen=True)
class TopicPullers:
    """One topic's pullers: each worker's last beat and the start of its last empty pull (epoch ms)."""

    beats: dict[str, int]
    empty_pulls: dict[str, int]

    def queued_behind_busy(self, published_ms: int, now_ms: int, lapse_ms: int) -> bool:
        """True when a request published at `published_ms` and untaken since is waiting behind busy workers: some
        puller is alive, none found the queue empty since the publish, and none died since it (a puller whose
        last beat is older than `lapse_ms`, beating after the request was published or within a lapse before)."""
        alive = [beat for beat in self.beats.values() if beat >= now_ms - lapse_ms]
        if not alive:
            return False  # nobody to explain the wait: copied as before (a copy costs nothing nobody pulls)
        if any(started >= published_ms + PUBLISH_VISIBLE_MS for started in self.empty_pulls.values()):
            return False
        return not any(published_ms - lapse_ms <= beat < now_ms - lapse_ms for beat in self.beats.values())


class PullerStore:
    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    def beat(
        self, worker: str, topics: list[str], now_ms: int, empty_pulls: dict[str, int], prune: bool = True
    ) -> None:
        """Says `worker` pulls `topics` as of `now_ms`; `empty_pulls`: topic -> when its latest empty pull began.
        `prune`: also drop members an hour silent and renew the keys' expiry (once a minute is plenty: a worker of
        many models beats for hundreds of topics)."""
        pipe = self._redis.pipeline(transaction=False)
        for topic in topics:
            keys = (naming.pullers_key(topic), naming.empty_pulls_key(topic))
            pipe.zadd(keys[0], {worker: now_ms})
            if topic in empty_pulls:
                pipe.zadd(keys[1], {worker: empty_pulls[topic]}, gt=True)
            if prune:
                for key in keys:
                    pipe.zremrangebyscore(key, "-inf", now_ms - FORGET_AFTER_MS)
                    pipe.pexpire(key, FORGET_AFTER_MS)
        pipe.execute()

    def leave(self, worker: str, topics: list[str]) -> None:
        """Ends `worker`'s beats on `topics`: it stopped pulling and handed back what it held."""
        pipe = self._redis.pipeline(transaction=False)
        for topic in topics:
            pipe.zrem(naming.pullers_key(topic), worker)
            pipe.zrem(naming.empty_pulls_key(topic), worker)
        pipe.execute()

    def pullers(self, topic: str) -> TopicPullers:
        pipe = self._redis.pipeline(transaction=False)
        pipe.zrange(naming.pullers_key(topic), 0, -1, withscores=True)
        pipe.zrange(naming.empty_pulls_key(topic), 0, -1, withscores=True)
        beats, empties = pipe.execute()
        return TopicPullers(
            beats={member.decode(): int(score) for member, score in beats},
            empty_pulls={member.decode(): int(score) for member, score in empties},
        )
