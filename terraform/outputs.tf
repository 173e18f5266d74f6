output "api_url" {
  description = "HTTPS URL of the API."
  value       = google_cloud_run_v2_service.api.uri
}

output "api_service_account_email" {
  description = "Service account the API runs as."
  value       = google_service_account.api.email
}

output "cluster_name" {
  description = "GKE cluster running the model workers (gcloud container clusters get-credentials NAME --region REGION)."
  value       = google_container_cluster.workers.name
}

output "cluster_location" {
  description = "Region of the GKE cluster."
  value       = google_container_cluster.workers.location
}

output "request_topics" {
  description = "Request topic names per catalog model and priority ({model = {high = ..., normal = ...}})."
  value = {
    for model in keys(local.models) : model => {
      for priority in keys(local.priority_suffixes) : priority => google_pubsub_topic.requests["${model}/${priority}"].name
    }
  }
}

output "worker_subscriptions" {
  description = "Worker subscription names per catalog model and priority ({model = {high = ..., normal = ...}})."
  value = {
    for model in keys(local.models) : model => {
      for priority in keys(local.priority_suffixes) : priority => google_pubsub_subscription.workers["${model}/${priority}"].name
    }
  }
}

output "dead_letter_subscriptions" {
  description = "Dead-letter subscription name per catalog model; the workers answer what lands there with an error reply."
  value       = { for model, subscription in google_pubsub_subscription.dead_letter : model => subscription.name }
}

output "worker_deployments" {
  description = "Worker Deployment (catalog worker_group, or the model itself) and the models each serves, as infra/k8s/render.py renders them."
  value = {
    for group in distinct([for model in values(local.models) : model.worker_group]) : "model-worker-${group}" => sort([
      for name, model in local.models : name if model.worker_group == group
    ])
  }
}

output "model_weights_uris" {
  description = "Where each diffusers model's weights must be uploaded (the catalog's weights_path in the model bucket)."
  value = {
    for name, model in local.models : name => "gs://${google_storage_bucket.models.name}/${model.weights_path}" if model.runner == "diffusers"
  }
}

output "prometheus_query_url" {
  description = "PromQL endpoint of Cloud Monitoring (Managed Service for Prometheus) that KEDA's prometheus scaler queries."
  value       = "https://monitoring.googleapis.com/v1/projects/${var.project_id}/location/global/prometheus"
}

output "replies_topic" {
  description = "Topic every worker publishes replies to."
  value       = google_pubsub_topic.replies.name
}

output "model_bucket" {
  description = "Bucket holding model weights under <model>/<version>/."
  value       = google_storage_bucket.models.name
}

output "payload_bucket" {
  description = "Bucket for inputs and outputs too large for a Pub/Sub message."
  value       = google_storage_bucket.payloads.name
}

output "bigquery_dataset" {
  description = "Dataset holding the inference log and analytics views."
  value       = google_bigquery_dataset.maas.dataset_id
}

output "inference_log_table" {
  description = "Fully qualified inference log table (project.dataset.table)."
  value       = "${var.project_id}.${google_bigquery_dataset.maas.dataset_id}.${google_bigquery_table.inference_log.table_id}"
}

output "redis_url" {
  description = "Redis URL of the Memorystore instance, reachable from the VPC (MAAS_REDIS_URL for the workers)."
  value       = "redis://${google_redis_instance.cache.host}:${google_redis_instance.cache.port}"
}

output "worker_service_account_email" {
  description = "Google service account of the model workers; annotate the maas/model-worker Kubernetes service account with iam.gke.io/gcp-service-account=<this>."
  value       = google_service_account.worker.email
}

output "keda_service_account_email" {
  description = "Google service account of the KEDA operator; annotate its Kubernetes service account with iam.gke.io/gcp-service-account=<this>."
  value       = google_service_account.keda.email
}

output "artifact_registry_url" {
  description = "Docker repository prefix for the API and worker images."
  value       = "${google_artifact_registry_repository.maas.location}-docker.pkg.dev/${var.project_id}/${google_artifact_registry_repository.maas.repository_id}"
}
