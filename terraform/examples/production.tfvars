# A production deployment: terraform apply -var-file=examples/production.tfvars
project_id = "acme-maas-prod"
region     = "us-central1"
gke_zones  = ["us-central1-a", "us-central1-c"]

api_image = "us-central1-docker.pkg.dev/acme-maas-prod/maas/api:3f9c2a1"

# Peak load: 1.4 million inferences a day, 150+ L4 GPUs.
api_min_instances   = 2
api_max_instances   = 200
api_max_concurrency = 80
api_reply_mode      = "per-instance"

gpu_node_pools = {
  l4-shared = {
    hardware                   = "l4"
    min_node_count             = 2
    max_node_count             = 40
    max_shared_clients_per_gpu = 2
  }
  l4 = {
    hardware       = "l4"
    min_node_count = 4
    max_node_count = 160
  }
  a100 = {
    hardware       = "a100"
    min_node_count = 0
    max_node_count = 8
  }
  # Qwen-Image in bf16 (53.7 GiB of weights: the memory plan fits no L4 or 40 GB A100), from zero nodes.
  h100 = {
    hardware       = "h100"
    min_node_count = 0
    max_node_count = 4
  }
  # Batch jobs only (a Spot pool is tainted for the `model-batch-*` workers), from zero nodes.
  l4-spot = {
    hardware       = "l4"
    min_node_count = 0
    max_node_count = 80
    spot           = true
  }
  a100-spot = {
    hardware       = "a100"
    min_node_count = 0
    max_node_count = 4
    spot           = true
  }
  h100-spot = {
    hardware       = "h100"
    min_node_count = 0
    max_node_count = 2
    spot           = true
  }
}

redis_tier           = "STANDARD_HA"
redis_memory_size_gb = 10

payload_retention_days       = 1
batch_retention_days         = 14
inference_log_retention_days = 400

gke_authorized_networks = {
  ci     = "203.0.113.0/28"
  office = "198.51.100.0/24"
}

alert_notification_channels = [
  "projects/acme-maas-prod/notificationChannels/1234567890123456789",
]

labels = {
  environment = "production"
  team        = "ml-platform"
}
