-- Requests and images per hour and model: traffic shape for capacity planning.
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
  TIMESTAMP_TRUNC(created_at, HOUR) AS hour,
  model,
  COUNT(*) AS requests,
  COUNTIF(status = 'ok') AS succeeded,
  COUNTIF(status != 'ok') AS failed,
  SUM(IF(status = 'ok', num_images, 0)) AS images
FROM log
GROUP BY hour, model
