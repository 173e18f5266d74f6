"""A batch's record and its lines' bookkeeping in Redis, each step one atomic script under the batch's lease.

Keys, all under `maas:batch:{id}`:
- the hash itself: owner, status, times, input, the feeder's cursor (byte offset and line number of the last line
  it took), request_counts, part sequence numbers;
- `:lease`: the process working the batch (feeding, collecting, flushing), renewed every step; once it lapses
  (the process died) another process takes it and resumes from the cursor;
- `:seen`: the custom_ids taken (16-hex digests; about 60 bytes of Redis per line while the batch runs, deleted
  when it ends): a custom_id is published once;
- `:done`: after a Redis loss (`restore`), the line numbers already in part files: read again, they are skipped;
- `maas:batches:owner:{key}:active`: the key's batches not yet ended (`MAAS_BATCH_MAX_ACTIVE_PER_KEY`);
- `:pending`: published lines not yet collected (bounded by `MAAS_BATCH_MAX_IN_FLIGHT` per model), with their
  partial log rows; `:publishing`: the few whose publish was under way, with their message, so a resumed feeder
  republishes one only when neither its in-flight record nor its answer exists (the same request id: a worker
  answers it once);
- `:inflight`: lines in flight per model queue; `:outbox:{results|errors}`: collected lines waiting for their
  part file; `:part:{kind}:{seq}`: a part being written (renamed from the outbox atomically, so a part rewritten
  after a crash holds exactly the same lines, under the same name).

The record is mirrored to `gs://{payload bucket}/batches/{id}/batch.json` on every change of status and every
part written, so a lost Redis loses no batch's outcome.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from google.api_core import exceptions
from google.cloud import storage

from api_server.batches.lines import custom_id_digest
from contract import naming

log = logging.getLogger(__name__)
ACTIVE_KEY = "maas:batches:active"
# Ended batches whose webhook is still to call: any process that can sign claims one (SREM) and calls it once.
WEBHOOKS_KEY = "maas:batches:webhooks"
STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")
ENDED = frozenset({"completed", "failed", "cancelled", "expired"})
COUNTS = ("total", "succeeded", "failed", "cancelled", "expired")
KINDS = ("results", "errors")
# An ended batch's Redis record lives this long, its files in GCS at least as long (its download period).
ENDED_TTL_SECONDS = naming.BATCH_DOWNLOAD_SECONDS
TIME_FIELDS = ("created", "in_progress", "finalizing", "cancelling", "completed", "failed", "cancelled", "expired")

LEASED = "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end\n"
RENEW = LEASED + "redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1"
# Every write also needs the batch's record: after a Redis loss it is restored whole before anyone writes to it, so
# no step re-creates a part of a record Redis lost.
RECORDED = LEASED + "if redis.call('HEXISTS', KEYS[2], 'status') == 0 then return -1 end\n"
# Taking a line: never once the batch is ending (a cancel accepted, expired, failed: -2), and a line already in a
# part file before Redis lost the batch (`:done`, its line numbers, filled by `restore`) is skipped with the cursor
# moved past it (2): never published, counted or written again. KEYS[7] is `:done`, ARGV[line] the line's number.
TAKING = (
    RECORDED
    + "if redis.call('HEXISTS', KEYS[2], 'end_status') == 1 then return -2 end\n"
    + "if redis.call('SISMEMBER', KEYS[{done}], ARGV[{line}]) == 1 then\n"
    + "  redis.call('HSET', KEYS[2], 'cursor_offset', ARGV[{offset}], 'cursor_line', ARGV[{line}]) return 2 end\n"
)
# KEYS: lease, batch, seen, publishing, pending, inflight, done. ARGV: token, digest, rid, message, pending, queue,
# offset, line.
TAKE_VALID = (
    TAKING.format(done=7, offset=7, line=8)
    + """
if redis.call('SADD', KEYS[3], ARGV[2]) == 0 then return 0 end
redis.call('HSET', KEYS[4], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[5], ARGV[3], ARGV[5])
redis.call('HINCRBY', KEYS[6], ARGV[6], 1)
redis.call('HSET', KEYS[2], 'cursor_offset', ARGV[7], 'cursor_line', ARGV[8], 'valid_seen', '1')
redis.call('HINCRBY', KEYS[2], 'total', 1)
return 1"""
)
# KEYS: lease, batch, seen, errors outbox, done. ARGV: token, digest ('' for none), item, offset, line, first error.
TAKE_INVALID = (
    TAKING.format(done=5, offset=4, line=5)
    + """
if ARGV[2] ~= '' then redis.call('SADD', KEYS[3], ARGV[2]) end
redis.call('RPUSH', KEYS[4], ARGV[3])
redis.call('HSET', KEYS[2], 'cursor_offset', ARGV[4], 'cursor_line', ARGV[5])
redis.call('HSETNX', KEYS[2], 'first_error', ARGV[6])
redis.call('HINCRBY', KEYS[2], 'total', 1)
redis.call('HINCRBY', KEYS[2], 'failed', 1)
return 1"""
)
# KEYS: lease, batch, pending, inflight, outbox, publishing. ARGV: token, rid, queue, item, counter.
COLLECT = (
    RECORDED
    + """
if redis.call('HDEL', KEYS[3], ARGV[2]) == 0 then return 0 end
redis.call('HDEL', KEYS[6], ARGV[2])
redis.call('HINCRBY', KEYS[4], ARGV[3], -1)
redis.call('RPUSH', KEYS[5], ARGV[4])
redis.call('HINCRBY', KEYS[2], ARGV[5], 1)
return 1"""
)
# KEYS: lease, batch, outbox, parts set. ARGV: token, kind. Returns the part's key, or false.
CUT_PART = (
    RECORDED
    + """
if redis.call('LLEN', KEYS[3]) == 0 then return false end
local seq = redis.call('HINCRBY', KEYS[2], 'parts_' .. ARGV[2], 1)
local part = KEYS[2] .. ':part:' .. ARGV[2] .. ':' .. seq
redis.call('RENAME', KEYS[3], part)
redis.call('SADD', KEYS[4], part)
return part"""
)
# The lines a cancelled or expired batch never read, to its errors outbox as `cancelled`/`expired` (counted in
# `total` and that count), the cursor moved past each; a line already in a part file (`:done`) only moves the cursor.
# KEYS: lease, batch, errors outbox, done. ARGV: token, counter, then (item, end offset, line number) per line.
TAKE_UNRUN = (
    RECORDED
    + """
for i = 3, #ARGV, 3 do
  if redis.call('SISMEMBER', KEYS[4], ARGV[i + 2]) == 0 then
    redis.call('RPUSH', KEYS[3], ARGV[i])
    redis.call('HINCRBY', KEYS[2], 'total', 1)
    redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  end
  redis.call('HSET', KEYS[2], 'cursor_offset', ARGV[i + 1], 'cursor_line', ARGV[i + 2])
end
return 1"""
)
# A status moves forward only, on a whole record (never re-creating one Redis lost): `in_progress` from
# `validating`, `finalizing` from those two, and the end (`@end`) to the `end_status` set (`cancelled` once a cancel
# was accepted, whatever else was set) or `completed`. KEYS: batch, active set, webhooks, owner's active set.
# ARGV: status, now (ms), ended TTL (s), batch id, then field, value pairs. Returns the status set, or false.
SET_STATUS = """
local s = redis.call('HGET', KEYS[1], 'status')
if not s or s == 'completed' or s == 'failed' or s == 'cancelled' or s == 'expired' then return false end
local target = ARGV[1]
if target == '@end' then
  target = redis.call('HGET', KEYS[1], 'end_status') or 'completed'
  if s == 'cancelling' then target = 'cancelled' end
elseif target == 'in_progress' then
  if s ~= 'validating' then return false end
elseif target == 'finalizing' then
  if s ~= 'validating' and s ~= 'in_progress' then return false end
else
  return false
end
redis.call('HSET', KEYS[1], 'status', target, target .. '_ms', ARGV[2])
for i = 5, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[1] == '@end' then
  redis.call('SREM', KEYS[2], ARGV[4])
  redis.call('SREM', KEYS[4], ARGV[4])
  if redis.call('HEXISTS', KEYS[1], 'webhook_url') == 1 then redis.call('SADD', KEYS[3], ARGV[4]) end
  for _, suffix in ipairs({'seen', 'pending', 'publishing', 'inflight', 'done'}) do
    redis.call('DEL', KEYS[1] .. ':' .. suffix)
  end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return target"""
# The end a batch is heading to, set once on a whole record (a cancel accepted first stays a cancel).
# KEYS: batch. ARGV: end status, then field, value pairs.
SET_ENDING = """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 or redis.call('HEXISTS', KEYS[1], 'end_status') == 1 then
  return 0 end
redis.call('HSET', KEYS[1], 'end_status', ARGV[1])
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1"""
# A batch is created only while its key has fewer than its cap of active batches. KEYS: batch, owner's list,
# active set, owner's active set. ARGV: cap, batch id, created (ms), then field, value pairs. 0: at the cap.
CREATE = """
if redis.call('SCARD', KEYS[4]) >= tonumber(ARGV[1]) then return 0 end
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[2])
return 1"""
# What a mirrored record must hold: a write that would leave GCS with less (a record Redis lost) is not made.
WHOLE = ("owner", "status", "created_ms", "expires_ms", "input_file")


def batch_key(batch_id: str) -> str:
    return f"maas:batch:{batch_id}"


def owner_key(owner: str) -> str:
    return f"maas:batches:owner:{owner}"


def owner_active_key(owner: str) -> str:
    """The key's batches not yet ended: what `MAAS_BATCH_MAX_ACTIVE_PER_KEY` counts."""
    return f"maas:batches:owner:{owner}:active"


def iso(epoch_ms: int | None) -> str | None:
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat()


@dataclass
class Batch:
    """A batch's record as read from Redis (or its GCS copy)."""

    batch_id: str
    fields: dict[str, str]

    @property
    def status(self) -> str:
        return self.fields["status"]

    @property
    def owner(self) -> str:
        return self.fields["owner"]

    def int(self, name: str, default: int = 0) -> int:
        value = self.fields.get(name)
        return int(value) if value not in (None, "") else default

    def time(self, name: str) -> int | None:
        value = self.fields.get(f"{name}_ms")
        return int(value) if value else None

    @property
    def expires_ms(self) -> int:
        return self.int("expires_ms")

    @property
    def ended(self) -> bool:
        return self.status in ENDED


class BatchStore:
    def __init__(self, client: redis.Redis, bucket: storage.Bucket) -> None:
        self._redis = client
        self._bucket = bucket
        self._renew = client.register_script(RENEW)
        self._take_valid = client.register_script(TAKE_VALID)
        self._take_invalid = client.register_script(TAKE_INVALID)
        self._collect = client.register_script(COLLECT)
        self._cut_part = client.register_script(CUT_PART)
        self._set_status = client.register_script(SET_STATUS)
        self._take_unrun = client.register_script(TAKE_UNRUN)
        self._set_ending = client.register_script(SET_ENDING)
        self._create = client.register_script(CREATE)

    @property
    def bucket(self) -> storage.Bucket:
        return self._bucket

    def object_name(self, batch_id: str, name: str) -> str:
        return naming.batch_prefix(batch_id) + name

    def uri(self, batch_id: str, name: str = "") -> str:
        return f"gs://{self._bucket.name}/{self.object_name(batch_id, name)}"

    # The record.

    def create(self, batch_id: str, fields: dict[str, str | int], max_active: int) -> Batch | None:
        """The new batch, or None when its key has `max_active` batches not yet ended (checked and counted in one
        script, so concurrent submits cannot pass the cap together)."""
        owner = str(fields["owner"])
        keys = [batch_key(batch_id), owner_key(owner), ACTIVE_KEY, owner_active_key(owner)]
        flat = [item for pair in {**fields, **dict.fromkeys(COUNTS, 0)}.items() for item in pair]
        if not self._create(keys=keys, args=[max_active, batch_id, int(fields["created_ms"]), *flat]):
            return None
        batch = self.get(batch_id)
        assert batch is not None
        self.mirror(batch)
        self._bucket.blob(naming.BATCHES_ACTIVE_PREFIX + batch_id).upload_from_string(b"")
        return batch

    def get(self, batch_id: str, owner: str | None = None, mirrored: bool = True) -> Batch | None:
        """The batch as `owner` may see it (None: absent, or another key's); Redis first, then (`mirrored`) its GCS
        copy. The runner reads Redis only: a batch Redis lost is worked again once restored whole."""
        raw = self._redis.hgetall(batch_key(batch_id))
        fields = {key.decode(): value.decode() for key, value in raw.items()}
        if "status" not in fields:
            fields = self._mirrored(batch_id) if mirrored else {}
        if not fields or (owner is not None and fields.get("owner") != owner):
            return None
        return Batch(batch_id, fields)

    def _mirrored(self, batch_id: str) -> dict[str, str]:
        blob = self._bucket.blob(self.object_name(batch_id, "batch.json"))
        try:
            return json.loads(blob.download_as_bytes())
        except Exception:  # noqa: BLE001 - NotFound or unreachable: no such batch here
            return {}

    def mirror(self, batch: Batch) -> None:
        """Copies the record to GCS (what survives a lost Redis), with the safe cursor: where a restored batch
        resumes reading so that no line is lost (the first line not yet in a part file). A record missing any of
        `WHOLE` (a part of one Redis lost) never replaces the copy."""
        if any(name not in batch.fields for name in WHOLE):
            log.warning("batch %s: a partial record is not mirrored", batch.batch_id)
            return
        fields = dict(batch.fields)
        if not batch.ended:
            fields["safe_offset"], fields["safe_line"] = self._safe_cursor(batch)
        blob = self._bucket.blob(self.object_name(batch.batch_id, "batch.json"))
        blob.upload_from_string(json.dumps(fields), content_type="application/json")

    def _safe_cursor(self, batch: Batch) -> tuple[int, int]:
        key = batch_key(batch.batch_id)
        starts = [(entry.get("start", 0), entry["line"]) for entry in self.pending(batch.batch_id).values()]
        for name in [f"{key}:outbox:{kind}" for kind in KINDS] + self.parts(batch.batch_id):
            for raw in self._redis.lrange(name, 0, -1):
                item = json.loads(raw)
                starts.append((item.get("start", 0), item["line"]["line"]))
        if not starts:
            return batch.int("cursor_offset"), batch.int("cursor_line")
        offset, line = min(starts)
        return offset, line - 1

    # After a Redis loss.

    def orphaned(self) -> list[str]:
        """Running batches (by their GCS markers) whose Redis record is gone."""
        ids = [blob.name.removeprefix(naming.BATCHES_ACTIVE_PREFIX)
               for blob in self._bucket.list_blobs(prefix=naming.BATCHES_ACTIVE_PREFIX)]  # fmt: skip
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.exists(batch_key(batch_id))
        return [batch_id for batch_id, there in zip(ids, pipe.execute(), strict=True) if not there]

    def restore(self, batch_id: str) -> bool:
        """Rebuilds a batch Redis lost from its GCS copy and its part files: the lines in parts are done (skipped
        when read again), the counts are the parts', reading resumes at the safe cursor. One process does it."""
        key = batch_key(batch_id)
        if self._redis.exists(key) or not self._redis.set(f"{key}:restoring", "1", nx=True, ex=120):
            return False
        fields = self._mirrored(batch_id)
        if not fields or fields.get("status") in ENDED:
            self._bucket.blob(naming.BATCHES_ACTIVE_PREFIX + batch_id).delete()
            return False
        done: set[int] = set()  # line numbers
        seen: set[str] = set()
        counts = dict.fromkeys(COUNTS, 0)
        for kind in KINDS:
            for blob in self._bucket.list_blobs(prefix=self.object_name(batch_id, f"{kind}/")):
                seq = int(blob.name.rsplit("part-", 1)[1].split(".")[0])
                fields[f"parts_{kind}"] = str(max(seq, int(fields.get(f"parts_{kind}") or 0)))
                for text in blob.download_as_text().splitlines():
                    item = json.loads(text)
                    if custom_id := item.get("custom_id"):
                        seen.add(custom_id_digest(custom_id))
                    done.add(int(item["line"]))
                    counts[item["status"]] += 1
                    counts["total"] += 1
        fields.update({name: str(value) for name, value in counts.items()})
        fields["cursor_offset"] = str(fields.pop("safe_offset", fields.get("cursor_offset", 0)))
        fields["cursor_line"] = str(fields.pop("safe_line", fields.get("cursor_line", 0)))
        if fields.get("end_status") not in ("cancelled", "expired", "failed"):
            fields.pop("feed_done", None)  # lines that were in flight are read again
        fields["restored_ms"] = str(int(time.time() * 1000))
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        for name, members in ((f"{key}:done", sorted(done)), (f"{key}:seen", sorted(seen))):
            for start in range(0, len(members), 10_000):
                pipe.sadd(name, *members[start : start + 10_000])
        pipe.zadd(owner_key(fields["owner"]), {batch_id: int(fields["created_ms"])})
        pipe.sadd(ACTIVE_KEY, batch_id)
        pipe.sadd(owner_active_key(fields["owner"]), batch_id)
        pipe.execute()
        return True

    def list_for(self, owner: str, limit: int, before_ms: int | None = None) -> list[Batch]:
        top = f"({before_ms}" if before_ms is not None else "+inf"
        ids = self._redis.zrevrangebyscore(owner_key(owner), top, "-inf", start=0, num=limit)
        return [batch for raw in ids if (batch := self.get(raw.decode(), owner)) is not None]

    def active(self) -> list[str]:
        return sorted(member.decode() for member in self._redis.smembers(ACTIVE_KEY))

    def active_count(self, owner: str) -> int:
        return int(self._redis.scard(owner_active_key(owner)))

    def owners(self, batch_ids: list[str]) -> dict[str, str]:
        """Each batch's key (a batch whose record is gone is left out): the runner's turns are fair across keys."""
        pipe = self._redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            pipe.hget(batch_key(batch_id), "owner")
        return {batch_id: owner.decode() for batch_id, owner in zip(batch_ids, pipe.execute(), strict=True) if owner}

    def set_fields(self, batch_id: str, **fields: str | int) -> None:
        """Only on a whole record (never re-creating a part of one Redis lost)."""
        flat = [item for pair in fields.items() for item in pair]
        script = "if redis.call('HEXISTS', KEYS[1], 'status') == 1 then redis.call('HSET', KEYS[1], unpack(ARGV)) end"
        self._redis.eval(script, 1, batch_key(batch_id), *flat)

    def set_ending(self, batch_id: str, end_status: str, **fields: str | int) -> bool:
        """Sets the end the batch is heading to (`expired`, `failed`) with `fields`, unless one was set already (a
        cancel accepted stays a cancel) or the record is gone; True when set."""
        flat = [item for pair in fields.items() for item in pair]
        return bool(self._set_ending(keys=[batch_key(batch_id)], args=[end_status, *flat]))

    def set_status(self, batch_id: str, status: str, **fields: str | int) -> Batch | None:
        """Moves the batch forward to `status` (`in_progress`, `finalizing`, or `@end`: its `end_status` or
        `completed`), stamping `{status}_ms`, and mirrors it; an ended batch leaves the active sets and its
        bookkeeping is deleted. None, and nothing written, when the record is gone (Redis lost it: never re-created
        in part) or the move would go back (a cancel accepted meanwhile)."""
        key = batch_key(batch_id)
        owner = self._redis.hget(key, "owner")
        if owner is None:
            return None
        now_ms = int(time.time() * 1000)
        keys = [key, ACTIVE_KEY, WEBHOOKS_KEY, owner_active_key(owner.decode())]
        flat = [item for pair in fields.items() for item in pair]
        moved = self._set_status(keys=keys, args=[status, now_ms, ENDED_TTL_SECONDS, batch_id, *flat])
        if not moved:
            return None
        batch = self.get(batch_id, mirrored=False)
        if batch is None:
            return None
        self.mirror(batch)
        if batch.ended:
            with contextlib.suppress(exceptions.NotFound):
                self._bucket.blob(naming.BATCHES_ACTIVE_PREFIX + batch_id).delete()
        return batch

    def request_cancel(self, batch_id: str) -> bool:
        """Marks a running batch cancelling; False when it had ended (or was being cancelled) already."""
        key = batch_key(batch_id)
        now_ms = int(time.time() * 1000)
        script = (
            "local s = redis.call('HGET', KEYS[1], 'status') "
            "if s == 'validating' or s == 'in_progress' or s == 'finalizing' then "
            "redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_ms', ARGV[1], 'end_status', 'cancelled') "
            "return 1 end return 0"
        )
        changed = bool(self._redis.eval(script, 1, key, now_ms))
        if changed:
            batch = self.get(batch_id)
            assert batch is not None
            self.mirror(batch)
        return changed

    # The lease.

    def acquire(self, batch_id: str, token: str, lease_seconds: float) -> str | None:
        """`renewed` when this process held the batch's lease, `taken` when it takes it now (what it remembers
        of the batch is stale: the lease lapsed, or Redis lost it), None when another process holds it."""
        key = f"{batch_key(batch_id)}:lease"
        ms = int(lease_seconds * 1000)
        if self._renew(keys=[key], args=[token, ms]) == 1:
            return "renewed"
        if not self._redis.hexists(batch_key(batch_id), "status"):
            return None  # lost with Redis: restored first (`restore`)
        return "taken" if self._redis.set(key, token, nx=True, px=ms) else None

    def renew(self, batch_id: str, token: str, lease_seconds: float) -> bool:
        """Extends a lease this process holds (False: it does not hold it any more)."""
        key = f"{batch_key(batch_id)}:lease"
        return self._renew(keys=[key], args=[token, int(lease_seconds * 1000)]) == 1

    def release(self, batch_id: str, token: str) -> None:
        script = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
        self._redis.eval(script, 1, f"{batch_key(batch_id)}:lease", token)

    # The lines.

    def _keys(self, batch_id: str, *suffixes: str) -> list[str]:
        key = batch_key(batch_id)
        return [f"{key}:lease", key, *(f"{key}:{suffix}" for suffix in suffixes)]

    def take_valid(
        self, batch_id: str, token: str, digest: str, request_id: str, message: dict, pending: dict, queue: str,
        offset: int, line: int,
    ) -> int:  # fmt: skip
        """1: taken (publish it now); 0: its custom_id was taken already; 2: answered before Redis lost the batch
        (skipped, the cursor moved past it); -1: the lease (or the record) was lost; -2: the batch is ending (a
        cancel accepted, expired or failed): nothing more is taken."""
        keys = self._keys(batch_id, "seen", "publishing", "pending", "inflight", "done")
        args = [token, digest, request_id, json.dumps(message), json.dumps(pending), queue, offset, line]
        return int(self._take_valid(keys=keys, args=args))

    def ending(self, batch_id: str) -> bool:
        """Whether the batch is ending (a cancel accepted, expired, failed) or its record is gone."""
        key = batch_key(batch_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hexists(key, "end_status")
        pipe.hexists(key, "status")
        ending, there = pipe.execute()
        return bool(ending) or not there

    def published(self, batch_id: str, request_id: str) -> None:
        self._redis.hdel(f"{batch_key(batch_id)}:publishing", request_id)

    def take_invalid(self, batch_id: str, token: str, entries: list[tuple[str | None, dict, int, int, str]]) -> bool:
        """Invalid lines to the errors outbox, in file order, in one round trip: (custom_id digest, item, end
        offset, line number, first error) each; a line already in a part file before Redis lost the batch is skipped.
        False when the lease was lost or the batch is ending."""
        keys = self._keys(batch_id, "seen", "outbox:errors", "done")
        pipe = self._redis.pipeline(transaction=False)
        for digest, item, offset, line, first_error in entries:
            self._take_invalid(
                keys=keys, args=[token, digest or "", json.dumps(item), offset, line, first_error], client=pipe
            )
        return all(int(result) >= 1 for result in pipe.execute())

    def take_unrun(self, batch_id: str, token: str, counter: str, entries: list[tuple[dict, int, int]]) -> bool:
        """Lines never run (the batch was cancelled or expired first) to the errors outbox: (item, end offset, line
        number) each, in file order, in one script. False when the lease was lost."""
        args: list = [token, counter]
        for item, offset, line in entries:
            args += [json.dumps(item), offset, line]
        keys = self._keys(batch_id, "outbox:errors", "done")
        return int(self._take_unrun(keys=keys, args=args)) == 1

    def publishing(self, batch_id: str) -> dict[str, dict]:
        raw = self._redis.hgetall(f"{batch_key(batch_id)}:publishing")
        return {key.decode(): json.loads(value) for key, value in raw.items()}

    def pending(self, batch_id: str) -> dict[str, dict]:
        raw = self._redis.hgetall(f"{batch_key(batch_id)}:pending")
        return {key.decode(): json.loads(value) for key, value in raw.items()}

    def in_flight(self, batch_id: str) -> dict[str, int]:
        raw = self._redis.hgetall(f"{batch_key(batch_id)}:inflight")
        return {key.decode(): int(value) for key, value in raw.items()}

    def collect(self, batch_id: str, token: str, ends: list[tuple[str, str, str, dict, str]]) -> list[int]:
        """Moves pending lines to their outboxes and counts them, each once, in order, in one round trip: (request
        id, queue, kind, item, counter) each; per line 1 done, 0 collected already, -1 lease lost."""
        pipe = self._redis.pipeline(transaction=False)
        for request_id, queue, kind, item, counter in ends:
            keys = self._keys(batch_id, "pending", "inflight", f"outbox:{kind}", "publishing")
            self._collect(keys=keys, args=[token, request_id, queue, json.dumps(item), counter], client=pipe)
        return [int(result) for result in pipe.execute()]

    def cut_part(self, batch_id: str, token: str, kind: str) -> str | None:
        keys = self._keys(batch_id, f"outbox:{kind}", "parts")
        part = self._cut_part(keys=keys, args=[token, kind])
        return part.decode() if isinstance(part, bytes) else part

    def parts(self, batch_id: str) -> list[str]:
        return sorted(member.decode() for member in self._redis.smembers(f"{batch_key(batch_id)}:parts"))

    def part_items(self, part: str) -> list[dict]:
        return [json.loads(item) for item in self._redis.lrange(part, 0, -1)]

    def part_written(self, batch_id: str, part: str) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.srem(f"{batch_key(batch_id)}:parts", part)
        pipe.delete(part)
        pipe.execute()

    def outbox_empty(self, batch_id: str) -> bool:
        key = batch_key(batch_id)
        pipe = self._redis.pipeline(transaction=False)
        for kind in KINDS:
            pipe.llen(f"{key}:outbox:{kind}")
        pipe.scard(f"{key}:parts")
        return not any(pipe.execute())

    def webhooks_due(self) -> list[str]:
        return sorted(member.decode() for member in self._redis.smembers(WEBHOOKS_KEY))

    def claim_webhook(self, batch_id: str) -> bool:
        """True for exactly one caller across processes: that one calls the batch's webhook."""
        return bool(self._redis.srem(WEBHOOKS_KEY, batch_id))


def input_fields(uri: str | None) -> dict:
    """The record keeps its input's URI whichever it is; the view names a table `input_table` (and no file)."""
    if uri is not None and uri.startswith("bq://"):
        return {"input_file": None, "input_table": uri}
    return {"input_file": uri}


def view(batch: Batch, store: BatchStore) -> dict:
    """A batch as `GET /v1/batches/{id}`, its list and its webhook show it."""
    fields, batch_id = batch.fields, batch.batch_id
    body: dict = {
        "id": batch_id,
        "object": "batch",
        "status": batch.status,
        **input_fields(fields.get("input_file")),
        "completion_window": fields.get("completion_window"),
        "request_counts": {name: batch.int(name) for name in COUNTS},
        "created_at": iso(batch.time("created")),
        "expires_at": iso(batch.expires_ms),
        **{f"{name}_at": iso(batch.time(name)) for name in TIME_FIELDS[1:] if batch.time(name) is not None},
        "output": {
            "results": store.uri(batch_id, "results/"),
            "errors": store.uri(batch_id, "errors/"),
            "images": store.uri(batch_id, "images/"),
        },
        "links": {
            "self": f"/v1/batches/{batch_id}",
            "results": f"/v1/batches/{batch_id}/results",
            "errors": f"/v1/batches/{batch_id}/errors",
        },
        "metadata": json.loads(fields.get("metadata") or "{}"),
    }
    if fields.get("error"):
        body["error"] = json.loads(fields["error"])
    return body
