-- The inference log with one row per request id: a retried write can land twice, no analytics view counts it
-- twice. Every view in infra/sql reads this one; it is created before them.
SELECT * EXCEPT (copy)
FROM (
  SELECT *, ROW_NUMBER() OVER (PARTITION BY request_id ORDER BY created_at) AS copy
  FROM `${project_id}.${dataset}.inference_log`
)
WHERE copy = 1
