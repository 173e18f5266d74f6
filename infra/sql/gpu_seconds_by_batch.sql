-- GPU time per batch job (POST /v1/batches): one row per batch and model, its lines' outcomes and the GPU seconds
-- its inferences took (each line's share of its pipeline call, as billing_by_api_key_daily counts it).
SELECT
  MIN(DATE(created_at)) AS day,
  api_key_id,
  batch_job_id,
  model,
  COUNT(*) AS lines,
  COUNTIF(status = 'ok') AS succeeded,
  COUNTIF(status != 'ok') AS not_succeeded,
  SUM(IF(status = 'ok', num_images, 0)) AS images,
  SUM(IF(status = 'ok' AND batch_size > 0, inference_ms / 1000 * num_images / batch_size, 0)) AS gpu_seconds,
  MIN(created_at) AS first_line_at,
  MAX(replied_at) AS last_line_at
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE batch_job_id IS NOT NULL
GROUP BY api_key_id, batch_job_id, model
