# Memorystore for Redis: the API's result cache and rate-limit counters, and the workers' short-lived
# copy of each result (so a missed reply or a redelivered request is answered without the GPU).

resource "google_redis_instance" "cache" {
  #checkov:skip=CKV_GCP_95:Reachable only on a private IP from the maas VPC (authorized_network); AUTH would put a shared password in every API and worker environment for no extra isolation.
  #checkov:skip=CKV_GCP_97:In-transit encryption needs the instance CA distributed to every API instance and worker pod; traffic stays on the private VPC peering.
  name           = "maas-cache"
  display_name   = "Model-as-a-Service cache"
  region         = var.region
  tier           = var.redis_tier
  memory_size_gb = var.redis_memory_size_gb
  redis_version  = var.redis_version
  labels         = local.labels

  authorized_network = google_compute_network.maas.id
  connect_mode       = "DIRECT_PEERING"

  # Everything stored here can be recomputed or re-fetched: when memory runs out, evict the least
  # recently used key rather than refusing writes.
  redis_configs = {
    maxmemory-policy = "allkeys-lru"
  }

  depends_on = [google_project_service.enabled]
}
