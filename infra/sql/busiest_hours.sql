-- Hours of the day (UTC) by traffic, per model: when capacity is needed.
SELECT
  EXTRACT(HOUR FROM created_at) AS hour_of_day,
  model,
  COUNT(*) AS requests,
  SUM(IF(status = 'ok', num_images, 0)) AS images,
  COUNT(DISTINCT DATE(created_at)) AS days,
  COUNT(*) / COUNT(DISTINCT DATE(created_at)) AS requests_per_day
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE model_version IS NOT NULL  -- refused before routing (unknown model, bad key): no model's usage
GROUP BY hour_of_day, model
