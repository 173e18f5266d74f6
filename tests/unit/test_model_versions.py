"""Model versions: the catalog's versioned entries, the split function, split validation, the rollback rule."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from api_server.core.auth import Caller
from api_server.core.errors import ApiError
from api_server.inference_log.job_rows import JobLogFinisher
from api_server.inference_log.records import InferenceCall, RequestRecords
from api_server.inference_log.writer import InferenceLogRow
from api_server.jobs.service import EndedJob, FallbackRequest, JobStore, fallback_request_id, job_key
from api_server.predict.inference import PreparedRequest
from api_server.predict.schemas import PredictBody
from api_server.predict.serving import Mode, ServingStage
from api_server.versions.rollouts import Window, breach, window_of
from api_server.versions.traffic import InvalidSplitError, choose_version, shadowed, validated_split
from contract import naming
from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog, RollbackPolicy, Shadow
from contract.generation import GenerationParameters
from contract.messages import InferenceReply, InferenceRequest
from contract.outcomes import Outcome
from contract.stores.results import ResultStore
from emulators.stack import local_catalog

CATALOG = local_catalog(test_fixtures=True)  # the rollout fixtures (tests/models.fixtures.yaml)


def catalog_with(**entries: dict) -> ModelCatalog:
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    base = raw["models"]["sd15-txt2img"]
    for name, fields in entries.items():
        raw["models"][name] = {**base, **fields}
    path = Path(f"/tmp/catalog-{uuid.uuid4().hex}.yaml")
    path.write_text(yaml.safe_dump(raw))
    try:
        return ModelCatalog.from_yaml(path)
    finally:
        path.unlink()


def test_a_90_10_split_sends_10_percent_of_1000_request_ids_to_the_canary():
    traffic = CATALOG.rollout("canary").traffic
    assert traffic == {"1": 90, "2": 10}
    chosen = [choose_version(traffic, uuid.uuid4().hex) for _ in range(1000)]
    assert 70 <= chosen.count("2") <= 130  # 10% ± 3%


def test_the_version_is_a_function_of_the_request_id():
    traffic = {"1": 50, "2": 50}
    for request_id in (uuid.uuid4().hex for _ in range(50)):
        assert len({choose_version(traffic, request_id) for _ in range(3)}) == 1


def test_a_version_at_0_percent_gets_nothing_and_one_at_100_everything():
    assert {choose_version({"1": 100, "2": 0}, uuid.uuid4().hex) for _ in range(200)} == {"1"}
    assert {choose_version({"1": 0, "2": 100}, uuid.uuid4().hex) for _ in range(200)} == {"2"}


def test_shadow_percent_draws_independently_of_the_version():
    shadow = Shadow(version="2", percent=25)
    hits = sum(shadowed(shadow, uuid.uuid4().hex) for _ in range(2000))
    assert 400 <= hits <= 600
    assert not shadowed(None, "x")


def test_each_version_is_a_unit_with_its_own_queues_and_deployment():
    catalog = catalog_with(m={"versions": {"1": {}, "2": {"weights_path": "m/2"}}, "traffic": {"1": 90, "2": 10}})
    units = [spec for spec in catalog.units() if spec.name == "m"]
    assert [spec.queue for spec in units] == ["m--1", "m--2"]
    assert [spec.deployment for spec in units] == ["m--1", "m--2"]
    assert units[1].weights_path == "m/2" and units[0].weights_path == "sd15-txt2img/1"
    assert naming.request_topic("m--2") == "maas-requests-m--2"
    assert catalog.models["m"].version == "1"  # the stable one: the largest share
    assert catalog.unit("m--2") is units[1] and catalog.version("m", "3") is None
    # Single-version entries are unchanged: named after the model.
    assert catalog.unit("sd15-txt2img").queue == "sd15-txt2img"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"versions": {"1": {}, "2": {}}, "traffic": {"1": 90, "2": 20}}, "sum to 100"),
        ({"versions": {"1": {}}, "traffic": {"1": 90, "3": 10}}, "unknown versions"),
        ({"versions": {"1": {}, "2": {}}, "traffic": {"1": 100}, "shadow": {"version": "1", "percent": 5}}, "stable"),
        ({"versions": {"A_1": {}}, "traffic": {"A_1": 100}}, "lowercase"),
        ({"traffic": {"1": 100}}, "need `versions`"),
        ({"versions": {"1": {}}, "stable": "9"}, "stable version '9'"),
        ({"versions": {}}, "lists no version"),
    ],
)
def test_a_bad_versioned_entry_is_refused_with_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        catalog_with(m=fields)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"limits": {"max_inference_steps": 50, "max_width": 768, "max_height": 1024}}, "limits.max_width to 768"),
        ({"max_instances_per_request": 2}, "max_instances_per_request to 2"),
        ({"defaults": {"num_inference_steps": 20, "guidance_scale": 7.5, "width": 512, "height": 512}},
         "defaults.num_inference_steps to 20"),
        ({"adapters": None}, "sets adapters to None"),
        ({"task": "image-to-image", "pipeline": "StableDiffusionImg2ImgPipeline"}, "task to 'image-to-image'"),
    ],
)  # fmt: skip
def test_a_version_that_would_refuse_or_resolve_a_request_differently_is_refused_at_load(override, message):
    with pytest.raises(ValueError, match=message) as refused:
        catalog_with(m={"versions": {"1": {}, "2": override}, "traffic": {"1": 90, "2": 10}})
    assert "m: version '2'" in str(refused.value) and "stable version '1'" in str(refused.value)


def test_versions_may_differ_in_how_they_run():
    how = {"weights_path": "m/2", "max_batch_size": 4, "request_timeout_seconds": 90, "scheduling": "request",
           "adapters": {**yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())["models"]["sd15-txt2img"]["adapters"],
                        "host_cache": 2, "device_cache": 1}}  # fmt: skip
    catalog = catalog_with(m={"versions": {"1": {}, "2": how}, "traffic": {"1": 90, "2": 10}})
    assert catalog.version("m", "2").max_batch_size == 4


@pytest.mark.parametrize(
    ("traffic", "shadow", "field"),
    [
        ({"1": 50, "2": 40}, None, "traffic"),
        ({"1": 50, "9": 50}, None, "traffic"),
        ({"1": "x", "2": 100}, None, "traffic.1"),
        ([], None, "traffic"),
        ({"1": 100}, {"version": "1", "percent": 10}, "shadow.version"),
        ({"1": 100}, {"version": "2", "percent": 0}, "shadow.percent"),
    ],
)
def test_an_invalid_runtime_split_names_its_field(traffic, shadow, field):
    with pytest.raises(InvalidSplitError) as caught:
        validated_split(CATALOG.rollout("canary"), traffic, shadow)
    assert caught.value.field == field


def test_a_valid_runtime_split_is_accepted():
    traffic, shadow = validated_split(CATALOG.rollout("canary"), {"1": 0, "2": 100}, {"version": "2", "percent": 5})
    assert traffic == {"1": 0.0, "2": 100.0} and shadow == Shadow(version="2", percent=5)


POLICY = RollbackPolicy(window_seconds=60, min_requests=5, max_error_rate_delta=0.2, max_p95_ratio=3)


def test_a_canary_failing_every_request_breaches_and_a_healthy_one_does_not():
    stable = window_of([f"r{i}|100.0|1".encode() for i in range(10)])
    assert breach(POLICY, stable, window_of([f"c{i}|100.0|0".encode() for i in range(5)])) is not None
    assert breach(POLICY, stable, window_of([f"c{i}|120.0|1".encode() for i in range(5)])) is None


def test_a_slow_canary_breaches_on_p95_and_too_few_requests_never_breach():
    stable = Window(20, 0.0, 100.0)
    assert "p95" in (breach(POLICY, stable, Window(20, 0.0, 400.0)) or "")
    assert breach(POLICY, stable, Window(4, 1.0, 9999.0)) is None


class EndedJobs:
    """The job store as the job-log finisher reads it: these jobs ended, each claimable once."""

    def __init__(self, ended: list[EndedJob]) -> None:
        self.ended, self.claimed = ended, set()

    def ended_unlogged(self) -> list[EndedJob]:
        return self.ended

    def claim_log_row(self, job_id: str) -> bool:
        first = job_id not in self.claimed
        self.claimed.add(job_id)
        return first


class Rows:
    closed = False

    def __init__(self) -> None:
        self.rows: list[InferenceLogRow] = []

    def write(self, row: InferenceLogRow) -> None:
        self.rows.append(row)


class Observed:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def observe(self, model: str, version: str, request_id: str, total_ms: float, ok: bool) -> None:
        self.calls.append((model, version, request_id, ok))


def ended_job(job_id: str, status: str | None, observe: bool, error_kind: str | None = None) -> EndedJob:
    created = datetime.now(UTC) - timedelta(seconds=3)
    row = InferenceLogRow(job_id, created, "rollback-jobs", "accepted", 202, model_version="2", endpoint="job")
    reply = None
    if status is not None:
        reply = InferenceReply(request_id=job_id, model="rollback-jobs", model_version="2", status=status,
                               error=None if status == "ok" else "failed", error_kind=error_kind,
                               answered_ms=int(time.time() * 1000))  # fmt: skip
    return EndedJob(job_id, row.to_json(), reply, observe)


def test_a_submitted_job_feeds_the_rollback_guard_once_when_it_ends():
    jobs = EndedJobs([
        ended_job("ok", "ok", True), ended_job("failed", "error", True), ended_job("expired", None, True),
        ended_job("cancelled", "cancelled", True), ended_job("converted", "error", False),
        ended_job("refused", "error", True, error_kind="bad_input"),
    ])  # fmt: skip
    rows, observed = Rows(), Observed()
    finisher = JobLogFinisher(jobs, rows, observations=observed)
    assert finisher.finish_ended() == 6 and finisher.finish_ended() == 0  # claimed once, by one process
    # A cancelled job, or one whose input was refused, says nothing about its version; a converted one was
    # observed when its sync wait ran out.
    assert observed.calls == [("rollback-jobs", "2", "ok", True), ("rollback-jobs", "2", "failed", False),
                              ("rollback-jobs", "2", "expired", False)]  # fmt: skip
    assert all(row.total_ms >= 2500 for row in rows.rows if row.request_id != "cancelled")


class Publisher:
    def __init__(self, refuse: bool = False) -> None:
        self.published: list[tuple] = []
        self.refuse = refuse

    def publish(self, message: InferenceRequest, spec, deadline_ms: int, priority: str) -> None:
        if self.refuse:
            raise ApiError(503, "request queue unavailable, retry later")
        assert message.published_at_ms > 1  # stamped when published, not when the job was accepted
        self.published.append((message.request_id, spec.queue, deadline_ms, priority))


class FallingBackJobs(EndedJobs):
    def __init__(self, ended: list[EndedJob]) -> None:
        super().__init__(ended)
        self.fallen: list[tuple] = []
        self.dropped: list[str] = []

    def fell_back(self, job_id: str, failed: str, error: str, stable: str, deadline_ms: int) -> None:
        self.fallen.append((job_id, failed, stable))

    def drop_fallback(self, job_id: str) -> None:
        self.dropped.append(job_id)


def failed_canary_job(job_id: str) -> EndedJob:
    job = ended_job(job_id, "error", True)
    request = {"request_id": f"{job_id}-fallback", "model": "rollback-jobs", "model_version": "1",
               "instances": [{"prompt": "p"}], "published_at_ms": 1,
               "parameters": {"seed": 1, "num_inference_steps": 10, "guidance_scale": 7.5, "width": 64, "height": 64}}  # fmt: skip
    fallback = FallbackRequest(json.dumps(request), "normal")
    return EndedJob(job.job_id, job.row, job.reply, True, deadline_ms=10**13, fallback=fallback)


def test_a_job_the_canary_failed_is_sent_once_to_the_stable_version_and_its_row_waits_for_that_attempt():
    jobs, rows, observed, publisher = FallingBackJobs([failed_canary_job("j")]), Rows(), Observed(), Publisher()
    finisher = JobLogFinisher(jobs, rows, observations=observed, catalog=CATALOG, inference=publisher)
    assert finisher.finish_ended() == 0 and rows.rows == []  # not ended: the stable version is asked
    assert publisher.published == [("j-fallback", "rollback-jobs--1", 10**13, "normal")]
    assert jobs.fallen == [("j", "2", "1")] and observed.calls == [("rollback-jobs", "2", "j", False)]
    # Its stable attempt ended: one row, the stable version's, naming the failed first attempt.
    answered = ended_job("j", "ok", True)
    jobs.ended, jobs.claimed = [EndedJob("j", answered.row, answered.reply, True, 10**13, None, "2", "boom")], set()
    assert finisher.finish_ended() == 1
    (row,) = rows.rows
    assert (row.model_version, row.status, row.fallback_from, row.fallback_error) == ("1", "ok", "2", "boom")
    assert observed.calls[-1] == ("rollback-jobs", "1", "j", True)


def test_a_job_whose_stable_version_cannot_be_asked_ends_with_the_canarys_answer():
    jobs, rows = FallingBackJobs([failed_canary_job("j")]), Rows()
    finisher = JobLogFinisher(jobs, rows, catalog=CATALOG, inference=Publisher(refuse=True))
    assert finisher.finish_ended() == 1 and jobs.dropped == ["j"] and jobs.fallen == []
    assert (rows.rows[0].model_version, rows.rows[0].status, rows.rows[0].fallback_from) == ("2", "error", None)


class ScriptedInference:
    """The inference service as the serving stage calls it: each `run` answers the next scripted reply."""

    def __init__(self, *replies: InferenceReply | None) -> None:
        self.replies, self.runs = list(replies), []

    def job_deadline_ms(self) -> int:
        return int((time.time() + 900) * 1000)

    def run(self, prepared, timings, deadline_ms: int, wait_seconds: float | None = None) -> InferenceReply | None:
        self.runs.append((prepared.request_id, prepared.spec.version, wait_seconds))
        return self.replies.pop(0)

    def predictions(self, reply: InferenceReply) -> list[dict]:
        return [{"image_b64": "AAAA", "seed": 1, "width": 64, "height": 64}]


def serving_with(inference: ScriptedInference) -> ServingStage:
    splits = SimpleNamespace(split=lambda name: SimpleNamespace(shadow=None))
    return ServingStage(None, CATALOG, inference, None, None, None, None, None, None,
                        SimpleNamespace(splits=splits), None)  # type: ignore[arg-type]  # fmt: skip


def canary_request(received: float | None = None, pinned: bool = False) -> PreparedRequest:
    spec = CATALOG.version("fallback", "2")
    body = PredictBody.model_validate({"instances": [{"prompt": "p"}]})
    params = GenerationParameters(seed=1, num_inference_steps=10, guidance_scale=7.5, width=64, height=64)
    return PreparedRequest("r", spec, body, params, [None], "normal", Caller("k", "d"), pinned=pinned,
                           received=time.perf_counter() if received is None else received)  # fmt: skip


def reply(status: str, version: str, error_kind: str | None = None) -> InferenceReply:
    return InferenceReply(request_id="r", model="fallback", model_version=version, status=status,
                          error=None if status == "ok" else "configured to fail", error_kind=error_kind)  # fmt: skip


def test_a_canary_error_is_asked_once_of_the_stable_version_within_the_callers_wait():
    inference = ScriptedInference(reply("error", "2"), reply("ok", "1"))
    answer = serving_with(inference)._run_sync(canary_request())
    assert answer.outcome is Outcome.OK and json.loads(answer.record.body)["model_version"] == "1"
    assert json.loads(answer.record.body)["request_id"] == "r"
    assert (answer.fallback.failed_version, answer.fallback.answered_by.version) == ("2", "1")
    (first, second) = inference.runs
    assert first == ("r", "2", None) and second[:2] == ("r-fallback", "1") and 0 < second[2] <= 30


def test_a_stable_version_silent_in_the_time_left_is_a_504_naming_both():
    answer = serving_with(ScriptedInference(reply("error", "2"), None))._run_sync(canary_request())
    assert answer.record.status == 504 and answer.fallback is not None
    assert "version 2 failed (configured to fail)" in json.loads(answer.record.body)["error"]["message"]


def test_no_fallback_when_no_time_is_left_or_the_version_was_pinned():
    late = canary_request(received=time.perf_counter() - 31)
    for prepared in (late, canary_request(pinned=True)):
        inference = ScriptedInference(reply("error", "2"))
        answer = serving_with(inference)._run_sync(prepared)
        assert answer.record.status == 500 and answer.fallback is None and len(inference.runs) == 1


def test_a_canary_refusing_the_callers_input_is_answered_as_is_not_asked_of_the_stable_version():
    inference = ScriptedInference(reply("error", "2", "bad_input"), reply("ok", "1"))
    answer = serving_with(inference)._run_sync(canary_request())
    assert answer.outcome is Outcome.INPUT_REFUSED and answer.record.status == 422 and answer.fallback is None
    assert inference.runs == [("r", "2", None)]


def test_the_rollback_guard_counts_a_canarys_own_error_but_not_its_refusal_of_the_callers_input():
    observed = Observed()
    records = RequestRecords(None, None, None, "i", "per-request", observations=observed)  # type: ignore[arg-type]
    for kind in ("bad_input", None):
        answer = serving_with(ScriptedInference(reply("error", "2", kind), reply("ok", "1")))._run_sync(
            canary_request(pinned=True)
        )
        call = InferenceCall(InferenceLogRow(f"r-{kind}", datetime.now(UTC), "fallback", "error", 500), Mode.SYNC)
        call.spec, call.answer = CATALOG.version("fallback", "2"), answer
        records._observe(call, answer.outcome, 10.0)
    assert observed.calls == [("fallback", "2", "r-None", False)]


class OneJobRedis:
    """The Redis calls `JobStore` reads an unlogged job with: one job hash, stored replies, the unlogged set."""

    def __init__(self, job_id: str, fields: dict[str, str], replies: list[InferenceReply]) -> None:
        self.job_id, self.deadline_ms = job_id, int(fields["deadline_ms"])
        self.hash = {key.encode(): value.encode() for key, value in fields.items()}
        self.values = {naming.result_key(reply.request_id): reply.model_dump_json().encode() for reply in replies}

    def zrange(self, key: str, start: int, end: int, withscores: bool = False) -> list:
        return [(self.job_id.encode(), float(self.deadline_ms))]

    def hmget(self, key: str, fields: list[str]) -> list[bytes | None]:
        assert key == job_key(self.job_id)
        return [self.hash.get(field.encode()) for field in fields]

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return dict(self.hash) if key == job_key(self.job_id) else {}

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)


def canary_job(error_kind: str) -> JobStore:
    """A job the split sent to version 2 of `fallback`, which answered it with an error of `error_kind`."""
    now_ms = int(time.time() * 1000)
    request = {"request_id": fallback_request_id("j"), "model": "fallback", "model_version": "1",
               "instances": [{"prompt": "p"}], "published_at_ms": 1,
               "parameters": {"seed": 1, "num_inference_steps": 10, "guidance_scale": 7.5, "width": 64, "height": 64}}  # fmt: skip
    fields = {"owner:k": "1", "model": "fallback", "model_version": "2", "created_ms": str(now_ms),
              "deadline_ms": str(now_ms + 60_000), "fallback_request": json.dumps(request), "fallback_priority": "normal",
              "log_row": json.dumps(ended_job("j", None, True).row), "observe": "1"}  # fmt: skip
    failed = InferenceReply(request_id="j", model="fallback", model_version="2", status="error",
                            error="configured to fail", error_kind=error_kind)  # fmt: skip
    client = OneJobRedis("j", fields, [failed])
    return JobStore(client, ResultStore(client, 600), 600)  # type: ignore[arg-type]


def test_a_job_the_canary_failed_by_its_own_error_waits_for_the_stable_version():
    jobs = canary_job("inference_failed")
    (ended,) = jobs.ended_unlogged()
    assert ended.fallback is not None and ended.reply is not None and ended.reply.status == "error"
    assert jobs.get("j", "k").status == "queued"  # the canary's error is not the job's end


def test_a_job_whose_input_the_canary_refused_ends_failed_and_is_not_sent_to_the_stable_version():
    jobs = canary_job("bad_input")
    (ended,) = jobs.ended_unlogged()
    assert ended.fallback is None and ended.reply is not None and ended.reply.error_kind == "bad_input"
    job = jobs.get("j", "k")
    assert (job.status, job.model_version) == ("failed", "2")
    rows, publisher = Rows(), Publisher()
    finisher = JobLogFinisher(EndedJobs([ended]), rows, catalog=CATALOG, inference=publisher)
    assert finisher.finish_ended() == 1 and publisher.published == []
    assert (rows.rows[0].model_version, rows.rows[0].status, rows.rows[0].error_kind) == ("2", "error", "bad_input")
