-- Outcomes per day and model (ok, or the error kind), with each outcome's share of the model's requests.
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
  FROM `${project_id}.${dataset}.inference_log_unique`
  GROUP BY day, model, outcome
)
