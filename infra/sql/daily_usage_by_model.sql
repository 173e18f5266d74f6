-- Requests per day and model, by outcome: the usage figure billing and capacity planning start from. Mean
-- end-to-end time apart for sync requests (to the response) and jobs (to the result being available).
SELECT
  DATE(created_at) AS day,
  model,
  COUNT(*) AS requests,
  COUNTIF(status = 'ok') AS succeeded,
  COUNTIF(status != 'ok') AS failed,
  COUNTIF(cache_hit) AS cache_hits,
  SUM(IF(status = 'ok', num_images, 0)) AS images,
  AVG(IF(status = 'ok' AND endpoint = 'sync', total_ms, NULL)) AS avg_sync_total_ms,
  AVG(IF(status = 'ok' AND endpoint = 'job', total_ms, NULL)) AS avg_job_total_ms,
  AVG(IF(status = 'ok', inference_ms, NULL)) AS avg_inference_ms
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE model_version IS NOT NULL  -- refused before routing (unknown model, bad key): no model's usage
GROUP BY day, model
