-- How many requests the cache, in-flight coalescing and idempotent replays answered without a GPU.
-- One row per request id: a retried write can land twice, a view never counts it twice.
WITH log AS (
  SELECT * EXCEPT (copy)
  FROM (
    SELECT *, ROW_NUMBER() OVER (PARTITION BY request_id ORDER BY created_at) AS copy
    FROM `${project_id}.${dataset}.inference_log`
  )
  WHERE copy = 1
)
SELECT
  DATE(created_at) AS day,
  model,
  COUNT(*) AS requests,
  COUNTIF(cache_hit) AS cache_hits,
  COUNTIF(coalesced) AS coalesced,
  COUNTIF(idempotent_replay) AS idempotent_replays,
  SAFE_DIVIDE(COUNTIF(cache_hit), COUNT(*)) AS cache_hit_rate,
  SAFE_DIVIDE(COUNTIF(coalesced), COUNT(*)) AS coalescing_rate
FROM log
GROUP BY day, model
