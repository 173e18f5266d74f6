"""A batch's bookkeeping against a real Redis server and the real scripts (tests/unit/batch_harness.py): after Redis
loses a batch, lines already in part files are skipped, never answered, counted or written twice; no write re-creates
a record Redis lost; a cancel, once accepted, stops everything; a key has a cap of active batches, keys take turns,
and a lease does not lapse inside a step."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from api_server.batches.lines import line_request_id
from api_server.batches.service import BatchService
from api_server.batches.store import Batch, batch_key
from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from contract import naming
from contract.messages import InferenceReply
from contract.stores.results import ResultStore
from tests.unit import batch_harness
from tests.unit.batch_harness import RESULT_TTL_SECONDS, Harness

redis_server = batch_harness.redis_server  # one redis-server for the module


@pytest.fixture
def client(redis_server):
    redis_server.flushall()
    return redis_server


# Lines 1-10 valid, 11 not JSON, 12 repeats line 5's custom_id, 13 valid.
CUSTOM_IDS = [f"c{index}" for index in range(1, 11)] + [None, "c5", "c13"]


def test_after_redis_loses_a_batch_lines_answered_past_the_safe_cursor_are_skipped_and_counted_once(client):
    harness = Harness(client, batch_max_in_flight=10)
    batch_id = harness.submit(CUSTOM_IDS)
    # Lines 1-10 fill the model's share; line 11 (invalid) is written, line 12 waits for room.
    harness.step_until(batch_id, lambda: int(harness.fields(batch_id)["cursor_line"]) == 11)
    # Every line but the first is answered: line 1 holds the safe cursor back while 2-10 reach a results part.
    for custom_id in CUSTOM_IDS[1:10]:
        harness.answer(batch_id, custom_id)
    # Collected and flushed only (no feeding: line 12 stays unread until after the loss).
    harness.runner._collect(batch_id, None)
    harness.runner._flush(batch_id, force=True)
    assert len(harness.output(batch_id, "results")) == 9
    mirrored = json.loads(harness.bucket.objects[f"batches/{batch_id}/batch.json"])
    assert (mirrored["safe_line"], mirrored["safe_offset"]) == (0, 0), "line 1 is still in flight"
    assert len(harness.output(batch_id, "errors")) == 1

    client.flushall()  # Redis restarted without persistence: the batch, its lease and the answers are gone
    assert harness.store.orphaned() == [batch_id] and harness.store.restore(batch_id)
    assert harness.counts(batch_id) == {"total": 10, "succeeded": 9, "failed": 1, "cancelled": 0, "expired": 0}

    published_before = len(harness.inference.published)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("feed_done") == "1")
    # Read again from line 1: line 1 is published again (its answer was lost), 2-11 skipped, 12 is a real
    # repeat of c5 (a 409), 13 is new.
    again = harness.inference.published[published_before:]
    assert sorted(again) == sorted(line_request_id(batch_id, custom_id) for custom_id in ("c1", "c13"))
    assert harness.counts(batch_id) == {"total": 13, "succeeded": 9, "failed": 2, "cancelled": 0, "expired": 0}
    harness.answer(batch_id, "c1")
    harness.answer(batch_id, "c13")
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")

    assert harness.counts(batch_id) == {"total": 13, "succeeded": 11, "failed": 2, "cancelled": 0, "expired": 0}
    results = harness.output(batch_id, "results")
    errors = harness.output(batch_id, "errors")
    assert Counter(item["custom_id"] for item in results) == Counter(
        [f"c{index}" for index in range(1, 11)] + ["c13"]
    ), "each answered once"
    assert sorted((item["line"], item["error"]["code"]) for item in errors) == [(11, 400), (12, 409)]
    assert len(results) + len(errors) == 13
    logged = Counter(row.custom_id for row in harness.log.rows)
    assert logged == Counter(item["custom_id"] for item in results), "one log row per answered line"


def test_after_a_loss_between_a_parts_upload_and_its_bookkeeping_its_lines_are_not_written_again(client):
    """Redis lost after a part was uploaded but before the mirror moved the safe cursor past it."""
    harness = Harness(client)
    ids = [f"d{index}" for index in range(1, 11)]
    batch_id = harness.submit(ids)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("feed_done") == "1")
    mirror = harness.store.mirror
    harness.store.mirror = lambda batch: None  # the part is uploaded; the mirror is not (Redis goes first)
    for custom_id in ids:
        harness.answer(batch_id, custom_id)
    harness.step_until(batch_id, lambda: len(harness.output(batch_id, "results")) == 10)
    harness.store.mirror = mirror
    client.flushall()
    assert harness.store.restore(batch_id)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")
    assert harness.counts(batch_id) == {"total": 10, "succeeded": 10, "failed": 0, "cancelled": 0, "expired": 0}
    assert sorted(item["custom_id"] for item in harness.output(batch_id, "results")) == sorted(ids)
    assert harness.output(batch_id, "errors") == []


# No write re-creates a record Redis lost.


def test_no_status_write_recreates_a_record_redis_lost_and_the_mirror_keeps_the_whole_record(client):
    harness = Harness(client)
    batch_id = harness.submit(["e1"])
    harness.store.set_status(batch_id, "finalizing")
    whole = json.loads(harness.bucket.objects[f"batches/{batch_id}/batch.json"])
    client.delete(batch_key(batch_id))  # lost during the final flush
    for status in ("@end", "finalizing", "in_progress"):
        assert harness.store.set_status(batch_id, status) is None
    harness.store.set_fields(batch_id, feed_done=1)
    harness.store.set_ending(batch_id, "failed", error="{}")
    assert not client.exists(batch_key(batch_id)), "nothing written to a record Redis lost"
    harness.store.mirror(Batch(batch_id, {"status": "completed", "completed_ms": "1"}))  # a partial record
    assert json.loads(harness.bucket.objects[f"batches/{batch_id}/batch.json"]) == whole
    assert harness.store.get(batch_id, owner="key-a").status == "finalizing", "the owner still reads it"


# Cancel.


def test_once_a_cancel_is_accepted_no_line_is_taken_or_published_and_the_status_never_goes_back(client):
    harness = Harness(client)
    batch_id = harness.submit([f"f{index}" for index in range(1, 21)])
    service = BatchService(harness.store, None, None, None, 10)  # type: ignore[arg-type]
    owner = Caller("key-a", "d")
    # The DELETE lands while the feeder validates the first line (it read the batch as `validating`).
    harness.serving.on_prepare = lambda number: number == 1 and service.cancel(service.get(batch_id, owner))
    step_once(harness, batch_id)
    assert harness.fields(batch_id)["status"] in ("cancelling", "cancelled"), "never back to in_progress"
    assert harness.inference.published == [] and harness.counts(batch_id)["total"] == 0
    with pytest.raises(ApiError) as refused:
        service.cancel(service.get(batch_id, owner))
    assert refused.value.status == 409
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "cancelled")
    assert harness.inference.published == [] and harness.output(batch_id, "results") == []


def test_a_line_taken_before_the_cancel_is_not_published_after_it(client):
    harness = Harness(client)
    batch_id = harness.submit(["g1", "g2"])
    gate = threading.Event()
    ending = harness.store.ending
    harness.store.ending = lambda batch: gate.wait(30) and ending(batch)  # line 1's publish goes on after the cancel
    harness.serving.on_prepare = lambda number: number == 2 and harness.store.request_cancel(batch_id)
    stepping = threading.Thread(target=step_once, args=(harness, batch_id))
    stepping.start()
    deadline = time.monotonic() + 30
    while harness.fields(batch_id).get("status") != "cancelling":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    stepping.join(30)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "cancelled")
    assert harness.inference.published == []
    errors = harness.output(batch_id, "errors")
    assert sorted((item["custom_id"], item["status"]) for item in errors) == [("g1", "cancelled"), ("g2", "cancelled")]


# A key's share.


def test_a_key_past_its_cap_of_active_batches_gets_a_429_naming_it_and_other_keys_do_not(client):
    harness = Harness(client)
    service = BatchService(harness.store, None, None, None, 10, max_active_per_key=2)  # type: ignore[arg-type]
    line = json.loads(Harness.line("h"))
    first = service.submit({"requests": [line]}, Caller("key-a", "d"))
    service.submit({"requests": [line]}, Caller("key-a", "d"))
    with pytest.raises(ApiError) as refused:
        service.submit({"requests": [line]}, Caller("key-a", "d"))
    assert refused.value.status == 429 and "MAAS_BATCH_MAX_ACTIVE_PER_KEY" in refused.value.message
    service.submit({"requests": [line]}, Caller("key-b", "d"))
    harness.store.request_cancel(first["id"])
    assert harness.store.set_status(first["id"], "@end").status == "cancelled"
    service.submit({"requests": [line]}, Caller("key-a", "d"))  # one ended: room again
    assert sum(1 for name in harness.bucket.objects if name.endswith("input.jsonl")) == 4, "no input left behind"


def test_keys_take_turns_whatever_their_number_of_batches(client):
    harness = Harness(client)
    many = [harness.submit(["i"], owner="key-a") for _ in range(3)]
    one = harness.submit(["i"], owner="key-b")
    rounds = [harness.runner.turns() for _ in range(3)]
    assert all(len(chosen) == 2 and one in chosen for chosen in rounds), rounds
    assert sorted(batch for chosen in rounds for batch in chosen if batch != one) == sorted(many)


def test_a_lease_does_not_lapse_inside_a_step_that_waits_longer_than_it(client):
    harness = Harness(client, batch_lease_seconds=0.3)
    batch_id = harness.submit(["j1"])
    renewals = []
    renew = harness.store.renew
    harness.store.renew = lambda *args: renewals.append(1) or renew(*args)
    harness.inference.gate = gate = threading.Event()  # the step's publish waits (as on a slow Pub/Sub)
    harness.runner.start()
    try:
        deadline = time.monotonic() + 30
        while not (len(renewals) >= 6 and harness.fields(batch_id).get("total") == "1"):
            assert time.monotonic() < deadline, "the lease was not renewed during the step"
            time.sleep(0.01)
        # Six renewals of a 0.3 s lease, a third of it apart: the step outlasted the lease, which is still held.
        assert harness.store.acquire(batch_id, "another-process", 0.3) is None
        assert harness.inference.published == []
    finally:
        gate.set()
        harness.runner.stop()


def step_once(harness: Harness, batch_id: str) -> None:
    assert harness.store.acquire(batch_id, harness.runner._token, 10) is not None
    harness.runner.step(batch_id)


@pytest.mark.parametrize("ending", ["cancelled", "expired"])
def test_a_cancelled_or_expired_batch_lists_every_line_it_never_ran_and_counts_the_files_lines(client, ending):
    harness = Harness(client, batch_max_in_flight=3)
    ids = [f"k{index}" for index in range(1, 11)]
    batch_id = harness.submit(ids[:6] + [None] + ids[6:])  # line 7 is not JSON: listed without a custom_id
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("total") == "3")  # lines 1-3 in flight
    harness.answer(batch_id, "k1")
    if ending == "cancelled":
        harness.store.request_cancel(batch_id)
    else:
        harness.store.set_fields(batch_id, expires_ms=int(time.time() * 1000) - 1)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == ending)
    assert harness.counts(batch_id) == {
        "total": 11, "succeeded": 1, "failed": 0, "cancelled": 10 if ending == "cancelled" else 0,
        "expired": 10 if ending == "expired" else 0,
    }  # fmt: skip
    errors = harness.output(batch_id, "errors")
    assert sorted(item["line"] for item in errors) == list(range(2, 12))
    assert {item["status"] for item in errors} == {ending}
    assert [item["custom_id"] for item in errors if item["line"] > 3] == ids[3:6] + [None] + ids[6:]
    assert len(harness.inference.published) == 3


def test_a_batch_lines_answer_outlives_the_usual_ttl_until_its_batch_ends_then_goes_back_to_it(client):
    harness = Harness(client)
    batch_id = harness.submit(["m1"])
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("total") == "1")
    request_id = line_request_id(batch_id, "m1")
    reply = InferenceReply(request_id=request_id, model="sleep", model_version="1", status="ok")
    ends_ms = int(harness.fields(batch_id)["expires_ms"]) + 24 * 3600 * 1000  # a batch ending a day after the TTL
    assert ResultStore(client, RESULT_TTL_SECONDS).put(reply, keep_until_ms=ends_ms)
    assert client.ttl(naming.result_key(request_id)) > 24 * 3600, "kept until the batch's end, not the usual hour"
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")
    assert 0 < client.ttl(naming.result_key(request_id)) <= RESULT_TTL_SECONDS, "collected: the usual TTL again"
    assert harness.counts(batch_id)["succeeded"] == 1


def test_a_part_rewritten_by_the_next_lease_holder_after_a_crash_spools_the_same_rows_under_the_same_request_ids(
    client,
):
    """The rows of a part whose bookkeeping a crash cut short are spooled again by the next lease holder: the same
    rows under the same request ids, which `inference_log_unique` (one row per request id, read by every view)
    counts once; tests/integration/test_analytics_views.py checks the views on such a duplicated batch row."""
    harness = Harness(client)
    ids = ["p1", "p2", "p3"]
    batch_id = harness.submit(ids)
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("feed_done") == "1")
    for custom_id in ids:
        harness.answer(batch_id, custom_id)
    crashed, part_written = harness.runner, harness.store.part_written

    def crash(batch_id: str, part: str) -> None:
        raise RuntimeError("killed after the part's upload and its rows' spool")

    harness.store.part_written = crash
    with pytest.raises(RuntimeError):
        step_once(harness, batch_id)
    first = [row.to_json() for row in harness.log.rows]
    assert sorted(row.custom_id for row in harness.log.rows) == ids
    harness.store.part_written = part_written
    harness.store.release(batch_id, crashed._token)  # its lease lapsed: the next process takes the batch over
    harness.runner = harness.new_runner()
    harness.step_until(batch_id, lambda: harness.fields(batch_id).get("status") == "completed")
    again = [row.to_json() for row in harness.log.rows[len(first) :]]
    assert again == first, "the same rows again, under the same request ids"
    assert Counter(row.request_id for row in harness.log.rows) == {line_request_id(batch_id, c): 2 for c in ids}
    assert sorted(item["custom_id"] for item in harness.output(batch_id, "results")) == ids, "the part's lines once"
