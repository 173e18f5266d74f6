-- Model versions side by side, per hour: the calls each version ran (cache hits, coalesced requests, replays
-- and refusals left out: they say nothing about a version), their error rate, p50/p95 total and inference
-- latency, images per pipeline call and GPU-seconds. `traffic` is `served` (the caller's answer) or `shadow`
-- (a copy sent to the shadow version: join its rows on shadow_of = request_id for the same inputs).
-- A request a canary failed and the stable version then answered (fallback_from) is two calls: the stable
-- version's (the row) and the canary's failed one, counted here as an error of fallback_from.
WITH calls AS (
  SELECT created_at, model, model_version, endpoint, status, total_ms, inference_ms, batch_size, num_images,
    cache_hit, coalesced, idempotent_replay
  FROM `${project_id}.${dataset}.inference_log_unique`
  UNION ALL
  SELECT created_at, model, fallback_from, endpoint, 'error', CAST(NULL AS FLOAT64), CAST(NULL AS FLOAT64),
    CAST(NULL AS INT64), num_images, FALSE, FALSE, FALSE
  FROM `${project_id}.${dataset}.inference_log_unique`
  WHERE fallback_from IS NOT NULL
)
SELECT
  TIMESTAMP_TRUNC(created_at, HOUR) AS hour,
  model,
  model_version,
  IF(endpoint = 'shadow', 'shadow', 'served') AS traffic,
  COUNT(*) AS requests,
  ROUND(COUNTIF(status != 'ok') / COUNT(*), 4) AS error_rate,
  APPROX_QUANTILES(IF(status = 'ok', total_ms, NULL), 100)[OFFSET(50)] AS p50_total_ms,
  APPROX_QUANTILES(IF(status = 'ok', total_ms, NULL), 100)[OFFSET(95)] AS p95_total_ms,
  APPROX_QUANTILES(IF(status = 'ok', inference_ms, NULL), 100)[OFFSET(50)] AS p50_inference_ms,
  APPROX_QUANTILES(IF(status = 'ok', inference_ms, NULL), 100)[OFFSET(95)] AS p95_inference_ms,
  ROUND(AVG(IF(status = 'ok', batch_size, NULL)), 2) AS images_per_call,
  SUM(IF(status = 'ok' AND batch_size > 0, inference_ms / 1000 * num_images / batch_size, 0)) AS gpu_seconds
FROM calls
WHERE model_version IS NOT NULL
  AND status IN ('ok', 'error', 'timeout', 'expired', 'unavailable')
  AND NOT IFNULL(cache_hit, FALSE) AND NOT IFNULL(coalesced, FALSE) AND NOT IFNULL(idempotent_replay, FALSE)
GROUP BY hour, model, model_version, traffic
