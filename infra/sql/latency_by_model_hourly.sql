-- Latency percentiles of successful requests per hour, model and endpoint (sync: to the response; job: to the
-- result being available): total time and time waiting in the queue.
SELECT
  TIMESTAMP_TRUNC(created_at, HOUR) AS hour,
  model,
  endpoint,
  COUNT(*) AS requests,
  APPROX_QUANTILES(total_ms, 100)[OFFSET(50)] AS p50_total_ms,
  APPROX_QUANTILES(total_ms, 100)[OFFSET(95)] AS p95_total_ms,
  APPROX_QUANTILES(total_ms, 100)[OFFSET(99)] AS p99_total_ms,
  APPROX_QUANTILES(queue_ms, 100)[OFFSET(50)] AS p50_queue_ms,
  APPROX_QUANTILES(queue_ms, 100)[OFFSET(95)] AS p95_queue_ms,
  APPROX_QUANTILES(queue_ms, 100)[OFFSET(99)] AS p99_queue_ms
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE status = 'ok'
GROUP BY hour, model, endpoint
