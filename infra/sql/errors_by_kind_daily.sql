-- Outcomes per day and model (ok, or the error kind), with each outcome's share of the model's requests.
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
  day,
  model,
  outcome,
  requests,
  requests / SUM(requests) OVER (PARTITION BY day, model) AS share
FROM (
  SELECT
    DATE(created_at) AS day,
    model,
    IF(status = 'ok', 'ok', COALESCE(error_kind, status)) AS outcome,
    COUNT(*) AS requests
  FROM log
  GROUP BY day, model, outcome
)
