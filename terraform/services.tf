# The Google Cloud APIs the system uses, enabled before anything is created in them.
locals {
  project_services = toset([
    "artifactregistry.googleapis.com",
    "bigquery.googleapis.com",
    "cloudbuild.googleapis.com",
    "cloudresourcemanager.googleapis.com",
    "compute.googleapis.com",
    "container.googleapis.com",
    "iam.googleapis.com",
    "logging.googleapis.com",
    "monitoring.googleapis.com",
    "pubsub.googleapis.com",
    "redis.googleapis.com",
    "run.googleapis.com",
    "secretmanager.googleapis.com",
    "storage.googleapis.com",
  ])
}

resource "google_project_service" "enabled" {
  for_each = local.project_services

  project = var.project_id
  service = each.key

  # Other workloads in the project may depend on these APIs; destroying this configuration must
  # not switch them off.
  disable_on_destroy = false
}

data "google_project" "this" {
  project_id = var.project_id
}
