-- Usage per API key per day: the billing view. GPU seconds are the request's share of its pipeline call
-- (its images over the batch's images); cache hits, coalesced requests and idempotent replays used no GPU.
-- Shadow calls (endpoint = shadow) are the service's own experiment, not the caller's: left out. A flow is
-- billed by its own row (model = the flow, gpu_seconds = the sum over its stages); its stages' rows are not.
SELECT
  DATE(created_at) AS day,
  api_key_id,
  model,
  COUNT(*) AS requests,
  COUNTIF(status = 'ok') AS succeeded,
  SUM(IF(status = 'ok', num_images, 0)) AS images,
  COUNTIF(cache_hit) AS cache_hits,
  -- LoRA adapters (name@version:scale list): billed as their own line when a price per adapter image applies.
  SUM(IF(status = 'ok' AND adapters IS NOT NULL, num_images, 0)) AS adapter_images,
  SUM(
    IF(
      status = 'ok' AND NOT IFNULL(cache_hit, FALSE) AND NOT IFNULL(coalesced, FALSE)
      AND NOT IFNULL(idempotent_replay, FALSE),
      IFNULL(gpu_seconds, IF(batch_size > 0, inference_ms / 1000 * num_images / batch_size, 0)),
      0
    )
  ) AS gpu_seconds
FROM `${project_id}.${dataset}.inference_log_unique`
WHERE model_version IS NOT NULL  -- refused before routing (unknown model, bad key): no model's usage
  AND IFNULL(endpoint, '') != 'shadow'  -- a shadow version's copy of a request is never billed
  AND stage IS NULL  -- a flow's stage: billed through the flow's own row
GROUP BY day, api_key_id, model
