-- How many requests the cache, in-flight coalescing and idempotent replays answered without a GPU.
SELECT
  DATE(created_at) AS day,
  model,
  COUNT(*) AS requests,
  COUNTIF(cache_hit) AS cache_hits,
  COUNTIF(coalesced) AS coalesced,
  COUNTIF(idempotent_replay) AS idempotent_replays,
  SAFE_DIVIDE(COUNTIF(cache_hit), COUNT(*)) AS cache_hit_rate,
  SAFE_DIVIDE(COUNTIF(coalesced), COUNT(*)) AS coalescing_rate
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE model_version IS NOT NULL  -- refused before routing (unknown model, bad key): no model's usage
GROUP BY day, model
