# Cloud Run: the HTTP API. It reaches Redis over direct VPC egress and everything else through
# Google APIs, as its own service account.

resource "google_cloud_run_v2_service" "api" {
  name     = local.api_service_name
  location = var.region
  labels   = local.labels
  ingress  = "INGRESS_TRAFFIC_ALL"

  deletion_protection = var.deletion_protection

  template {
    service_account = google_service_account.api.email
    labels          = local.labels

    # An instance spends most of a request waiting for the worker's reply, not on CPU, so one
    # instance serves many requests at once.
    max_instance_request_concurrency = var.api_max_concurrency
    timeout                          = "${var.api_request_timeout_seconds}s"

    scaling {
      min_instance_count = var.api_min_instances
      max_instance_count = var.api_max_instances
    }

    # Only private ranges (Memorystore) go through the VPC; Google APIs and webhooks do not.
    vpc_access {
      egress = "PRIVATE_RANGES_ONLY"
      network_interfaces {
        network    = google_compute_network.maas.id
        subnetwork = google_compute_subnetwork.cloud_run.id
      }
    }

    containers {
      image = var.api_image

      # Cloud Run passes this port to the container as $PORT.
      ports {
        container_port = 8080
      }

      resources {
        limits = {
          cpu    = var.api_cpu
          memory = var.api_memory
        }
        # Reply subscriptions stream in the background between requests, and the batch runner (issue 35: the
        # feeder reading batch files and publishing their lines, and the collector writing their results) runs
        # in every instance between requests too, one instance per batch under a Redis lease: CPU is always
        # allocated, and min_instance_count keeps one instance to feed running batches with no traffic.
        cpu_idle = false
      }

      # /readyz answers once the process has its clients and Redis answers; /healthz while it runs.
      startup_probe {
        http_get {
          path = "/readyz"
        }
        period_seconds    = 2
        failure_threshold = 30
      }
      liveness_probe {
        http_get {
          path = "/healthz"
        }
        period_seconds = 15
      }

      env {
        name  = "MAAS_ENV"
        value = "production"
      }
      env {
        name  = "MAAS_PROJECT_ID"
        value = var.project_id
      }
      env {
        name  = "MAAS_REDIS_URL"
        value = "redis://${google_redis_instance.cache.host}:${google_redis_instance.cache.port}"
      }
      env {
        name  = "MAAS_REPLY_MODE"
        value = var.api_reply_mode
      }
      env {
        name  = "MAAS_BATCH_MAX_IN_FLIGHT"
        value = tostring(var.batch_max_in_flight)
      }
      env {
        name  = "MAAS_BATCH_WORKER_MAX_REPLICAS"
        value = var.batch_worker_max_replicas == null ? "" : tostring(var.batch_worker_max_replicas)
      }
      env {
        name  = "MAAS_BATCH_INPUTS"
        value = join(",", flatten([for who, locations in var.batch_inputs : [for location in locations : "${who}=${location}"]]))
      }
      env {
        name = "MAAS_API_KEY_SHA256"
        value_source {
          secret_key_ref {
            secret  = google_secret_manager_secret.maas["api_key_sha256"].secret_id
            version = "latest"
          }
        }
      }
      env {
        name = "MAAS_WEBHOOK_SIGNING_SECRET"
        value_source {
          secret_key_ref {
            secret  = google_secret_manager_secret.maas["webhook_signing_secret"].secret_id
            version = "latest"
          }
        }
      }
    }
  }

  lifecycle {
    precondition {
      condition     = var.api_request_timeout_seconds >= local.max_model_request_timeout_seconds
      error_message = "api_request_timeout_seconds must be at least the largest catalog request_timeout_seconds (${local.max_model_request_timeout_seconds})."
    }
  }

  # The revision fails to start if it cannot read its secrets.
  depends_on = [google_secret_manager_secret_iam_member.api_reads_secrets]
}

# Callers authenticate with API keys checked by the API itself, so the service is public to HTTP.
resource "google_cloud_run_v2_service_iam_member" "public_invoker" {
  for_each = var.api_allow_unauthenticated ? toset(["allUsers"]) : toset([])

  name     = google_cloud_run_v2_service.api.name
  location = google_cloud_run_v2_service.api.location
  role     = "roles/run.invoker"
  member   = each.key
}
