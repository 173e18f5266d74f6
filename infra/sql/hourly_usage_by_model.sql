-- Requests and images per hour and model: traffic shape for capacity planning.
SELECT
  TIMESTAMP_TRUNC(created_at, HOUR) AS hour,
  model,
  COUNT(*) AS requests,
  COUNTIF(status = 'ok') AS succeeded,
  COUNTIF(status != 'ok') AS failed,
  SUM(IF(status = 'ok', num_images, 0)) AS images
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE model_version IS NOT NULL  -- refused before routing (unknown model, bad key): no model's usage
GROUP BY hour, model
