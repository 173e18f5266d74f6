-- Hours of the day (UTC) by traffic, per model: when capacity is needed.
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
  EXTRACT(HOUR FROM created_at) AS hour_of_day,
  model,
  COUNT(*) AS requests,
  SUM(IF(status = 'ok', num_images, 0)) AS images,
  COUNT(DISTINCT DATE(created_at)) AS days,
  COUNT(*) / COUNT(DISTINCT DATE(created_at)) AS requests_per_day
FROM log
GROUP BY hour_of_day, model
