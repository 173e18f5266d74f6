# --- Project ------------------------------------------------------------------------------------

variable "project_id" {
  description = "Google Cloud project that hosts the whole system."
  type        = string
}

variable "region" {
  description = "Region for Cloud Run, GKE, Memorystore, the buckets and Artifact Registry."
  type        = string
  default     = "us-central1"
}

variable "gke_zones" {
  description = "Zones of var.region where GKE nodes run; each must offer both L4 and A100 GPUs (or only the GPUs of the pools you keep)."
  type        = list(string)
  default     = ["us-central1-a", "us-central1-c"]
}

variable "labels" {
  description = "Extra labels added to every labelled resource."
  type        = map(string)
  default     = {}
}

variable "deletion_protection" {
  description = "Protect the GKE cluster, the Cloud Run service and the inference log table from `terraform destroy`."
  type        = bool
  default     = true
}

# --- Network ------------------------------------------------------------------------------------

variable "network_name" {
  description = "Name of the VPC created for the system, and prefix of its subnets, router and NAT."
  type        = string
  default     = "maas"
}

variable "gke_nodes_cidr" {
  description = "Primary range of the GKE subnet (node IPs)."
  type        = string
  default     = "10.10.0.0/20"
}

variable "gke_pods_cidr" {
  description = "Secondary range of the GKE subnet for pod IPs."
  type        = string
  default     = "10.20.0.0/14"
}

variable "gke_services_cidr" {
  description = "Secondary range of the GKE subnet for Service IPs."
  type        = string
  default     = "10.24.0.0/20"
}

variable "gke_control_plane_cidr" {
  description = "/28 range for the private GKE control plane; must not overlap any other range in the VPC."
  type        = string
  default     = "172.16.0.0/28"
}

variable "cloud_run_egress_cidr" {
  description = "Subnet the API's Cloud Run instances take IPs from for direct VPC egress (to Redis). Size it for about twice api_max_instances."
  type        = string
  default     = "10.10.16.0/24"
}

variable "gke_authorized_networks" {
  description = "CIDR blocks allowed to reach the GKE control plane (kubectl, CI), keyed by a display name. Empty allows none but Google-internal access."
  type        = map(string)
  default     = {}
}

# --- GKE ----------------------------------------------------------------------------------------

variable "cluster_name" {
  description = "Name of the GKE cluster that runs the model workers."
  type        = string
  default     = "maas"
}

variable "gke_release_channel" {
  description = "GKE release channel: RAPID, REGULAR or STABLE."
  type        = string
  default     = "REGULAR"

  validation {
    condition     = contains(["RAPID", "REGULAR", "STABLE"], var.gke_release_channel)
    error_message = "gke_release_channel must be RAPID, REGULAR or STABLE."
  }
}

variable "gpu_node_pools" {
  description = <<-EOT
    GPU node pools keyed by pool name. `hardware` is a catalog hardware class (l4, a100, a100-80 or h100).
    `max_shared_clients_per_gpu` above 1 turns on GPU time-sharing with that many pods per GPU
    (for catalog models with gpu_sharing: true); 1 gives every pod a whole GPU. Node counts are
    totals across var.gke_zones. `spot` uses Spot VMs (cheaper, preemptible): such a pool is tainted for
    the batch workers only (infra/k8s/render.py renders a `model-batch-*` Deployment per catalog deployment,
    scaled from zero on its batch backlog); keep its minimum at 0 so it costs nothing without a batch.
  EOT
  type = map(object({
    hardware                   = string
    min_node_count             = number
    max_node_count             = number
    max_shared_clients_per_gpu = optional(number, 1)
    spot                       = optional(bool, false)
    disk_size_gb               = optional(number, 200)
  }))
  default = {
    l4-shared = {
      hardware                   = "l4"
      min_node_count             = 1
      max_node_count             = 20
      max_shared_clients_per_gpu = 2
    }
    l4 = {
      hardware       = "l4"
      min_node_count = 1
      max_node_count = 150
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
    # Batch jobs (issue 35) on Spot capacity, from zero nodes.
    l4-spot = {
      hardware       = "l4"
      min_node_count = 0
      max_node_count = 40
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

  validation {
    condition = alltrue([
      for pool in values(var.gpu_node_pools) :
      pool.min_node_count >= 0 && pool.max_node_count >= pool.min_node_count && pool.max_shared_clients_per_gpu >= 1 && pool.max_shared_clients_per_gpu <= 48
    ])
    error_message = "Each GPU pool needs 0 <= min_node_count <= max_node_count and 1 <= max_shared_clients_per_gpu <= 48."
  }
}

variable "keda_operator_service_account" {
  description = "Kubernetes service account of the KEDA operator, as NAMESPACE/NAME; it scales the workers on Pub/Sub backlog."
  type        = string
  default     = "keda/keda-operator"
}

# --- API (Cloud Run) ----------------------------------------------------------------------------

variable "api_image" {
  description = "API container image, e.g. REGION-docker.pkg.dev/PROJECT/maas/api:TAG (see the artifact_registry_url output)."
  type        = string
}

variable "api_min_instances" {
  description = "Cloud Run instances kept warm, so the first requests do not wait for a cold start."
  type        = number
  default     = 1
}

variable "api_max_instances" {
  description = "Upper bound on Cloud Run instances."
  type        = number
  default     = 100
}

variable "api_max_concurrency" {
  description = "Requests one API instance serves at once; most of a request is waiting for the worker's reply."
  type        = number
  default     = 80
}

variable "api_cpu" {
  description = "CPU limit of one API instance (Cloud Run syntax, e.g. \"2\")."
  type        = string
  default     = "2"
}

variable "api_memory" {
  description = "Memory limit of one API instance (Cloud Run syntax, e.g. \"2Gi\")."
  type        = string
  default     = "2Gi"
}

variable "api_request_timeout_seconds" {
  description = "Cloud Run request timeout; must be at least the largest catalog request_timeout_seconds."
  type        = number
  default     = 120
}

variable "api_reply_mode" {
  description = "How the API waits for replies (MAAS_REPLY_MODE): per-request (a subscription per request) or per-instance (one subscription per API instance)."
  type        = string
  default     = "per-request"

  validation {
    condition     = contains(["per-request", "per-instance"], var.api_reply_mode)
    error_message = "api_reply_mode must be per-request or per-instance."
  }
}

variable "api_allow_unauthenticated" {
  description = "Let anyone reach the API over HTTP (it checks its own API keys). Set false to require Cloud Run IAM as well."
  type        = bool
  default     = true
}

# --- Redis --------------------------------------------------------------------------------------

variable "redis_tier" {
  description = "Memorystore tier: BASIC (single node) or STANDARD_HA (replicated, automatic failover)."
  type        = string
  default     = "STANDARD_HA"

  validation {
    condition     = contains(["BASIC", "STANDARD_HA"], var.redis_tier)
    error_message = "redis_tier must be BASIC or STANDARD_HA."
  }
}

variable "redis_memory_size_gb" {
  description = "Memorystore capacity in GiB (result cache, rate limits, short-lived results)."
  type        = number
  default     = 5
}

variable "redis_version" {
  description = "Memorystore Redis version."
  type        = string
  default     = "REDIS_7_2"
}

# --- Data ---------------------------------------------------------------------------------------

variable "bigquery_location" {
  description = "Location of the BigQuery dataset."
  type        = string
  default     = "US"
}

variable "inference_log_retention_days" {
  description = "Days a partition of the inference log is kept; null keeps them forever."
  type        = number
  default     = null
}

variable "payload_retention_days" {
  description = "Days after which one request's objects in the payload bucket (inputs/, results/, flows/) are deleted. Batch jobs' files follow batch_retention_days; the running-batch markers (batches-active/) never expire."
  type        = number
  default     = 1

  validation {
    condition     = var.payload_retention_days >= 1
    error_message = "payload_retention_days must be at least 1."
  }
}

variable "batch_retention_days" {
  description = "Days after which a batch job's objects in the payload bucket (batches/{id}/: its input, results and errors parts, images and batch.json) are deleted: at least the longest completion_window (7 days) plus the download period after the batch ends (7 days, as long as GET /v1/batches lists it), so nothing of a running or listed batch is deleted."
  type        = number
  default     = 14

  validation {
    condition     = var.batch_retention_days >= 14
    error_message = "batch_retention_days must be at least 14: the longest batch window (7 days) plus the download period (7 days)."
  }
}

# --- Queues -------------------------------------------------------------------------------------

variable "request_retention_seconds" {
  description = "How long an unacknowledged request stays on a worker subscription (600 to 604800)."
  type        = number
  default     = 3600
}

variable "batch_request_retention_seconds" {
  description = "How long an unacknowledged batch line stays on a `-batch` worker subscription (600 to 604800): longer than a batch's completion window (24 h by default), since batch lines wait for idle capacity."
  type        = number
  default     = 172800

  validation {
    condition     = var.batch_request_retention_seconds >= 600 && var.batch_request_retention_seconds <= 604800
    error_message = "batch_request_retention_seconds must be between 600 and 604800."
  }
}

variable "batch_backlog_alert_seconds" {
  description = "Alert when a batch line has waited unacknowledged this long: past the default 24 h completion window, batch work is stuck (no idle or Spot capacity)."
  type        = number
  default     = 86400
}

variable "request_retry_minimum_backoff_seconds" {
  description = "Shortest wait before a nacked or expired request is redelivered."
  type        = number
  default     = 10
}

variable "request_retry_maximum_backoff_seconds" {
  description = "Longest wait before a repeatedly failing request is redelivered (at most 600)."
  type        = number
  default     = 60
}

variable "dead_letter_retention_seconds" {
  description = "How long dead-lettered requests are kept on their subscription for inspection (at most 2678400, 31 days)."
  type        = number
  default     = 604800
}

# --- Alerts -------------------------------------------------------------------------------------

variable "alert_notification_channels" {
  description = "Cloud Monitoring notification channel ids (projects/PROJECT/notificationChannels/ID) every alert notifies."
  type        = list(string)
  default     = []
}

variable "alert_duration_seconds" {
  description = "How long a condition must hold before an alert fires."
  type        = number
  default     = 300
}

variable "api_5xx_ratio_threshold" {
  description = "Share of API responses that may be 5xx before alerting (0.02 = 2%)."
  type        = number
  default     = 0.02
}

variable "api_p99_latency_threshold_ms" {
  description = "API p99 request latency, in milliseconds, above which to alert."
  type        = number
  default     = 30000
}

variable "batch_inputs" {
  description = "Where each API key may point a batch's input_file or input_table (MAAS_BATCH_INPUTS): key SHA-256 digest (or \"*\" for every key) -> gs://bucket/prefix or bq://project.dataset[.table_prefix] locations; {key_id} in a prefix is the key's id (its digest's first 12 characters). The API's service account must be granted read access to those buckets (and bigquery.tables.get, getData and createSnapshot on those datasets: a batch reads a snapshot taken at submit) by their owners. Never the service's own model or payload bucket nor its dataset (the API refuses to start). Empty: batches take their lines inline only. A refusal reads the same whether the object is missing or not the key's."
  type        = map(list(string))
  default     = {}

  validation {
    condition     = alltrue([for locations in values(var.batch_inputs) : alltrue([for location in locations : startswith(location, "gs://") || startswith(location, "bq://")])])
    error_message = "batch_inputs: every location is a gs://bucket/prefix or a bq://project.dataset[.table_prefix]."
  }
}

variable "batch_max_in_flight" {
  description = "Lines of one batch job in flight per model at most (MAAS_BATCH_MAX_IN_FLIGHT): the batch feeder in the API publishes no more until answers come back. 0: derived from the batch workers' capacity (max replicas x max_batch_size x 4, contract/batch_capacity.py)."
  type        = number
  default     = 0
}

variable "batch_worker_max_replicas" {
  description = "The most Spot batch workers per deployment, as infra/k8s/render.py was run (--batch-max-replicas); null: the catalog's replicas.max. The API sizes its derived in-flight bound with it (MAAS_BATCH_WORKER_MAX_REPLICAS)."
  type        = number
  default     = null
}
