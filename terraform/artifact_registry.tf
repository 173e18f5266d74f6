# Artifact Registry: one Docker repository for the API and model worker images.
resource "google_artifact_registry_repository" "maas" {
  #checkov:skip=CKV_GCP_84:Google-managed encryption; the images contain code only, no weights or data.
  repository_id = local.artifact_repository
  location      = var.region
  format        = "DOCKER"
  description   = "Model-as-a-Service API and model worker images."
  labels        = local.labels

  depends_on = [google_project_service.enabled]
}
