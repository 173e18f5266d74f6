-- Worker batching per hour and model: pipeline calls, images per call, and a device-utilisation proxy
-- (seconds of pipeline calls over the hour's seconds of the workers that ran them).
SELECT
  hour,
  model,
  COUNT(*) AS batches,
  SUM(images) AS images,
  AVG(images) AS mean_batch_images,
  SUM(seconds) AS busy_seconds,
  COUNT(DISTINCT worker_id) AS workers,
  SUM(seconds) / (3600 * COUNT(DISTINCT worker_id)) AS utilisation
FROM (
  SELECT
    batch_id,
    model,
    TIMESTAMP_TRUNC(MIN(worker_started_at), HOUR) AS hour,
    MAX(worker_id) AS worker_id,
    MAX(batch_size) AS images,
    MAX(inference_ms) / 1000 AS seconds
  FROM `${project_id}.${dataset}.inference_log_unique`
  WHERE batch_id IS NOT NULL AND NOT IFNULL(cache_hit, FALSE) AND NOT IFNULL(coalesced, FALSE)
    AND NOT IFNULL(idempotent_replay, FALSE)
  GROUP BY batch_id, model
)
GROUP BY hour, model
