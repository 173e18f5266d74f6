# Secret Manager: the secrets the API reads at start-up. Only the secrets are declared here; their
# values (versions) are added out of band so they never appear in Terraform state.
locals {
  secret_ids = {
    api_key_sha256         = "maas-api-key-sha256"
    webhook_signing_secret = "maas-webhook-signing-secret"
  }
}

resource "google_secret_manager_secret" "maas" {
  for_each = local.secret_ids

  secret_id = each.value
  labels    = local.labels

  replication {
    auto {}
  }

  depends_on = [google_project_service.enabled]
}
