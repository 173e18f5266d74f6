-- Every change of a model's traffic split: who (an admin key id, or rollback-guard), when, from which split
-- to which (JSON {traffic: {version: percent}, shadow}), and why (an automatic rollback names its breach).
SELECT
  at,
  model,
  action,
  actor,
  from_split,
  to_split,
  reason,
  api_instance
FROM `${project_id}.${dataset}.rollout_audit`
