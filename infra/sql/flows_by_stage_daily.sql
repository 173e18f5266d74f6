-- Flows per day and stage: each stage's share of its flow's latency and GPU-seconds. A stage's row (stage set)
-- is linked to its flow's own row by flow_request_id; its latency is its queue wait plus its pipeline time,
-- the flow's is its request's total (end to end), so the shares of a flow's stages leave the rest to the API.
SELECT
  DATE(f.created_at) AS day,
  f.flow,
  s.stage_index,
  s.stage,
  s.model,
  COUNT(*) AS runs,
  COUNTIF(s.status != 'ok') AS failed,
  AVG(s.total_ms) AS mean_stage_ms,
  SAFE_DIVIDE(SUM(s.total_ms), SUM(f.total_ms)) AS latency_share,
  SUM(s.gpu_seconds) AS gpu_seconds,
  SAFE_DIVIDE(SUM(s.gpu_seconds), SUM(f.gpu_seconds)) AS gpu_share
FROM `${project_id}.${dataset}.inference_log_unique` AS s
JOIN `${project_id}.${dataset}.inference_log_unique` AS f ON f.request_id = s.flow_request_id
WHERE s.stage IS NOT NULL
GROUP BY day, f.flow, s.stage_index, s.stage, s.model
