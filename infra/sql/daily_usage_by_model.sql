-- Requests per day and model, by outcome: the usage figure billing and capacity planning start from.
SELECT
  DATE(created_at) AS day,
  model,
  COUNT(*) AS requests,
  COUNTIF(status = 'ok') AS succeeded,
  COUNTIF(status != 'ok') AS failed,
  COUNTIF(cache_hit) AS cache_hits,
  SUM(IF(status = 'ok', num_images, 0)) AS images,
  AVG(IF(status = 'ok', total_ms, NULL)) AS avg_total_ms,
  AVG(IF(status = 'ok', inference_ms, NULL)) AS avg_inference_ms
FROM `${project_id}.${dataset}.inference_log_unique`
GROUP BY day, model
