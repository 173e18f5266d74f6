-- Requests per day and task (text-to-image, image-to-image, inpaint, edit): how many, answered, images and GPU
-- seconds, and for inpaint requests the mean share of their images' pixels the masks repaint (mask_fraction; outpainting:
-- the new border's share). A flow is counted by its own row (its task is its first stage's), never by its stages' rows;
-- a request refused before it reached a catalog model has no task and is left out.
SELECT
  DATE(created_at) AS day,
  task,
  COUNT(*) AS requests,
  COUNTIF(status = 'ok') AS succeeded,
  SUM(IF(status = 'ok', num_images, 0)) AS images,
  SUM(gpu_seconds) AS gpu_seconds,
  AVG(mask_fraction) AS mean_mask_fraction
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE task IS NOT NULL AND stage IS NULL
GROUP BY day, task
