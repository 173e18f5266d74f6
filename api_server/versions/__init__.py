"""Model versions at run time: the traffic split in force, rollouts and the rollback guard, and shadow
copies of requests sent to a shadow version."""
