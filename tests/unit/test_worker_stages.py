"""The worker's stages with in-memory stand-ins: batch selection, failure handling, answer ordering."""

from __future__ import annotations

import io
import sys
import time
import zlib
from types import SimpleNamespace

import pytest

from contract.catalog import ModelCatalog, load_catalog
from contract.messages import GenerationParameters, InferenceRequest, RequestInstance
from contract.payloads import PayloadError
from emulators.stack import local_catalog
from model_worker.held.pool import HeldMessage, PendingRequest, RequestPool
from model_worker.model.runners import GenerationItem, SyntheticRunner
from model_worker.serving.device import DeviceLoop
from model_worker.serving.finisher import ReplyFinisher
from model_worker.serving.health import WorkerHealth
from model_worker.serving.intake import ReplyFactory, decode_image
from model_worker.serving.metrics import WorkerMetrics

CATALOG = local_catalog(test_fixtures=True)
SLEEP = CATALOG.get("sleep")
NOOP = CATALOG.get("noop")


def pending(
    request_id: str,
    spec=SLEEP,
    priority: str = "normal",
    images: int = 1,
    width: int = 64,
    deadline_in: float | None = 60,
    received_at: float | None = None,
) -> PendingRequest:
    params = GenerationParameters(seed=1, num_inference_steps=2, guidance_scale=7.5, width=width, height=64)
    request = InferenceRequest(
        request_id=request_id,
        model=spec.name,
        model_version="1",
        instances=[RequestInstance(prompt=request_id) for _ in range(images)],
        parameters=params,
    )
    message = HeldMessage("sub", f"ack-{request_id}", {}, b"", 1, received_at or time.time())
    items = [GenerationItem(prompt=request_id, seed=1 + i) for i in range(images)]
    deadline_ms = None if deadline_in is None else int((time.time() + deadline_in) * 1000)
    return PendingRequest(message, spec, request, items, priority, deadline_ms)


def test_the_next_batch_is_oldest_high_priority_first_and_only_compatible_requests():
    pool = RequestPool(capacity=8)
    now = time.time()
    pool.add(pending("n-old", received_at=now - 3))
    pool.add(pending("n-wide", width=128, received_at=now - 2))
    pool.add(pending("h-new", priority="high", received_at=now))
    pool.add(pending("n-new", received_at=now - 1))
    batch, abandoned = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["h-new", "n-old", "n-new"] and abandoned == []
    batch, _ = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["n-wide"]


def test_a_batch_never_exceeds_the_models_batch_size_in_images():
    pool = RequestPool(capacity=8)
    for index in range(3):
        pool.add(pending(f"r{index}", images=3))
    batch, _ = pool.take_batch(timeout=0)
    assert sum(p.size for p in batch) == 6
    assert len(pool.held()) == 1


def test_requests_past_their_deadline_are_taken_out_as_abandoned():
    pool = RequestPool(capacity=8)
    pool.add(pending("late", deadline_in=-1))
    pool.add(pending("fine"))
    batch, abandoned = pool.take_batch(timeout=0)
    assert [p.request_id for p in batch] == ["fine"] and [p.request_id for p in abandoned] == ["late"]


def test_room_is_one_batch_for_normal_pulls_and_high_pulls_have_their_own():
    pool = RequestPool(capacity=8)
    for index in range(8):
        pool.add(pending(f"n{index}"))
    assert pool.room("normal") == 0
    assert pool.room("high") == 8
    pool.add(pending("h", priority="high", images=4))
    assert pool.room("high") == 4
    assert [p.request_id for p in pool.close()][:1] == ["n0"] and pool.room("normal") == 0


class Recorder:
    """Stands in for the finisher and the lease keeper, recording what the device loop asked of them."""

    def __init__(self) -> None:
        self.finished: dict[str, int] = {}
        self.answered: dict[str, tuple[str, str | None]] = {}
        self.released: list[str] = []
        self.failures: dict[str, list[str]] = {}
        self.errors: dict[str, str | None] = {}
        self.redis_trouble = SimpleNamespace(warn=lambda *args: None)

    def finish(self, pending, images, fields) -> None:
        self.finished[pending.request_id] = len(images)

    def note_failure(self, request_id: str, cause: str) -> int:
        self.failures.setdefault(request_id, []).append(cause)
        return len(self.failures[request_id])

    def answer(self, message, reply, store: bool = True) -> None:
        self.answered[reply.request_id] = (reply.status, reply.error_kind)
        self.errors[reply.request_id] = reply.error

    def release(self, message) -> None:
        self.released.append(message.ack_id)


class FailingRunner(SyntheticRunner):
    def __init__(self, spec, error: Exception, fail_on: str) -> None:
        super().__init__(spec)
        self.error, self.fail_on, self.calls = error, fail_on, 0

    def generate(self, items, params, on_step):
        self.calls += 1
        if any(item.prompt == self.fail_on for item in items):
            raise self.error
        return super().generate(items, params, on_step)


def device_with(runner) -> tuple[DeviceLoop, Recorder]:
    recorder = Recorder()
    progress = SimpleNamespace(begin=lambda *a: None, update=lambda *a: None, end=lambda: None)
    loop = DeviceLoop(
        {runner.spec.queue: runner},
        RequestPool(8),
        recorder,
        recorder,
        ReplyFactory("w1", {}),
        progress,
        WorkerMetrics(),
        WorkerHealth(60),
    )
    return loop, recorder


def test_one_bad_request_fails_alone_and_the_rest_of_its_batch_is_answered():
    runner = FailingRunner(NOOP, ValueError("impossible size"), fail_on="bad")
    loop, recorder = device_with(runner)
    loop.run_batch([pending("good-1", spec=NOOP), pending("bad", spec=NOOP), pending("good-2", spec=NOOP)])
    assert recorder.finished == {"good-1": 1, "good-2": 1}
    assert recorder.answered == {"bad": ("error", "bad_input")}
    assert runner.calls == 4  # the batch, then each request on its own


def test_a_crash_that_may_be_transient_hands_the_request_back_for_a_retry():
    loop, recorder = device_with(FailingRunner(NOOP, RuntimeError("device lost"), fail_on="flaky"))
    loop.run_batch([pending("flaky", spec=NOOP)])
    assert recorder.released == ["ack-flaky"] and recorder.answered == {} and recorder.finished == {}


def test_a_batch_line_failing_every_run_is_answered_failed_with_its_cause_after_two_runs_not_five():
    loop, recorder = device_with(FailingRunner(NOOP, RuntimeError("device lost"), fail_on="poison"))
    loop.run_batch([pending("poison", spec=NOOP, priority="batch")])
    assert recorder.released == ["ack-poison"] and recorder.answered == {}, "the first failure may be transient"
    loop.run_batch([pending("poison", spec=NOOP, priority="batch")])
    assert recorder.released == ["ack-poison"] and recorder.answered == {"poison": ("error", "inference_failed")}
    assert recorder.errors["poison"] == "inference failed on 2 runs: RuntimeError: device lost"
    assert recorder.failures["poison"] == ["RuntimeError: device lost"] * 2


def test_an_interactive_request_failing_is_handed_back_each_time_with_its_cause_kept():
    loop, recorder = device_with(FailingRunner(NOOP, RuntimeError("device lost"), fail_on="flaky"))
    for _ in range(3):
        loop.run_batch([pending("flaky", spec=NOOP)])
    assert recorder.released == ["ack-flaky"] * 3 and recorder.answered == {}
    assert recorder.failures["flaky"] == ["RuntimeError: device lost"] * 3


def test_a_version_configured_to_fail_every_call_is_a_worker_error_not_bad_input():
    broken = CATALOG.version("rollback-bad", "2")
    assert broken.fails
    loop, recorder = device_with(SyntheticRunner(broken))
    loop.run_batch([pending("broken", spec=broken)])
    assert recorder.answered == {"broken": ("error", "inference_failed")} and recorder.released == []


class CountingRunner(SyntheticRunner):
    """Counts the denoising steps a call ran before it returned or was stopped."""

    steps = 0

    def generate(self, items, params, on_step):
        def counted(step, total):
            self.steps += 1
            on_step(step, total)

        return super().generate(items, params, counted)


def test_a_batch_nobody_waits_for_stops_at_the_next_step():
    runner = CountingRunner(SLEEP, call_seconds=2.0, ticks=20)
    loop, recorder = device_with(runner)
    request = pending("abandoned", deadline_in=0.2)
    loop.run_batch([request])
    # Counted in steps, not seconds: it stopped at the first step past its deadline (the third of 0.1 s, or the
    # fourth if the machine is busy), never ran the call's 20.
    assert 1 <= runner.steps < 20
    assert recorder.answered == {"abandoned": ("expired", "expired")}


def test_each_request_gets_its_own_slice_of_the_batch():
    loop, recorder = device_with(SyntheticRunner(NOOP))
    loop.run_batch([pending("two", spec=NOOP, images=2), pending("three", spec=NOOP, images=3)])
    assert recorder.finished == {"two": 2, "three": 3}


class FakePublisher:
    def __init__(self, log: list[str], fail: bool = False) -> None:
        self._log, self._fail = log, fail

    def publish(self, topic, data, **attributes):
        if self._fail:
            raise ConnectionError("pubsub unreachable")
        self._log.append("publish")
        return DoneFuture()


class DoneFuture:
    """A publish future that has already succeeded (or failed with `error`)."""

    def __init__(self, error: Exception | None = None) -> None:
        self._error = error

    def exception(self):
        return self._error

    def add_done_callback(self, callback) -> None:
        callback(self)


class FakeLeases:
    def __init__(self, log: list[str]) -> None:
        self._log = log

    def ack(self, message) -> None:
        self._log.append("ack")

    def release(self, message) -> None:
        self._log.append("release")


class DownResults:
    def put(self, reply, keep_until_ms=None):
        raise ConnectionError("redis down")


def finisher(log: list[str], fail_publish: bool = False, results=None) -> ReplyFinisher:
    return ReplyFinisher(
        FakePublisher(log, fail_publish),
        "projects/p/topics/maas-replies",
        results or SimpleNamespace(put=lambda reply, keep_until_ms=None: log.append("store") or True),
        SimpleNamespace(pack=lambda data, name: SimpleNamespace(b64="x")),
        FakeLeases(log),
        WorkerMetrics(),
        threads=1,
    )


def reply(request_id: str = "r1"):
    return ReplyFactory("w1", {}).make(NOOP, request_id, status="ok")


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_the_finisher_encodes_at_a_lower_cpu_priority_than_the_thread_that_feeds_the_device():
    """Its PNG encode releases the GIL but takes cores: the device thread (here the test's) must keep its priority and
    the finisher's threads run `nice` lower, the process's other threads untouched."""
    import os
    import threading

    from contract.settings import Settings

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = niceness()
    lowered = ReplyFinisher(FakePublisher([]), "t", SimpleNamespace(), SimpleNamespace(), FakeLeases([]),
                            WorkerMetrics(), threads=2, nice=Settings.from_env({}).finisher_nice)  # fmt: skip
    try:
        seen = {lowered._pool.submit(niceness).result() for _ in range(4)}
    finally:
        lowered.close()
    assert Settings.from_env({}).finisher_nice == 10
    assert Settings.from_env({"MAAS_FINISHER_NICE": "0"}).finisher_nice == 0
    assert seen == {min(19, mine + 10)}
    assert niceness() == mine


def test_a_finisher_behind_the_device_makes_it_wait_instead_of_holding_ever_more_images():
    """Images handed to `finish` and not yet answered are bounded: the device thread waits for room (and says so)."""
    import threading

    log: list[str] = []
    gate = threading.Event()
    slow = finisher(log)
    slow._max_images = 3
    slow._finish = lambda pending, images, fields: gate.wait(10)  # the encode of what is handed over, held back
    message = HeldMessage("s", "a", {}, b"", 1, 0.0)
    slow.finish(SimpleNamespace(message=message), [1, 2], {})
    handed = threading.Event()
    device = threading.Thread(target=lambda: (slow.finish(SimpleNamespace(message=message), [3, 4], {}), handed.set()))
    device.start()
    assert not handed.wait(0.3)  # 2 + 2 > 3: the device thread waits for the finisher
    assert slow._metrics.finisher_images._value.get() == 2
    gate.set()
    assert handed.wait(10)
    device.join()
    slow.close()
    assert slow._metrics.finisher_images._value.get() == 0 and slow._metrics.finisher_wait_seconds._value.get() > 0
    lone = finisher(log)
    lone._max_images = 1
    lone._finish = lambda pending, images, fields: None
    lone.finish(SimpleNamespace(message=message), [1, 2, 3], {}).result(10)  # more than the bound alone: it gets in
    lone.close()


def test_the_reply_is_stored_and_published_before_the_request_is_acked():
    log: list[str] = []
    finisher(log).answer(HeldMessage("s", "a", {}, b"", 1, 0.0), reply()).result()
    assert log == ["store", "publish", "ack"]


def test_a_batch_lines_answer_is_kept_until_its_batchs_end_and_an_interactive_one_the_usual_ttl():
    kept: dict[str, int | None] = {}
    results = SimpleNamespace(put=lambda reply, keep_until_ms=None: kept.update({reply.request_id: keep_until_ms}))
    log: list[str] = []
    batch_line = HeldMessage("s", "a", {"priority": "batch", "deadline_ms": "1900000000000"}, b"", 1, 0.0)
    finisher(log, results=results).answer(batch_line, reply("line")).result()
    finisher(log, results=results).answer(HeldMessage("s", "b", {"deadline_ms": "5"}, b"", 1, 0.0), reply()).result()
    assert kept == {"line": 1900000000000, "r1": None}


def test_a_reply_that_cannot_be_published_hands_the_request_back():
    log: list[str] = []
    finisher(log, fail_publish=True).answer(HeldMessage("s", "a", {}, b"", 1, 0.0), reply()).result()
    assert log == ["store", "release"]


def test_a_publish_that_fails_later_hands_the_request_back_and_acks_nothing():
    log: list[str] = []

    class LaterFailingPublisher(FakePublisher):
        def publish(self, topic, data, **attributes):
            self._log.append("publish")
            return DoneFuture(TimeoutError("no answer from Pub/Sub"))

    answerer = finisher(log)
    answerer._publisher = LaterFailingPublisher(log)
    answerer.answer(HeldMessage("s", "a", {}, b"", 1, 0.0), reply()).result()
    assert log == ["store", "publish", "release"]


def test_redis_down_does_not_stop_the_reply():
    log: list[str] = []
    finisher(log, results=DownResults()).answer(HeldMessage("s", "a", {}, b"", 1, 0.0), reply()).result()
    assert log == ["publish", "ack"]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a huge size in its header: what a decompression bomb looks like before decoding."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")  # IHDR width and height
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # the IHDR chunk's checksum
    return bytes(data)


def test_an_oversized_input_image_is_refused_before_it_is_decoded():
    with pytest.raises(PayloadError, match="8000x8000 exceeds the model's limit of 4194304 pixels"):
        decode_image(png_header_only(8000, 8000), max_pixels=4_194_304)
    # Beyond Pillow's own bomb limit it refuses at open; the answer is the same kind of error.
    with pytest.raises(PayloadError, match="image too large"):
        decode_image(png_header_only(16000, 16000), max_pixels=4_194_304)
    with pytest.raises(PayloadError, match="not a PNG, JPEG or WebP image"):
        decode_image(b"not an image", max_pixels=4_194_304)


def test_the_catalog_refuses_an_ack_deadline_that_outlives_a_crash_retry():
    raw = {"schema_version": 1, "models": {"m": {**SLEEP.model_dump(exclude={"name"}), "ack_deadline_seconds": 11}}}
    raw["models"]["m"]["request_timeout_seconds"] = 30
    with pytest.raises(ValueError, match="at most a third"):
        ModelCatalog.model_validate({**raw, "models": {"m": {**raw["models"]["m"], "name": "m"}}})


def test_synthetic_models_share_one_deployment_and_production_has_none():
    synthetic = ["noop", "sleep", "sleep-long-ack", "sleep-steps", "sleep-calls"]
    assert [spec.name for spec in CATALOG.deployments()["synthetic"]] == synthetic
    assert set(synthetic).isdisjoint(load_catalog().names())


def test_compiled_batches_are_padded_to_a_fixed_bucket():
    from model_worker.model.pipeline import batch_buckets, pad_to_bucket

    assert batch_buckets(8) == [1, 2, 4, 8] and batch_buckets(6) == [1, 2, 4, 6]
    assert pad_to_bucket(["a", "b", "c"], 8) == ["a", "b", "c", "c"]
    assert pad_to_bucket(["a"] * 5, 6) == ["a"] * 6


def test_the_compile_cache_key_changes_with_the_adapter_slot_count_and_rank():
    from model_worker.model.compiled import compile_cache_key

    spec = next(spec for spec in load_catalog().units() if spec.adapters is not None)
    adapters = spec.adapters

    def with_slots(**update):
        return spec.model_copy(update={"adapters": adapters.model_copy(update=update)})

    more_slots = with_slots(max_adapters_per_request=adapters.max_adapters_per_request + 1)
    higher_rank = with_slots(max_rank=adapters.max_rank * 2)
    keys = {compile_cache_key(spec), compile_cache_key(more_slots), compile_cache_key(higher_rank),
            compile_cache_key(spec.model_copy(update={"adapters": None}))}  # fmt: skip
    assert len(keys) == 4, keys
    assert compile_cache_key(with_slots(max_scale=1.0)) == compile_cache_key(spec)  # what compiling does not see


def test_a_dead_lettered_answer_names_the_cause_of_the_last_failed_run():
    from model_worker.serving.intake import DeadLetterResponder

    recorder = Recorder()
    results = SimpleNamespace(get=lambda request_id: None, failure_cause=lambda request_id: "RuntimeError: device lost")
    responder = DeadLetterResponder(
        None, "dead", NOOP, SimpleNamespace(hold=lambda message: None), results, recorder, ReplyFactory("w1", {}),
        WorkerHealth(60),
    )  # type: ignore[arg-type]  # fmt: skip
    attributes = {"request_id": "poison", "CloudPubSubDeadLetterSourceDeliveryCount": "5"}
    responder._answer(SimpleNamespace(message=SimpleNamespace(attributes=attributes, data=b""), ack_id="ack-poison"))
    assert recorder.answered == {"poison": ("error", "dead_lettered")}
    assert recorder.errors["poison"] == "failed after 5 delivery attempts; the last: RuntimeError: device lost"


def test_a_reply_says_when_the_workers_previous_call_ended_only_when_its_request_was_waiting_by_then():
    # Admission's call time of a busy worker runs from one call's end to the next's (api_server/predict/admission.py).
    loop, recorder = device_with(SyntheticRunner(NOOP))
    fields: dict[str, dict] = {}
    recorder.finish = lambda pending_, images, reply_fields: fields.__setitem__(pending_.request_id, reply_fields)
    first, waiting, later = pending("first", spec=NOOP), pending("waiting", spec=NOOP), pending("later", spec=NOOP)
    loop.run_batch([first])
    loop.run_batch([waiting])  # published before the first call ended: the worker went straight on to it
    later.request.published_at_ms = fields["waiting"]["worker_finished_ms"] + 1000  # published to an idle worker
    loop.run_batch([later])
    assert fields["first"]["previous_call_ended_ms"] is None  # no call before it
    assert abs(fields["waiting"]["previous_call_ended_ms"] - fields["first"]["worker_finished_ms"]) <= 5
    assert fields["later"]["previous_call_ended_ms"] is None
