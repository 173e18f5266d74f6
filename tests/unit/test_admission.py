"""Admission by predicted wait: the estimate and the decision, and what the serving stage does with a refusal."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from api_server.core.auth import Caller
from api_server.inference_log.records import InferenceCall, RequestRecords
from api_server.inference_log.writer import InferenceLogRow
from api_server.predict.admission import AdmissionControl, Backlog, judge
from api_server.predict.inference import InferenceService
from api_server.predict.serving import Mode, ServingStage
from contract.catalog import DEFAULT_CATALOG_PATH, ModelCatalog
from contract.messages import InferenceReply
from contract.outcomes import Outcome
from emulators.stack import local_catalog

CATALOG = local_catalog(test_fixtures=True)  # sleep-admitted: admission on, `noop` its fallback
MODEL = "sleep-admitted"


def backlog(
    ahead: int, workers: int = 1, run_seconds: float | None = 2.0, answered: int = 0, per_worker: int = 1, **more
) -> Backlog:
    """`ahead` waiting behind `workers` busy workers (each holding what it runs at once)."""
    return Backlog(ahead=ahead, held=workers * per_worker, workers=workers, per_worker=per_worker,
                   answered=answered, window_seconds=60.0, run_seconds=run_seconds, **more)  # fmt: skip


# The decision, from a known backlog and rate.


def test_a_request_whose_predicted_finish_is_past_its_deadline_is_refused_with_a_retry_after_from_the_estimate():
    # One worker busy, 20 waiting ahead at 2 s each: the running call counts whole (2 s), then 40 s of backlog:
    # it starts in 42 s and ends in 44 s; 30 s are left.
    verdict = judge(backlog(20), left_seconds=30)
    assert not verdict.admitted
    assert (verdict.start_seconds, verdict.finish_seconds) == (42.0, 44.0)
    # 14 s from now the 7 requests ahead that are too many are gone: then it ends in exactly its 30 s.
    assert verdict.retry_after == 14


def test_a_request_whose_deadline_can_be_met_is_admitted():
    verdict = judge(backlog(10), left_seconds=30)
    assert verdict.admitted and verdict.finish_seconds == 24.0


def test_the_same_backlog_is_admitted_against_a_jobs_long_deadline():
    assert judge(backlog(20), left_seconds=900).admitted


def test_the_safety_factor_refuses_earlier():
    assert judge(backlog(10), left_seconds=30, safety_factor=1.0).admitted
    refused = judge(backlog(10), left_seconds=30, safety_factor=1.5)
    assert not refused.admitted and refused.finish_seconds == 36.0 and refused.retry_after == 4


def test_the_default_margin_counts_each_call_at_its_time_plus_two_mean_deviations_and_the_answers_trip():
    # 2 s calls that spread by 0.25 s count 2.5 s each; the answer reaches the API 0.5 s after its call ends.
    spread = backlog(10, spread_seconds=0.25, trip_seconds=0.5)
    assert spread.call_seconds == 2.5
    verdict = judge(spread, left_seconds=30)
    # (1 running + 10 ahead) calls of 2.5 s before it starts, its own, and the trip: 30.5 s, past its 30 s.
    assert (verdict.start_seconds, verdict.finish_seconds, verdict.admitted) == (27.5, 30.5, False)
    # The same backlog on the point estimate (no spread, no trip) was admitted: 24 s.
    assert judge(backlog(10), left_seconds=30).admitted


def test_what_a_worker_holds_beyond_what_it_runs_is_ahead_of_a_new_request():
    # One worker running one request and holding 3 more in its hands, 5 waiting in the queue: 8 ahead.
    held = Backlog(ahead=5, held=4, workers=1, per_worker=1, answered=0, window_seconds=60, run_seconds=2.0)
    assert (held.queued, held.free) == (8, 0)
    assert judge(held, left_seconds=30).start_seconds == 2.0 + 8 * 2.0


def test_a_free_place_takes_a_request_at_once_however_long_a_call_is():
    # Ten workers of 20 s calls, one busy, two waiting: the new request is the third for eight free workers.
    fleet = Backlog(ahead=2, held=1, workers=10, per_worker=1, answered=0, window_seconds=60, run_seconds=20.0)
    verdict = judge(fleet, left_seconds=30)
    assert verdict.admitted and verdict.start_seconds == 0.0


def test_the_ready_workers_batch_sizes_are_the_capacity():
    # Two ready workers that run 4 and 8 at once, at 0.5 s a call: 24 requests a second, whatever max_batch_size.
    ready = Backlog(ahead=0, held=0, workers=2, per_worker=1, answered=0, window_seconds=60, run_seconds=0.5, slots=12)
    assert (ready.capacity, ready.rate) == (12, 24.0)


def test_the_answered_rate_is_used_only_while_no_capacity_is_known():
    # 120 answered in the last minute (2/s), no worker known: 20 ahead start in 2 s + 10 s.
    unknown = backlog(20, workers=0, answered=120)
    assert unknown.rate == 2.0 and judge(unknown, left_seconds=30).admitted
    # One busy worker known at 2 s a call: its 0.5/s is what drains the backlog, not the window's answers.
    assert backlog(20, answered=120).rate == 0.5


def test_the_capacity_is_the_workers_seen_times_what_one_runs_at_once_over_the_call_time():
    # Two workers of 8-image batches at 0.2 s a call, after an idle minute (one answered): 80 requests a second.
    assert backlog(100, workers=2, per_worker=8, run_seconds=0.2, answered=1).rate == 80.0


def test_a_model_with_no_rate_seen_yet_is_admitted_without_an_estimate():
    verdict = judge(backlog(50, workers=0, run_seconds=None), left_seconds=30)
    assert verdict.admitted and not verdict.known


def test_a_model_with_ready_workers_and_no_history_is_admitted():
    # Its workers said they are ready; nothing answered yet: nothing ahead, it starts at once.
    fresh = Backlog(ahead=0, held=0, workers=2, per_worker=1, answered=0, window_seconds=60, run_seconds=None, slots=2)
    assert judge(fresh, left_seconds=1).admitted
    # A burst before any answer: admitted without an estimate (no call time to judge by).
    burst = Backlog(ahead=40, held=2, workers=2, per_worker=1, answered=0, window_seconds=60, run_seconds=None, slots=2)
    verdict = judge(burst, left_seconds=30)
    assert verdict.admitted and not verdict.known


def test_an_empty_backlog_is_admitted_whatever_the_rate():
    assert judge(backlog(0, workers=0, run_seconds=None), left_seconds=1).admitted


# The control: which requests are judged, and against which backlog.


class Ledger:
    def __init__(self, ahead_by_priority: dict[str, int]) -> None:
        self.ahead_by_priority, self.asked, self.run_times, self.released = ahead_by_priority, [], [], []

    def backlog(self, queue: str, priority: str, per_worker: int = 1, reserve: str = "") -> Backlog:
        self.asked.append((queue, priority))
        return backlog(self.ahead_by_priority[priority])

    def release(self, queue: str, priority: str, request_id: str) -> None:
        self.released.append((queue, request_id))

    def ran(self, queue: str, call_ms: float, trip_ms: float | None = None) -> None:
        self.run_times.append((queue, call_ms))


class RedisUp:
    def available(self) -> bool:
        return True


def control(**ahead: int) -> tuple[AdmissionControl, Ledger]:
    ledger = Ledger({"high": 0, "normal": 20, **ahead})
    return AdmissionControl(ledger, RedisUp()), ledger  # type: ignore[arg-type]


def test_batch_lines_and_models_without_admission_are_never_judged():
    admission, ledger = control()
    assert admission.check(CATALOG.get(MODEL), "batch", 1) is None
    assert admission.check(CATALOG.get("sleep"), "normal", 1) is None
    assert ledger.asked == []


def test_a_high_priority_request_is_judged_by_the_backlog_at_high_priority_only():
    admission, ledger = control(high=0, normal=500)
    assert admission.check(CATALOG.get(MODEL), "high", 30).admitted
    assert ledger.asked == [(MODEL, "high")]


def catalog_where_sd15_has(admission: dict, tmp_path: Path) -> ModelCatalog:
    raw = yaml.safe_load(DEFAULT_CATALOG_PATH.read_text())
    raw["models"]["sd15-txt2img"]["admission"] = admission
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(raw))
    return ModelCatalog.from_yaml(path)


def test_admission_can_be_switched_off_in_the_catalog(tmp_path: Path):
    spec = catalog_where_sd15_has({"enabled": False, "safety_factor": 2.0}, tmp_path).get("sd15-txt2img")
    assert spec.admission.safety_factor == 2.0 and control()[0].check(spec, "normal", 1) is None


@pytest.mark.parametrize(
    ("fallback", "problem"), [("nope", "not another model"), ("sd15-txt2img", "not another model"),
                              ("sd15-img2img", "is image-to-image")],
)  # fmt: skip
def test_a_fallback_must_be_another_model_of_the_same_task(fallback: str, problem: str, tmp_path: Path):
    with pytest.raises(ValueError, match=problem):
        catalog_where_sd15_has({"fallback": fallback}, tmp_path)


# The serving stage: a refusal before anything is published; the fallback when the caller allows it.


class RecordedInference(InferenceService):
    """The real validation (`prepare`); publishing and waiting recorded, each answered at once."""

    def __init__(self) -> None:
        super().__init__(None, None, 900)  # type: ignore[arg-type]
        self.runs: list[str] = []
        self.published: list[str] = []

    def run(self, prepared, timings, deadline_ms, wait_seconds=None) -> InferenceReply:
        self.runs.append(prepared.spec.name)
        return InferenceReply(request_id=prepared.request_id, model=prepared.spec.name,
                              model_version=prepared.spec.version, status="ok", inference_ms=5.0)  # fmt: skip

    def message(self, prepared):
        return SimpleNamespace(request_id=prepared.request_id)

    def publish(self, message, spec, deadline_ms, priority, log_row=None, reply_to=None) -> bool:
        self.published.append(spec.name)
        return False

    def predictions(self, reply: InferenceReply) -> list[dict]:
        return []


class Jobs:
    def create(self, *args, **kwargs) -> None:
        pass


def stage(admission: AdmissionControl) -> tuple[ServingStage, RecordedInference]:
    inference = RecordedInference()
    splits = SimpleNamespace(split=lambda name: SimpleNamespace(shadow=None))
    serving = ServingStage(None, CATALOG, inference, Jobs(), None, None, None, None, None,  # type: ignore[arg-type]
                           SimpleNamespace(splits=splits), None, admission=admission)  # fmt: skip
    return serving, inference


def prepared(serving: ServingStage, **body):
    return serving.prepare(CATALOG.get(MODEL), {"instances": [{"prompt": "p"}], **body}, "r", Caller("k", "d"))


def test_an_overloaded_sync_request_is_refused_at_once_and_nothing_is_published():
    admission, ledger = control()
    serving, inference = stage(admission)
    answer = serving._run_sync(prepared(serving))
    assert answer.outcome is Outcome.OVERLOADED and answer.record.status == 503
    # The estimate's 14 s (see above), rounded up past the moment already spent of its 30 s.
    assert answer.record.headers["Retry-After"] in ("14", "15")
    assert "overloaded" in json.loads(answer.record.body)["error"]["message"]
    assert inference.runs == [] and inference.published == []
    assert ledger.released == [(MODEL, "r")]  # its place in the backlog, taken when judged, is given back


def test_a_job_is_judged_against_its_own_long_deadline_and_published():
    admission, _ = control()
    serving, inference = stage(admission)
    answer = serving._submit_job(prepared(serving))
    assert answer.outcome is Outcome.ACCEPTED and inference.published == [MODEL]


def test_an_admitted_request_is_published_and_its_run_time_kept_for_the_estimate():
    admission, ledger = control(normal=3)
    serving, inference = stage(admission)
    assert serving._run_sync(prepared(serving)).outcome is Outcome.OK
    assert inference.runs == [MODEL] and ledger.run_times == [(MODEL, 5.0)]


def test_an_overloaded_request_that_allows_it_is_answered_by_the_fallback_and_says_so():
    admission, _ = control()
    serving, inference = stage(admission)
    answer = serving._run_sync(prepared(serving, allow_fallback=True))
    body = json.loads(answer.record.body)
    assert answer.outcome is Outcome.OK and inference.runs == ["noop"]
    assert (body["model"], body["model_version"]) == ("noop", "1")
    assert body["fallback_from"]["model"] == MODEL and "overloaded" in body["fallback_from"]["reason"]
    assert answer.record.headers["X-MaaS-Fallback-From"] == f"{MODEL}/1"
    assert (answer.overload.asked.name, answer.overload.answered_by.name) == (MODEL, "noop")


def test_the_fallbacks_row_names_the_fallback_model_and_version_and_the_model_asked_for():
    admission, _ = control()
    serving, _ = stage(admission)
    call = InferenceCall(InferenceLogRow(request_id="r", created_at=None, model=MODEL, status="error",
                                         http_status=500), Mode.SYNC)  # type: ignore[arg-type]  # fmt: skip
    call.caller, call.spec = Caller("k", "d"), CATALOG.get(MODEL)
    call.prepared = prepared(serving, allow_fallback=True)
    call.answer = serving._run_sync(call.prepared)
    written: list[InferenceLogRow] = []
    records = RequestRecords(SimpleNamespace(write=written.append), None, None, "api", "per-request")  # type: ignore[arg-type]
    records.close(call, 200, None)
    (row,) = written
    assert (row.model, row.model_version, row.status) == ("noop", "1", "ok")
    assert row.overload_fallback_from == f"{MODEL}/1"


def test_the_refusal_is_logged_as_its_own_outcome():
    admission, _ = control()
    serving, _ = stage(admission)
    call = InferenceCall(InferenceLogRow(request_id="r", created_at=None, model=MODEL, status="error",
                                         http_status=500), Mode.SYNC)  # type: ignore[arg-type]  # fmt: skip
    call.caller, call.spec = Caller("k", "d"), CATALOG.get(MODEL)
    call.prepared = prepared(serving)
    call.answer = serving._run_sync(call.prepared)
    written: list[InferenceLogRow] = []
    records = RequestRecords(SimpleNamespace(write=written.append), None, None, "api", "per-request")  # type: ignore[arg-type]
    records.close(call, 503, None)
    (row,) = written
    assert (row.model, row.status, row.error_kind, row.http_status) == (MODEL, "overloaded", "overloaded", 503)
    assert row.overload_fallback_from is None


def test_without_the_opt_in_nothing_falls_back():
    admission, _ = control()
    serving, inference = stage(admission)
    assert serving._run_sync(prepared(serving, allow_fallback=False)).outcome is Outcome.OVERLOADED
    assert inference.runs == []


def test_a_fallback_that_is_overloaded_too_leaves_the_refusal():
    class BothFull(Ledger):
        def backlog(self, queue, priority, per_worker=1, reserve=""):
            return backlog(20)

    serving, inference = stage(AdmissionControl(BothFull({}), RedisUp()))  # type: ignore[arg-type]
    # noop has no admission of its own in the catalog: give it one for this test.
    noop = CATALOG.get("noop")
    serving._catalog = SimpleNamespace(get=lambda name: noop.model_copy(update={"admission": CATALOG.get(MODEL)
                                       .admission.model_copy(update={"fallback": None})}),
                                       rollout=lambda name: None)  # fmt: skip
    answer = serving._run_sync(prepared(serving, allow_fallback=True))
    assert answer.outcome is Outcome.OVERLOADED and inference.runs == []


def test_time_already_spent_counts_against_a_sync_requests_wait():
    admission, _ = control(normal=12)  # ends in 28 s: admitted with 30 s left, refused with 25 s
    serving, _ = stage(admission)
    fresh = prepared(serving)
    assert serving._run_sync(fresh).outcome is Outcome.OK
    late = prepared(serving)
    late.received = time.perf_counter() - 5
    assert serving._run_sync(late).outcome is Outcome.OVERLOADED


# One decision, one count and one log line (what the dashboard's admission series counts).


def admission_lines(caplog) -> list[dict]:
    return [record.fields["admission"] for record in caplog.records if "admission" in getattr(record, "fields", {})]


def test_a_fallback_is_one_decision_logged_once_as_a_fallback(caplog):
    admission, _ = control()
    serving, _ = stage(admission)
    with caplog.at_level("INFO", logger="api_server.predict.admission"):
        assert serving._run_sync(prepared(serving, allow_fallback=True)).outcome is Outcome.OK
    assert [(line["model"], line["decision"]) for line in admission_lines(caplog)] == [(MODEL, "fallback")]


def test_a_refusal_is_one_decision_logged_once_as_refused(caplog):
    admission, _ = control()
    serving, _ = stage(admission)
    with caplog.at_level("INFO", logger="api_server.predict.admission"):
        assert serving._run_sync(prepared(serving, allow_fallback=False)).outcome is Outcome.OVERLOADED
        assert serving._submit_job(prepared(serving)).outcome is Outcome.ACCEPTED  # admitted: no line
    (line,) = admission_lines(caplog)
    assert (line["model"], line["decision"]) == (MODEL, "refused") and line["retry_after"] in (14, 15)


def test_a_busy_workers_call_time_runs_from_its_previous_calls_end_and_the_trip_is_what_the_caller_waits_beyond_it():
    admission, ledger = control()
    trips: list[float | None] = []
    ledger.ran = lambda queue, call_ms, trip_ms=None: (ledger.run_times.append((queue, call_ms)), trips.append(trip_ms))
    spec = CATALOG.get(MODEL)
    now_ms = time.time() * 1000
    busy = InferenceReply(request_id="r", model=MODEL, model_version="1", status="ok", queue_ms=4000.0,
                          inference_ms=2000.0, worker_finished_ms=int(now_ms) - 300,
                          previous_call_ended_ms=int(now_ms) - 2450)  # fmt: skip
    # Published 6.5 s ago: 4 s queued, 2 s running, so the answer took 0.5 s to come back.
    admission.ran(spec, busy, published_ms=now_ms - 6500)
    # An idle worker: published 2.8 s ago, 0.3 s to pick it up, 2 s running, 0.5 s back: a 0.8 s trip.
    idle = busy.model_copy(update={"previous_call_ended_ms": None, "queue_ms": 300.0})
    admission.ran(spec, idle, published_ms=time.time() * 1000 - 2800)
    admission.ran(spec, idle)
    assert ledger.run_times == [(MODEL, 2150), (MODEL, 2000.0), (MODEL, 2000.0)]
    assert 500 <= trips[0] < 1500 and 800 <= trips[1] < 1800 and trips[2] is None
