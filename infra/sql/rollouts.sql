-- Every change of a model's traffic split, newest first: who (an admin key id, or rollback-guard), when,
-- from which split to which, and why (an automatic rollback names the breach it measured).
SELECT
  at,
  model,
  action,
  actor,
  JSON_QUERY(from_split, '$.traffic') AS from_traffic,
  JSON_QUERY(to_split, '$.traffic') AS to_traffic,
  JSON_QUERY(to_split, '$.shadow') AS to_shadow,
  reason,
  api_instance
FROM `${project_id}.${dataset}.rollout_audit`
