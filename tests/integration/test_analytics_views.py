"""Every analytics view, run by the BigQuery emulator over a seeded log, gives the numbers computed here in Python."""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest

from contract import google_clients
from emulators.bootstrap import ANALYTICS_SQL_DIR, bootstrap_bigquery

pytestmark = pytest.mark.stack
DAY1 = datetime(2026, 11, 20, 9, 15, tzinfo=UTC)
DAY2 = datetime(2026, 11, 21, 17, 40, tzinfo=UTC)
UNKNOWN_MODEL = "no-such-model-zz"


def seeded_rows() -> list[dict]:
    """Two days, two models, two keys; ok rows in shared batches, cache hits, coalesced, errors, one duplicate."""
    rows = []
    for day_index, start in enumerate((DAY1, DAY2)):
        for model_index, model in enumerate(("sd15-txt2img", "sleep")):
            for batch in range(3):
                batch_id = f"b-{day_index}-{model}-{batch}"
                members = [(1, "key-a"), (2, "key-b"), (1, "key-a")]  # four images per pipeline call
                for member, (images, key) in enumerate(members):
                    index = batch * 3 + member
                    rows.append(
                        {
                            "request_id": f"r-{day_index}-{model}-{index}",
                            "created_at": start + timedelta(minutes=index),
                            "model": model,
                            "model_version": "1",
                            "endpoint": "sync",
                            "api_key_id": key,
                            "status": "ok",
                            "http_status": 200,
                            "num_images": images,
                            "total_ms": 100.0 + 37 * index + 11 * model_index + 5 * day_index,
                            "queue_ms": 10.0 + 3 * index,
                            "inference_ms": 800.0 + 100 * batch,
                            "batch_id": batch_id,
                            "batch_size": 4,
                            "worker_id": f"w-{batch % 2}",
                            "worker_started_at": start + timedelta(minutes=index, seconds=1),
                        }
                    )
            rows.append(
                {"request_id": f"hit-{day_index}-{model}", "created_at": start, "model": model, "api_key_id": "key-a",
                 "model_version": "1", "endpoint": "sync",
                 "status": "ok", "http_status": 200, "num_images": 1, "cache_hit": True, "total_ms": 3.0,
                 "queue_ms": 0.0}
            )  # fmt: skip
            rows.append(
                {"request_id": f"join-{day_index}-{model}", "created_at": start, "model": model, "api_key_id": "key-b",
                 "model_version": "1", "endpoint": "sync",
                 "status": "ok", "http_status": 200, "num_images": 1, "coalesced": True, "total_ms": 900.0,
                 "queue_ms": 12.0, "inference_ms": 800.0, "batch_id": f"b-{day_index}-{model}-0", "batch_size": 4}
            )  # fmt: skip
            for error_index, (status, kind, http) in enumerate(
                [("error", "rate_limited", 429), ("timeout", "timeout", 504), ("error", "bad_input", 422)]
            ):
                rows.append(
                    {"request_id": f"err-{day_index}-{model}-{error_index}", "created_at": start, "model": model,
                     "model_version": "1", "endpoint": "sync",
                     "api_key_id": "key-b", "status": status, "error_kind": kind, "http_status": http}
                )  # fmt: skip
        for job_index, total_ms in enumerate((4000.0, 6500.0)):  # jobs: end to end, far above the sync times
            rows.append(
                {"request_id": f"job-{day_index}-{job_index}", "job_id": f"job-{day_index}-{job_index}",
                 "created_at": start, "model": "sd15-txt2img", "model_version": "1", "endpoint": "job",
                 "api_key_id": "key-a", "status": "ok", "http_status": 202, "num_images": 1, "total_ms": total_ms,
                 "queue_ms": 3000.0 + job_index}
            )  # fmt: skip
        # Refused before routing: no catalog model, so no model version; in the errors view only.
        rows.append(
            {"request_id": f"unknown-{day_index}", "created_at": start, "model": UNKNOWN_MODEL, "api_key_id": "key-a",
             "endpoint": "sync", "status": "rejected", "error_kind": "not_found", "http_status": 404}
        )  # fmt: skip
    rows.append(dict(rows[0]))  # a retried write that landed twice: views must count it once
    return rows


@pytest.fixture(scope="module")
def views(stack, settings):
    dataset = f"analytics_{uuid.uuid4().hex[:8]}"
    view_settings = dataclasses.replace(settings, dataset=dataset)
    bootstrap_bigquery(view_settings)
    client = google_clients.bigquery_client(view_settings)
    table = f"{settings.project_id}.{dataset}.{settings.log_table}"
    payload = [{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()} for row in seeded_rows()]
    assert client.insert_rows_json(table, payload) == []

    def query(view: str, order: str) -> list[dict]:
        sql = f"SELECT * FROM `{settings.project_id}.{dataset}.{view}` ORDER BY {order}"
        return [dict(row) for row in client.query(sql).result()]

    query.dataset = dataset
    yield query
    client.delete_dataset(f"{settings.project_id}.{dataset}", delete_contents=True, not_found_ok=True)


def unique_rows(routed_only: bool = False) -> list[dict]:
    """One row per request id; `routed_only`: without the refusals that never reached a catalog model."""
    seen, unique = set(), []
    for row in seeded_rows():
        if row["request_id"] not in seen and (row.get("model_version") or not routed_only):
            seen.add(row["request_id"])
            unique.append(row)
    return unique


def no_gpu(row: dict) -> bool:
    return bool(row.get("cache_hit") or row.get("coalesced") or row.get("idempotent_replay"))


def test_every_sql_file_is_covered_here():
    tested = {"daily_usage_by_model", "hourly_usage_by_model", "latency_by_model_hourly", "cache_and_coalescing_daily",
              "errors_by_kind_daily", "billing_by_api_key_daily", "batch_efficiency_hourly", "busiest_hours",
              "version_comparison", "rollouts", "flows_by_stage_daily", "gpu_seconds_by_batch",
              "usage_by_task_daily"}  # fmt: skip
    assert {path.stem for path in ANALYTICS_SQL_DIR.glob("*.sql")} == tested


def test_daily_usage_counts_each_request_once(views):
    expected = defaultdict(lambda: {"requests": 0, "succeeded": 0, "failed": 0, "cache_hits": 0, "images": 0})
    for row in unique_rows(routed_only=True):
        cell = expected[(row["created_at"].date(), row["model"])]
        cell["requests"] += 1
        cell["succeeded" if row["status"] == "ok" else "failed"] += 1
        cell["cache_hits"] += bool(row.get("cache_hit"))
        cell["images"] += row.get("num_images", 0) if row["status"] == "ok" else 0
    got = {
        (r["day"], r["model"]): {k: r[k] for k in ("requests", "succeeded", "failed", "cache_hits", "images")}
        for r in views("daily_usage_by_model", "day, model")
    }
    assert got == dict(expected)


def test_hourly_usage_and_busiest_hours(views):
    hourly = defaultdict(int)
    by_hour_of_day = defaultdict(int)
    for row in unique_rows(routed_only=True):
        hourly[(row["created_at"].replace(minute=0), row["model"])] += 1
        by_hour_of_day[(row["created_at"].hour, row["model"])] += 1
    got = {(r["hour"], r["model"]): r["requests"] for r in views("hourly_usage_by_model", "hour, model")}
    assert got == dict(hourly)
    busiest = {(r["hour_of_day"], r["model"]): r["requests"] for r in views("busiest_hours", "hour_of_day, model")}
    assert busiest == dict(by_hour_of_day)


def exact_rank_values(values: list[float], quantile: int) -> set[float]:
    """The exact value at a percentile and its neighbours: the emulator's APPROX_QUANTILES is off by one rank."""
    ordered = sorted(values)
    rank = math.ceil(quantile / 100 * len(ordered)) - 1
    return {ordered[max(0, min(len(ordered) - 1, rank + shift))] for shift in (-1, 0, 1)}


def test_latency_percentiles_match_exact_ones(views):
    groups = defaultdict(list)
    for row in unique_rows():
        if row["status"] == "ok":
            groups[(row["created_at"].replace(minute=0), row["model"], row["endpoint"])].append(row)
    got = {(r["hour"], r["model"], r["endpoint"]): r for r in views("latency_by_model_hourly", "hour, model, endpoint")}
    assert set(got) == set(groups)
    for key, rows in groups.items():
        for column in ("total_ms", "queue_ms"):
            values = [row[column] for row in rows]
            for quantile in (50, 95, 99):
                assert got[key][f"p{quantile}_{column}"] in exact_rank_values(values, quantile), (key, column, quantile)


def test_cache_and_coalescing_rates(views):
    for r in views("cache_and_coalescing_daily", "day, model"):
        rows = [
            row
            for row in unique_rows(routed_only=True)
            if (row["created_at"].date(), row["model"]) == (r["day"], r["model"])
        ]
        assert r["requests"] == len(rows)
        assert r["cache_hits"] == sum(bool(row.get("cache_hit")) for row in rows) == 1
        assert r["coalesced"] == 1
        assert r["cache_hit_rate"] == pytest.approx(1 / len(rows))
        assert r["coalescing_rate"] == pytest.approx(1 / len(rows))


def test_error_rate_by_kind(views):
    got = {
        (r["day"], r["model"], r["outcome"]): (r["requests"], r["share"]) for r in views("errors_by_kind_daily", "day")
    }
    counts = defaultdict(int)
    totals = defaultdict(int)
    for row in unique_rows():
        outcome = "ok" if row["status"] == "ok" else row["error_kind"]
        counts[(row["created_at"].date(), row["model"], outcome)] += 1
        totals[(row["created_at"].date(), row["model"])] += 1
    assert set(got) == set(counts)
    for key, count in counts.items():
        assert got[key][0] == count and got[key][1] == pytest.approx(count / totals[key[:2]])


def test_billing_apportions_gpu_seconds_by_batch_share_and_bills_no_gpu_for_cache_hits(views):
    expected = defaultdict(lambda: {"requests": 0, "images": 0, "cache_hits": 0, "gpu_seconds": 0.0})
    for row in unique_rows(routed_only=True):
        cell = expected[(row["created_at"].date(), row["api_key_id"], row["model"])]
        cell["requests"] += 1
        cell["images"] += row.get("num_images", 0) if row["status"] == "ok" else 0
        cell["cache_hits"] += bool(row.get("cache_hit"))
        if row["status"] == "ok" and not no_gpu(row) and row.get("batch_size"):
            cell["gpu_seconds"] += row["inference_ms"] / 1000 * row["num_images"] / row["batch_size"]
    got = views("billing_by_api_key_daily", "day, api_key_id, model")
    assert {(r["day"], r["api_key_id"], r["model"]) for r in got} == set(expected)
    for r in got:
        cell = expected[(r["day"], r["api_key_id"], r["model"])]
        assert (r["requests"], r["images"], r["cache_hits"]) == (cell["requests"], cell["images"], cell["cache_hits"])
        assert r["gpu_seconds"] == pytest.approx(cell["gpu_seconds"])
    # Every pipeline call's seconds are billed exactly once across the keys that shared it.
    per_model_day = defaultdict(float)
    for r in got:
        per_model_day[(r["day"], r["model"])] += r["gpu_seconds"]
    assert all(seconds == pytest.approx(0.8 + 0.9 + 1.0) for seconds in per_model_day.values())


def test_batch_efficiency(views):
    got = views("batch_efficiency_hourly", "hour, model")
    assert sum(r["batches"] for r in got) == 12  # three calls per model per day
    for r in got:
        assert r["mean_batch_images"] == pytest.approx(r["images"] / r["batches"])
        assert r["utilisation"] == pytest.approx(r["busy_seconds"] / (3600 * r["workers"]))
    assert sum(r["images"] for r in got) == 48


def test_the_analytics_command_prints_every_view_filtered_by_model_and_time(views, monkeypatch, capsys):
    from analytics.__main__ import main

    monkeypatch.setenv("MAAS_DATASET", views.dataset)
    assert main(["--since", "2026-11-21", "--model", "sleep"]) == 0
    out = capsys.readouterr().out
    for path in ANALYTICS_SQL_DIR.glob("*.sql"):
        assert f"== {path.stem} (" in out
    assert "sd15-txt2img" not in out and "sleep" in out
    assert "2026-11-20" not in out and "2026-11-21" in out


def test_a_refusal_before_routing_is_no_models_usage_but_is_an_error(views):
    for view, order in [
        ("daily_usage_by_model", "day"), ("hourly_usage_by_model", "hour"), ("busiest_hours", "hour_of_day"),
        ("billing_by_api_key_daily", "day"), ("cache_and_coalescing_daily", "day"),
    ]:  # fmt: skip
        assert UNKNOWN_MODEL not in {r["model"] for r in views(view, order)}, view
    errors = [r for r in views("errors_by_kind_daily", "day") if r["model"] == UNKNOWN_MODEL]
    assert [(r["outcome"], r["requests"]) for r in errors] == [("not_found", 1), ("not_found", 1)]


def test_job_latency_is_kept_apart_from_sync_latency(views):
    usage = {(r["day"], r["model"]): r for r in views("daily_usage_by_model", "day, model")}
    for (day, model), r in usage.items():
        ok = [
            row
            for row in unique_rows()
            if row["status"] == "ok" and (row["created_at"].date(), row["model"]) == (day, model)
        ]
        sync = [row["total_ms"] for row in ok if row["endpoint"] == "sync"]
        jobs = [row["total_ms"] for row in ok if row["endpoint"] == "job"]
        assert r["avg_sync_total_ms"] == pytest.approx(sum(sync) / len(sync))
        assert r["avg_job_total_ms"] == (pytest.approx(sum(jobs) / len(jobs)) if jobs else None)
    jobs = [r for r in views("latency_by_model_hourly", "hour") if r["endpoint"] == "job"]
    assert len(jobs) == 2 and all(r["p50_total_ms"] in (4000.0, 6500.0) for r in jobs)


# Model versions. These add rows of a model of their own, so they run last (the views above count every model).
VERSIONED = "versioned-zz"


def test_zz_version_comparison_puts_versions_and_shadow_calls_side_by_side(views, settings):
    client = google_clients.bigquery_client(dataclasses.replace(settings, dataset=views.dataset))
    hour = DAY2.replace(minute=5)
    rows = []
    for index in range(4):  # version 1: four calls, one failed; version 2: two calls as shadow of the first two
        rows.append(
            {
                "request_id": f"v1-{index}",
                "created_at": hour.isoformat(),
                "model": VERSIONED,
                "model_version": "1",
                "endpoint": "sync",
                "api_key_id": "key-a",
                "status": "error" if index == 3 else "ok",
                "http_status": 500 if index == 3 else 200,
                "num_images": 2,
                "total_ms": 100.0 * (index + 1),
                "inference_ms": 50.0,
                "batch_size": 4,
            }
        )
    for index in range(2):
        rows.append(
            {
                "request_id": f"v1-{index}-shadow",
                "shadow_of": f"v1-{index}",
                "created_at": hour.isoformat(),
                "model": VERSIONED,
                "model_version": "2",
                "endpoint": "shadow",
                "api_key_id": "key-a",
                "status": "ok",
                "http_status": 200,
                "num_images": 2,
                "total_ms": 2100.0,
                "inference_ms": 2000.0,
                "batch_size": 2,
            }
        )
    # A request version 2 failed and version 1 (stable) then answered: a call of each, version 2's an error.
    rows.append(
        {
            "request_id": "v1-fallback",
            "created_at": hour.isoformat(),
            "model": VERSIONED,
            "model_version": "1",
            "fallback_from": "2",
            "fallback_error": "cannot run this request",
            "endpoint": "sync",
            "api_key_id": "key-a",
            "status": "ok",
            "http_status": 200,
            "num_images": 2,
            "total_ms": 150.0,
            "inference_ms": 50.0,
            "batch_size": 4,
        }
    )
    rows.append(
        {
            "request_id": "v1-hit",
            "created_at": hour.isoformat(),
            "model": VERSIONED,
            "model_version": "1",
            "endpoint": "sync",
            "status": "ok",
            "http_status": 200,
            "cache_hit": True,
            "total_ms": 1.0,
        }
    )
    assert client.insert_rows_json(f"{settings.project_id}.{views.dataset}.{settings.log_table}", rows) == []
    got = {(r["model_version"], r["traffic"]): r for r in views("version_comparison", "hour, model")
           if r["model"] == VERSIONED}  # fmt: skip
    assert set(got) == {("1", "served"), ("2", "served"), ("2", "shadow")}
    served, failed_first, shadow = got[("1", "served")], got[("2", "served")], got[("2", "shadow")]
    assert (served["requests"], served["error_rate"]) == (5, 0.2)  # the cache hit ran no version
    assert (failed_first["requests"], failed_first["error_rate"], failed_first["gpu_seconds"]) == (1, 1.0, 0)
    assert (shadow["requests"], shadow["error_rate"]) == (2, 0.0)
    assert served["p95_total_ms"] in (200.0, 300.0) and shadow["p50_inference_ms"] == 2000.0
    assert served["images_per_call"] == 4 and shadow["images_per_call"] == 2
    assert served["gpu_seconds"] == pytest.approx(4 * 0.05 * 2 / 4) and shadow["gpu_seconds"] == pytest.approx(4.0)
    billed = [r for r in views("billing_by_api_key_daily", "day") if r["model"] == VERSIONED]
    assert sum(r["requests"] for r in billed) == 6  # one line per caller's request; shadow calls are never billed


def test_zz_rollouts_lists_every_split_change(views, settings):
    client = google_clients.bigquery_client(dataclasses.replace(settings, dataset=views.dataset))
    rows = [
        {"at": DAY2.isoformat(), "model": VERSIONED, "action": "set", "actor": "admin-key",
         "from_split": '{"traffic": {"1": 100.0, "2": 0.0}}', "to_split": '{"traffic": {"1": 90.0, "2": 10.0}}',
         "reason": "canary 10%"},
        {"at": (DAY2 + timedelta(minutes=3)).isoformat(), "model": VERSIONED, "action": "rollback",
         "actor": "rollback-guard", "from_split": '{"traffic": {"1": 90.0, "2": 10.0}}',
         "to_split": '{"traffic": {"1": 100.0, "2": 0.0}}', "reason": "error rate 100.0% vs stable 0.0%"},
    ]  # fmt: skip
    assert client.insert_rows_json(f"{settings.project_id}.{views.dataset}.{settings.audit_table}", rows) == []
    got = [r for r in views("rollouts", "at") if r["model"] == VERSIONED]
    assert [(r["action"], r["actor"]) for r in got] == [("set", "admin-key"), ("rollback", "rollback-guard")]
    assert '"2"' in got[1]["from_split"] and "error rate" in got[1]["reason"]


def test_zz_flows_share_latency_and_gpu_seconds_by_stage_and_bill_the_flow_once(views, settings):
    client = google_clients.bigquery_client(dataclasses.replace(settings, dataset=views.dataset))
    hour, rows = DAY2.replace(minute=20).isoformat(), []
    for index in range(2):  # two calls of a two-stage flow; the second's refiner shared a batch of two images
        flow_id = f"flow-{index}"
        common = {"created_at": hour, "api_key_id": "key-flow", "endpoint": "sync", "status": "ok",
                  "http_status": 200, "num_images": 1, "flow": "two-stage"}  # fmt: skip
        rows.append({**common, "request_id": flow_id, "model": "two-stage", "model_version": "", "total_ms": 1000.0,
                     "gpu_seconds": 0.6 + (0.2 if index else 0.4)})  # fmt: skip
        for stage_index, (stage, model, ms, batch) in enumerate(
            [("base", "sdxl-base", 600.0, 1), ("refiner", "sdxl-refiner", 400.0, 1 + index)]
        ):
            rows.append({**common, "request_id": f"{flow_id}:{stage}", "model": model, "model_version": "1",
                         "endpoint": "stage",
                         "stage": stage, "stage_index": stage_index, "flow_request_id": flow_id,
                         "queue_ms": 0.0, "inference_ms": ms, "total_ms": ms, "batch_size": batch,
                         "gpu_seconds": ms / 1000 / batch})  # fmt: skip
    assert client.insert_rows_json(f"{settings.project_id}.{views.dataset}.{settings.log_table}", rows) == []
    got = {r["stage"]: r for r in views("flows_by_stage_daily", "day, flow, stage_index") if r["flow"] == "two-stage"}
    assert set(got) == {"base", "refiner"}
    assert (got["base"]["runs"], got["base"]["model"], got["base"]["stage_index"]) == (2, "sdxl-base", 0)
    assert got["base"]["latency_share"] == pytest.approx(0.6) and got["refiner"]["latency_share"] == pytest.approx(0.4)
    assert got["base"]["gpu_seconds"] == pytest.approx(1.2) and got["refiner"]["gpu_seconds"] == pytest.approx(0.6)
    assert got["base"]["gpu_share"] == pytest.approx(1.2 / 1.8) and got["refiner"]["gpu_share"] == pytest.approx(
        0.6 / 1.8
    )
    billed = [r for r in views("billing_by_api_key_daily", "day") if r["api_key_id"] == "key-flow"]
    assert [(r["model"], r["requests"], r["images"]) for r in billed] == [("two-stage", 2, 2)]
    assert billed[0]["gpu_seconds"] == pytest.approx(1.8)  # the flow's row, never its stages' rows again


def test_zz_a_batch_jobs_gpu_seconds_sum_its_lines_shares_once_each(views, settings):
    client = google_clients.bigquery_client(dataclasses.replace(settings, dataset=views.dataset))
    hour, rows = DAY2.replace(minute=40).isoformat(), []
    # Three lines of one batch: two ok (one alone in its call, one sharing a call of four images), one failed; the
    # first line's row written twice (a retried insert): inference_log_unique counts it once.
    for custom_id, status, ms, batch in [("a", "ok", 800.0, 1), ("b", "ok", 1200.0, 4), ("c", "error", 0.0, 0)]:
        rows.append({"request_id": f"batch-1-{custom_id}", "created_at": hour, "replied_at": hour,
                     "api_key_id": "key-batch", "model": "sd15-txt2img", "model_version": "1", "endpoint": "batch",
                     "priority": "batch", "status": status, "http_status": 200 if status == "ok" else 500,
                     "num_images": 1, "inference_ms": ms, "batch_size": batch, "batch_job_id": "batch-1",
                     "custom_id": custom_id})  # fmt: skip
    rows.append(dict(rows[0]))
    assert client.insert_rows_json(f"{settings.project_id}.{views.dataset}.{settings.log_table}", rows) == []
    (got,) = [r for r in views("gpu_seconds_by_batch", "batch_job_id") if r["batch_job_id"] == "batch-1"]
    assert (got["lines"], got["succeeded"], got["not_succeeded"], got["images"]) == (3, 2, 1, 2)
    assert got["gpu_seconds"] == pytest.approx(0.8 + 1.2 / 4)
    assert (got["api_key_id"], got["model"]) == ("key-batch", "sd15-txt2img")


def test_zz_usage_by_task_counts_each_request_once_with_inpaintings_mean_repainted_share(views, settings):
    client = google_clients.bigquery_client(dataclasses.replace(settings, dataset=views.dataset))
    day = datetime(2026, 11, 23, 8, 0, tzinfo=UTC)
    common = {"created_at": day.isoformat(), "api_key_id": "key-task", "model_version": "1", "endpoint": "sync",
              "http_status": 200, "num_images": 1}  # fmt: skip
    rows = [
        {**common, "request_id": "task-t1", "model": "sd15-txt2img", "task": "text-to-image", "status": "ok",
         "gpu_seconds": 0.5},
        {**common, "request_id": "task-i1", "model": "sd15-inpaint", "task": "inpaint", "status": "ok",
         "gpu_seconds": 0.25, "mask_fraction": 0.2},
        {**common, "request_id": "task-i2", "model": "sd15-inpaint", "task": "inpaint", "status": "ok",
         "gpu_seconds": 0.75, "mask_fraction": 0.6, "num_images": 2},
        {**common, "request_id": "task-i3", "model": "sd15-inpaint", "task": "inpaint", "status": "error",
         "http_status": 422, "mask_fraction": 1.0},
        # A flow ending in an edit: its own row counts (its task the flow's), its stage rows do not.
        {**common, "request_id": "task-f1", "model": "flux-draft-edit", "task": "text-to-image", "status": "ok",
         "flow": "flux-draft-edit", "gpu_seconds": 1.0},
        {**common, "request_id": "task-f1:edit", "model": "flux-kontext", "task": "edit", "status": "ok",
         "flow": "flux-draft-edit", "stage": "edit", "stage_index": 1, "flow_request_id": "task-f1",
         "endpoint": "stage", "gpu_seconds": 0.6},
    ]  # fmt: skip
    rows.append(dict(rows[1]))  # a retried write: counted once
    assert client.insert_rows_json(f"{settings.project_id}.{views.dataset}.{settings.log_table}", rows) == []
    got = {r["task"]: r for r in views("usage_by_task_daily", "day, task") if r["day"] == day.date()}
    assert set(got) == {"text-to-image", "inpaint"}  # the edit stage's row is the flow's, not a request of its own
    inpaint, text = got["inpaint"], got["text-to-image"]
    assert (inpaint["requests"], inpaint["succeeded"], inpaint["images"]) == (3, 2, 3)
    assert inpaint["gpu_seconds"] == pytest.approx(1.0) and inpaint["mean_mask_fraction"] == pytest.approx(0.6)
    assert (text["requests"], text["images"]) == (2, 2) and text["gpu_seconds"] == pytest.approx(1.5)
