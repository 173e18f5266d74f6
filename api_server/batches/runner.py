"""The feeder and the collector: one background thread per API process works the batches whose lease it holds.

Each step of a leased batch, in order:
1. **End?** Past its window, the batch ends `expired`; cancelled, `cancelled`: nothing more is fed, and every
   line still in flight is marked cancelled for the workers and answered now (`expired`/`cancelled`), while the
   lines that finished keep their answers.
2. **Republish** the lines a dead feeder took but may not have published (`store.py`, `:publishing`): only those
   with neither an in-flight record nor a stored answer; the request id is the same, so a worker answers it once.
3. **Feed**: the next lines of the file (a stream from the cursor), each validated as the predict route does
   (`lines.py`; its images named by `gs://` URI read first, under the key's batch input locations: `inputs.py`): an
   invalid one goes to the errors file with the predict's status and message; a valid one is
   taken (cursor, custom_id and in-flight count in one script) and published at priority `batch` to its model's
   batch topic, while that model has fewer than its bound of the batch's lines in flight: the capacity its batch
   workers can use (contract/batch_capacity.py: their max replicas x max_batch_size x 4), or
   `MAAS_BATCH_MAX_IN_FLIGHT` where set.
   The first `MAAS_BATCH_FAIL_FAST_LINES` lines all invalid fail the batch.
4. **Collect**: the stored answers of the lines in flight (the worker's result store: a redelivered or re-run line
   has one answer), each moved once to its outbox with its completed log row.
5. **Flush**: outboxes become numbered part files (`results/part-000001.jsonl`, `errors/...`), readable while the
   batch runs; a part's log rows are written after its file. Then the batch ends when nothing is left.

The replies topic (`naming.BATCH_REPLIES_TOPIC`) only wakes the thread: the stored answer is what counts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import redis
from google.cloud import pubsub_v1

from api_server.batches.inputs import BatchInputPolicy
from api_server.batches.lines import InvalidLine, Line, custom_id_digest, custom_id_of, read_lines, validate_line
from api_server.batches.store import KINDS, Batch, BatchStore, view
from api_server.batches.tables import read_table
from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.flows.rows import rows_of
from api_server.flows.serving import FlowService
from api_server.inference_log.job_rows import ended_row
from api_server.inference_log.records import listed, mask_fraction, now_to_the_millisecond
from api_server.inference_log.writer import InferenceLogRow, InferenceLogWriter
from api_server.jobs.service import stage_timings
from api_server.jobs.webhooks import WebhookNotifier
from api_server.predict.inference import InferenceService, PreparedRequest
from api_server.predict.serving import ServingStage
from contract import naming
from contract.batch_capacity import batch_in_flight_bound
from contract.catalog import ModelCatalog
from contract.generation import LOGGED_PARAMETERS
from contract.messages import InferenceReply, InferenceRequest
from contract.model_spec import ModelSpec
from contract.outcomes import Outcome
from contract.payloads import PayloadCodec
from contract.settings import Settings
from contract.stores.results import ResultStore

log = logging.getLogger(__name__)
FEED_SLICE_SECONDS = 0.5
FLUSH_EVERY_SECONDS = 1.0
IDLE_WAIT_SECONDS = 0.2
# Invalid lines are written to the errors outbox this many at a time (one Redis round trip).
INVALID_PER_ROUND_TRIP = 200
# How often each process looks for running batches whose Redis record is gone (GCS markers).
RESTORE_EVERY_SECONDS = 10.0
IO_THREADS = 16
# A step never waits longer than this on its publishes, or on its answers' image copies (it fails, and the next
# step does it again: every part of it is resumable).
PUBLISH_WAIT_SECONDS, ANSWER_WAIT_SECONDS = 30.0, 120.0
# The longest a step may take (its waits above, and its part uploads): leases are renewed while the loop moved on
# within this long.
STEP_BOUND_SECONDS = 180.0


@dataclass
class Reader:
    """An open input stream of a leased batch, and the line read but not yet taken (its model was full)."""

    stream: object
    lines: object
    held: tuple[Line, PreparedRequest | InvalidLine] | None = None
    draining: bool = False  # reading what a cancelled or expired batch never ran (`_list_unrun`)
    flushed_at: float = field(default_factory=time.monotonic)


class BatchRunner:
    def __init__(
        self,
        settings: Settings,
        store: BatchStore,
        serving: ServingStage,
        inference: InferenceService,
        payloads: PayloadCodec,
        results: ResultStore,
        redis_client: redis.Redis,
        inference_log: InferenceLogWriter,
        catalog: ModelCatalog,
        storage_client,
        webhooks: WebhookNotifier | None = None,
        subscriber: pubsub_v1.SubscriberClient | None = None,
        flows: FlowService | None = None,
        bigquery_client=None,
        inputs: BatchInputPolicy | None = None,
    ) -> None:
        self._settings = settings
        self._bigquery = bigquery_client
        self._inputs = inputs  # reads a line's images named by gs:// URI (none: such a line is refused)
        self._flows = flows
        self._store = store
        self._serving = serving
        self._inference = inference
        self._payloads = payloads
        self._results = results
        self._redis = redis_client
        self._log = inference_log
        self._catalog = catalog
        self._storage = storage_client
        self._webhooks = webhooks
        self._subscriber = subscriber
        self._token = f"{settings.instance_id}-{uuid.uuid4().hex[:8]}"
        self._readers: dict[str, Reader] = {}
        # Publishes and image copies overlap on this pool (each waits on Pub/Sub or GCS, not on CPU).
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="batch-io")
        self._publishes: list[Future] = []
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._streaming = None
        self._thread = threading.Thread(target=self._run, name="batch-runner", daemon=True)
        # The leases held (renewed by `_heartbeat`), and each key's next turn (`turns`).
        self._held: set[str] = set()
        self._turns: dict[str, int] = {}
        self._beat = time.monotonic()
        self._beating = threading.Thread(target=self._heartbeat, name="batch-lease", daemon=True)

    def start(self) -> None:
        if self._subscriber is not None:
            path = self._subscriber.subscription_path(self._settings.project_id, naming.BATCH_REPLIES_SUBSCRIPTION)
            with contextlib.suppress(Exception):
                self._streaming = self._subscriber.subscribe(path, self._replied)
        self._thread.start()
        self._beating.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._streaming is not None:
            self._streaming.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._beating.is_alive():
            self._beating.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for batch_id in set(self._readers) | self._held:
            self._drop(batch_id)
            with contextlib.suppress(redis.RedisError):
                self._store.release(batch_id, self._token)

    def _replied(self, message) -> None:
        message.ack()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        restored_at = 0.0
        while not self._stopped.is_set():
            worked = False
            try:
                if time.monotonic() - restored_at >= RESTORE_EVERY_SECONDS:
                    restored_at = time.monotonic()
                    self._restore()
                for batch_id in self.turns():
                    if self._stopped.is_set():
                        break
                    self._beat = time.monotonic()
                    lease = self._store.acquire(batch_id, self._token, self._settings.batch_lease_seconds)
                    if lease != "renewed":
                        self._drop(batch_id)  # a reader from before is stale: reopened at the cursor in Redis
                    if lease is None:
                        self._held.discard(batch_id)
                        continue
                    self._held.add(batch_id)
                    worked |= self.step(batch_id)
                self._beat = time.monotonic()
                self._call_webhooks()
            except redis.RedisError as exc:
                log.debug("batches wait for Redis: %s", exc)
            except Exception:  # noqa: BLE001 - the next round tries again; every step is resumable
                log.exception("batch runner step failed")
            if not worked:
                self._wake.wait(IDLE_WAIT_SECONDS)
                self._wake.clear()

    def turns(self) -> list[str]:
        """The batches this round steps: one of each key's active batches, the key's batches taking turns round
        after round, so a key with many batches gets no more turns than a key with one."""
        active = self._store.active()
        by_owner: dict[str, list[str]] = {}
        for batch_id, owner in self._store.owners(active).items():
            by_owner.setdefault(owner, []).append(batch_id)
        chosen = []
        for owner in sorted(by_owner):
            batches = by_owner[owner]
            turn = self._turns.get(owner, 0)
            chosen.append(batches[turn % len(batches)])
            self._turns[owner] = turn + 1
        self._turns = {owner: turn for owner, turn in self._turns.items() if owner in by_owner}
        return chosen

    def _heartbeat(self) -> None:
        """Renews the leases this process holds every third of a lease, so none lapses inside a step that waits
        on its publishes or image copies (bounded, `STEP_BOUND_SECONDS`); once the loop has not moved on for that
        long, renewing stops and another process may take the batches over."""
        lease = self._settings.batch_lease_seconds
        while not self._stopped.wait(lease / 3):
            if time.monotonic() - self._beat > STEP_BOUND_SECONDS:
                continue
            for batch_id in list(self._held):
                try:
                    if not self._store.renew(batch_id, self._token, lease):
                        self._held.discard(batch_id)
                except redis.RedisError:
                    break

    def _restore(self) -> None:
        """Batches Redis lost (restarted without persistence) are rebuilt from GCS, then resumed like any other."""
        for batch_id in self._store.orphaned():
            if self._store.restore(batch_id):
                log.warning("restored batch %s from GCS after Redis lost it", batch_id)

    # One step of one batch, under its lease.

    def step(self, batch_id: str) -> bool:
        """True when it did something (the loop then goes on without waiting)."""
        batch = self._store.get(batch_id, mirrored=False)
        if batch is None or batch.ended:
            self._drop(batch_id)
            self._held.discard(batch_id)
            return False
        ending = batch.fields.get("end_status")
        if ending is None and time.time() * 1000 >= batch.expires_ms:
            self._store.set_ending(batch_id, "expired")
            current = self._store.get(batch_id, mirrored=False)
            ending = current.fields.get("end_status") if current is not None else "expired"
        worked = False
        if ending is None:
            worked |= self._republish(batch)
            worked |= self._feed(batch)
        elif ending in ("cancelled", "expired") and not batch.fields.get("feed_done"):
            worked |= self._list_unrun(batch, ending)
        # A failed batch (its file became unreadable) still collects what it published; cancel and expiry do not wait.
        worked |= self._collect(batch_id, ending if ending in ("cancelled", "expired") else None)
        worked |= self._flush(batch_id, force=False)
        return self._maybe_end(batch_id) or worked

    def _list_unrun(self, batch: Batch, ending: str) -> bool:
        """The lines a cancelled or expired batch never read go to its errors file as `cancelled`/`expired` (as
        OpenAI's batches list them), so `total` ends as the file's lines and every custom_id has its line. Read from
        the cursor in Redis (a reader of the feed may be past lines it had not taken), a slice per step."""
        batch_id = batch.batch_id
        reader = self._readers.get(batch_id)
        if reader is None or not reader.draining:
            self._drop(batch_id)
            try:
                reader = self._reader(batch)
            except Exception:  # noqa: BLE001 - the file went away: nothing more can be listed
                self._store.set_fields(batch_id, feed_done=1)
                return True
            reader.draining = True
        spec = (Outcome.CANCELLED if ending == "cancelled" else Outcome.EXPIRED).spec
        error = {"code": spec.http_status, "message": f"the batch was {ending} before this line ran", "kind": ending}
        started, entries = time.monotonic(), []
        while time.monotonic() - started < FEED_SLICE_SECONDS and not self._stopped.is_set():
            line = self._next_line(batch_id, reader)
            if line is not None:
                custom_id = custom_id_of(line.data)
                item = {
                    "line": {"custom_id": custom_id, "line": line.number, "status": ending, "error": error},
                    "row": None,
                    "start": line.start_offset,
                }
                entries.append((item, line.end_offset, line.number))
            if entries and (line is None or len(entries) >= INVALID_PER_ROUND_TRIP):
                if not self._store.take_unrun(batch_id, self._token, ending, entries):
                    return True
                entries = []
            if line is None:
                self._drop(batch_id)
                self._store.set_fields(batch_id, feed_done=1)
                return True
        if entries:
            self._store.take_unrun(batch_id, self._token, ending, entries)
        return True

    def _republish(self, batch: Batch) -> bool:
        """Lines taken by a feeder that died (or whose publish failed) before their publish was known."""
        publishing = self._store.publishing(batch.batch_id)
        for request_id, entry in publishing.items():
            if self._redis.exists(naming.inflight_key(request_id), naming.result_key(request_id)):
                self._store.published(batch.batch_id, request_id)  # it was published: the worker has it
                continue
            message = InferenceRequest.model_validate_json(entry["request"])
            # A flow's line goes to its first stage's unit: the message names it (the entry names the flow).
            spec = self._catalog.version(entry["model"], entry["version"]) or self._catalog.version(
                message.model, message.model_version
            )
            if spec is None:
                continue
            try:
                self._inference.publish(message, spec, batch.expires_ms, "batch", reply_to=naming.BATCH_REPLIES_TOPIC)
            except ApiError:
                return False  # the queue is down: the next step tries again
            self._store.published(batch.batch_id, request_id)
            log.info(
                "republished batch line", extra={"fields": {"batch_job_id": batch.batch_id, "request": request_id}}
            )
        return bool(publishing)

    def _reader(self, batch: Batch) -> Reader:
        reader = self._readers.get(batch.batch_id)
        if reader is None and batch.fields["input_file"].startswith("bq://"):
            # A table: the cursor counts rows read (`tables.py`), each row a line; read from its snapshot at submit.
            table = batch.fields.get("input_snapshot") or batch.fields["input_file"]
            lines = read_table(self._bigquery, table, batch.int("cursor_offset"), self._settings.max_request_bytes)
            reader = self._readers[batch.batch_id] = Reader(None, lines)
        elif reader is None:
            bucket, _, name = batch.fields["input_file"].removeprefix("gs://").partition("/")
            stream = self._storage.bucket(bucket).blob(name).open("rb", chunk_size=1024 * 1024)
            offset = batch.int("cursor_offset")
            stream.seek(offset)
            lines = read_lines(stream, offset, batch.int("cursor_line"), self._settings.max_request_bytes)
            reader = self._readers[batch.batch_id] = Reader(stream, lines)
        return reader

    def _next_line(self, batch_id: str, reader: Reader) -> Line | None:
        """The reader's next line. A read that fails (GCS or BigQuery) drops the reader before the error goes up: a
        generator that raised reads as the end of the input afterwards, which would end the feed early; the next step
        reopens the input at the cursor in Redis instead."""
        try:
            return next(reader.lines, None)
        except Exception:
            self._drop(batch_id)
            raise

    def _drop(self, batch_id: str) -> None:
        reader = self._readers.pop(batch_id, None)
        if reader is not None and reader.stream is not None:
            with contextlib.suppress(Exception):
                reader.stream.close()

    def _feed(self, batch: Batch) -> bool:
        if batch.fields.get("feed_done"):
            return False
        try:
            return self._feed_lines(batch)
        finally:
            publishes, self._publishes = self._publishes, []
            for future in publishes:  # each bounded by its publish timeout; a line not known published is retried
                future.result(timeout=PUBLISH_WAIT_SECONDS)

    def _feed_lines(self, batch: Batch) -> bool:
        batch_id = batch.batch_id
        try:
            reader = self._reader(batch)
        except Exception as exc:  # noqa: BLE001 - the file went away or is unreadable: the batch fails
            field = "input_table" if batch.fields["input_file"].startswith("bq://") else "input_file"
            self._fail(batch_id, 422, f"{field}: cannot read {batch.fields['input_file']}: {exc}"[:1024])
            return True
        caller = Caller(batch.owner, batch.fields.get("digest", ""))
        read_image = partial(self._inputs.read_image, caller) if self._inputs is not None else None
        in_flight = self._store.in_flight(batch_id)
        bounds: dict[str, int] = {}  # per model, computed once a slice
        started, worked, invalid = time.monotonic(), False, []
        fail_fast = self._settings.batch_fail_fast_lines
        while time.monotonic() - started < FEED_SLICE_SECONDS and not self._stopped.is_set():
            if reader.held is None:
                line = self._next_line(batch_id, reader)
                if line is None:
                    if not self._take_invalid(batch, invalid):
                        return True
                    return self._fed_all(batch_id) or worked
                max_bytes = self._settings.max_request_bytes
                try:
                    checked = validate_line(self._serving, self._flows, batch_id, line, caller, max_bytes, read_image)
                except Exception:
                    # Its image could not be read for GCS's own reason: the next step reads this line again from the
                    # cursor in Redis (a reader kept would go on past it, and the cursor with the next line taken).
                    self._drop(batch_id)
                    raise
                reader.held = (line, checked)
            line, checked = reader.held
            if isinstance(checked, InvalidLine):
                invalid.append((line, checked))  # written in one round trip with the invalid lines after it
                reader.held, worked = None, True
                if (len(invalid) >= INVALID_PER_ROUND_TRIP or line.number == fail_fast) and not self._take_invalid(
                    batch, invalid
                ):
                    return worked
                continue
            if not self._take_invalid(batch, invalid):  # the cursor moves in file order
                return worked
            queue = checked.spec.queue
            if queue not in bounds:
                bounds[queue] = self.in_flight_bound(checked.spec)
            if in_flight.get(queue, 0) >= bounds[queue]:
                return worked  # this model's share is full: wait for answers
            taken = self._take_valid(batch, line, checked)
            if taken < 0:
                return worked
            if taken == 1:
                in_flight[queue] = in_flight.get(queue, 0) + 1
            reader.held, worked = None, True
        self._take_invalid(batch, invalid)
        return worked

    def in_flight_bound(self, spec: ModelSpec) -> int:
        """Lines of one batch in flight for this model at most (contract/batch_capacity.py)."""
        settings = self._settings
        return batch_in_flight_bound(
            self._catalog, spec, settings.batch_worker_max_replicas, settings.batch_max_in_flight
        )

    def _take_invalid(self, batch: Batch, invalid: list[tuple[Line, InvalidLine]]) -> bool:
        """Writes the invalid lines read so far to the errors outbox (one round trip) and empties `invalid`; False
        when the batch must not be fed further (the lease was lost, or its first lines were all invalid)."""
        if not invalid:
            return True
        entries = []
        for line, refused in invalid:
            error = refused.error
            custom_id = refused.custom_id or custom_id_of(line.data)
            detail = {"code": error.status, "message": error.message, **({"field": error.field} if error.field else {})}
            item = {
                "line": {"custom_id": custom_id, "line": line.number, "status": "failed", "error": detail},
                "row": None,
                "start": line.start_offset,
            }
            first = f"line {line.number}: {error.status} {error.message}"
            entries.append(
                (custom_id_digest(custom_id) if custom_id else None, item, line.end_offset, line.number, first)
            )
        last = invalid[-1][0].number
        invalid.clear()
        if not self._store.take_invalid(batch.batch_id, self._token, entries):
            return False
        limit = self._settings.batch_fail_fast_lines
        if limit and last >= limit and not batch.fields.get("valid_seen"):
            current = self._store.get(batch.batch_id, mirrored=False)
            if current is not None and not current.fields.get("valid_seen"):
                reason = f"the first {limit} lines are all invalid; {current.fields.get('first_error', '')}"
                self._fail(batch.batch_id, 422, reason[:1024])
                return False  # nothing more is read
            batch.fields["valid_seen"] = "1"
        return True

    def _take_valid(self, batch: Batch, line: Line, prepared: PreparedRequest) -> int:
        """1 published, 0 a duplicate custom_id (an error line), -1 the lease was lost."""
        batch_id, spec = batch.batch_id, prepared.spec
        payload = json.loads(line.data or b"{}")
        custom_id = payload["custom_id"]
        try:
            message = self._inference.message(prepared)
        except ApiError as error:
            return 1 if self._take_invalid(batch, [(line, InvalidLine(custom_id, error))]) else -1
        entry = {"request": message.model_dump_json(), "model": spec.name, "version": spec.version}
        pending = {
            "custom_id": custom_id,
            "queue": spec.queue,
            "line": line.number,
            "start": line.start_offset,
            "row": self._row(batch, prepared, custom_id),
        }
        taken = self._store.take_valid(
            batch_id, self._token, custom_id_digest(custom_id), prepared.request_id, entry, pending, spec.queue,
            line.end_offset, line.number,
        )  # fmt: skip
        if taken == 2:
            return 2  # answered before Redis lost the batch: in a part file already
        if taken == 0:
            duplicate = ApiError(409, f"custom_id {custom_id!r}: a line before this one has it", "custom_id")
            return 0 if self._take_invalid(batch, [(line, InvalidLine(custom_id, duplicate))]) else -1
        if taken < 0:
            return -1
        if batch.status == "validating":
            self._store.set_status(batch_id, "in_progress")  # never over a cancel accepted meanwhile
            batch.fields["status"] = "in_progress"
        self._publishes.append(self._pool.submit(self._publish, batch, message, spec))
        return 1

    def _publish(self, batch: Batch, message: InferenceRequest, spec) -> None:
        """From the I/O pool: the publishes of a step's lines overlap (each waits for Pub/Sub's answer)."""
        if self._store.ending(batch.batch_id):
            # Taken before a cancel (or the window's end) was accepted: never published; answered cancelled.
            self._store.published(batch.batch_id, message.request_id)
            return
        try:
            self._inference.publish(message, spec, batch.expires_ms, "batch", reply_to=naming.BATCH_REPLIES_TOPIC)
        except ApiError:
            return  # kept in `:publishing`: the next step publishes it again
        self._store.published(batch.batch_id, message.request_id)

    def _row(self, batch: Batch, prepared: PreparedRequest, custom_id: str) -> dict:
        """The line's partial log row, kept with it until its answer is collected (by whichever process)."""
        spec = prepared.spec
        row = InferenceLogRow(
            request_id=prepared.request_id,
            created_at=now_to_the_millisecond(),
            model=spec.name,
            status="error",
            http_status=0,
            api_key_id=batch.owner,
            model_version=spec.version,
            task=spec.task,
            model_family=spec.family.name if spec.family else None,
            endpoint="batch",
            priority="batch",
            cache_hit=False,
            num_images=len(prepared.prompts),
            input_bytes=sum(len(image) for image in prepared.images if image),
            mask_fraction=mask_fraction(prepared.masks),
            api_instance=self._settings.instance_id,
            batch_job_id=batch.batch_id,
            custom_id=custom_id,
            flow=prepared.flow.flow.name if prepared.flow is not None else None,
        )
        for name in LOGGED_PARAMETERS:
            setattr(row, name, getattr(prepared.params, name))
        row.adapters, row.controls = listed(prepared.params.adapters), listed(prepared.params.controls)
        row.published_at = row.created_at
        return row.to_json()

    def _fed_all(self, batch_id: str) -> bool:
        batch = self._store.get(batch_id, mirrored=False)
        self._drop(batch_id)
        if batch is None:
            return False  # lost with Redis: restored, then read again
        self._store.set_fields(batch_id, feed_done=1)
        if batch.int("total") == 0:
            empty = "input_table: the table holds no rows" if batch.fields["input_file"].startswith("bq://") else None
            self._fail(batch_id, 422, empty or "input_file: the file holds no lines")
        elif not batch.fields.get("valid_seen"):
            self._fail(batch_id, 422, f"every line is invalid; {batch.fields.get('first_error', '')}"[:1024])
        return True

    def _fail(self, batch_id: str, code: int, message: str) -> None:
        self._drop(batch_id)
        error = json.dumps({"code": code, "message": message})
        self._store.set_ending(batch_id, "failed", feed_done=1, error=error)

    # Answers.

    def _collect(self, batch_id: str, ending: str | None) -> bool:
        pending = self._store.pending(batch_id)
        if not pending:
            return False
        request_ids = list(pending)
        raw = self._redis.mget([naming.result_key(request_id) for request_id in request_ids])
        ended = []
        for request_id, stored in zip(request_ids, raw, strict=True):
            reply = InferenceReply.model_validate_json(stored) if stored else None
            if reply is None and ending is None:
                continue
            if reply is None:
                self._results.cancel(request_id)  # a worker that still gets it skips it (or stops it)
            ended.append((request_id, pending[request_id], reply))
        # Images are copied under the batch's prefix from the I/O pool; each line is then moved once, in order.
        answers = self._pool.map(
            lambda end: self._answer(batch_id, end[0], end[1], end[2], ending), ended, timeout=ANSWER_WAIT_SECONDS
        )
        ends = [
            (request_id, entry["queue"], kind, item, counter)
            for (request_id, entry, _), (kind, counter, item) in zip(ended, answers, strict=True)
        ]
        outcomes = self._store.collect(batch_id, self._token, ends) if ends else []
        collected = [end[0] for end, outcome in zip(ends, outcomes, strict=True) if outcome >= 0]
        if collected:
            self._results.collected(collected)  # kept until the batch's end while uncollected; now the usual TTL
        return bool(collected)

    def _answer(
        self, batch_id: str, request_id: str, entry: dict, reply: InferenceReply | None, ending: str | None
    ) -> tuple[str, str, dict]:
        """(outbox, counter, item) for one line's end: its reply, or none by the batch's end (`ending`)."""
        row = InferenceLogRow.from_json(entry["row"])
        if reply is None:
            outcome = Outcome.CANCELLED if ending == "cancelled" else Outcome.EXPIRED
            row.status, row.error_kind = outcome.spec.log_status, outcome.spec.error_kind
            row.error = f"the batch was {ending} before this line ran"
            row.end_job(None)
        else:
            row, outcome = ended_row(row, reply)
        row.http_status = outcome.spec.http_status
        # A flow's line: its row sums its stages' GPU-seconds, and each stage that ran has its row, as interactively.
        row, *stage_rows = rows_of(row, reply, self._catalog)
        line: dict = {"custom_id": entry["custom_id"], "line": entry["line"], "request_id": request_id}
        if outcome is Outcome.OK and reply is not None:
            images = self._save_images(batch_id, entry["line"], reply)
            row.output_bytes = sum(size for _, size in images)
            line.update(
                status="succeeded",
                model=reply.model,
                model_version=reply.model_version or row.model_version,  # a flow's: each stage's version
                images=[
                    {"uri": uri, "seed": p.seed, "width": p.width, "height": p.height}
                    for (uri, _), p in zip(images, reply.predictions, strict=True)
                ],
                timings_ms={
                    "queue": round(reply.queue_ms, 2),
                    "inference": round(reply.inference_ms, 2),
                    "total": row.total_ms,
                },
            )
            if reply.stages:  # a flow's line, as its sync answer
                line["stages"] = stage_timings(reply)
            return "results", "succeeded", _item(line, row, stage_rows, entry)
        status = {Outcome.CANCELLED: "cancelled", Outcome.EXPIRED: "expired"}.get(outcome, "failed")
        message = row.error or (reply.error if reply else None) or outcome.value
        line.update(status=status, error={"code": outcome.spec.http_status, "message": message, "kind": row.error_kind})
        if reply is not None and reply.stages:  # a flow's line that did not finish, as its job's error
            line["error"]["stages"] = stage_timings(reply)
        return "errors", status, _item(line, row, stage_rows, entry)

    def _save_images(self, batch_id: str, line_number: int, reply: InferenceReply) -> list[tuple[str, int]]:
        """Each image under the batch's prefix (idempotent: the same name for the same line)."""
        saved = []
        for index, prediction in enumerate(reply.predictions):
            png = self._payloads.unpack(prediction.image)
            name = f"images/{line_number:08d}-{index}.png"
            self._store.bucket.blob(self._store.object_name(batch_id, name)).upload_from_string(
                png, content_type="image/png"
            )
            saved.append((self._store.uri(batch_id, name), len(png)))
        return saved

    # Part files, and the end.

    def _flush(self, batch_id: str, force: bool) -> bool:
        reader = self._readers.get(batch_id)
        due = force or reader is None or time.monotonic() - reader.flushed_at >= FLUSH_EVERY_SECONDS
        if not due:
            return False
        if reader is not None:
            reader.flushed_at = time.monotonic()
        for kind in KINDS:
            self._store.cut_part(batch_id, self._token, kind)
        parts = self._store.parts(batch_id)
        for part in parts:
            kind, seq = part.rsplit(":", 2)[-2:]
            items = self._store.part_items(part)
            body = "".join(json.dumps(item["line"]) + "\n" for item in items)
            name = self._store.object_name(batch_id, f"{kind}/part-{int(seq):06d}.jsonl")
            self._store.bucket.blob(name).upload_from_string(body, content_type="application/jsonl")
            for item in items:
                for row in [item["row"], *item.get("stage_rows", [])]:
                    if row is not None:
                        self._log.write(InferenceLogRow.from_json(row))
            self._log.spool_queued()  # on disk before the part leaves Redis: a kill now loses no row
            self._store.part_written(batch_id, part)
        if parts:
            batch = self._store.get(batch_id, mirrored=False)
            if batch is not None:
                self._store.mirror(batch)
        return bool(parts)

    def _maybe_end(self, batch_id: str) -> bool:
        batch = self._store.get(batch_id, mirrored=False)
        if batch is None or batch.ended:
            return False
        ending = batch.fields.get("end_status")
        if not batch.fields.get("feed_done"):
            return False  # still feeding, or listing the lines a cancelled or expired batch never ran
        if self._store.pending(batch_id) or self._store.publishing(batch_id):
            return False
        if ending is None and batch.status != "finalizing":
            self._store.set_status(batch_id, "finalizing")
        self._flush(batch_id, force=True)
        if not self._store.outbox_empty(batch_id):
            return True
        ended = self._store.set_status(batch_id, "@end")
        self._drop(batch_id)
        self._held.discard(batch_id)
        if ended is not None:
            log.info("batch ended", extra={"fields": {"batch_job_id": batch_id, "status": ended.status}})
        return True

    def _call_webhooks(self) -> None:
        """Ended batches' webhooks, each claimed once across processes (only a process that can sign claims)."""
        if self._webhooks is None:
            return
        for batch_id in self._store.webhooks_due():
            if not self._store.claim_webhook(batch_id):
                continue
            batch = self._store.get(batch_id)
            if batch is not None and (url := batch.fields.get("webhook_url")):
                body = json.dumps(view(batch, self._store), separators=(",", ":")).encode()
                self._webhooks.send_later(url, body, batch_id, "X-MaaS-Batch-Id")


def _item(line: dict, row: InferenceLogRow, stage_rows: list[InferenceLogRow], entry: dict) -> dict:
    """A line's outbox item: its file line, its log row and (a flow's) its stages' rows, written with its part."""
    item = {"line": line, "row": row.to_json(), "start": entry.get("start", 0)}
    if stage_rows:
        item["stage_rows"] = [stage.to_json() for stage in stage_rows]
    return item
