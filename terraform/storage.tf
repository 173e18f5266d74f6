# Cloud Storage: model weights (read by workers) and request/response payloads too large for a
# Pub/Sub message (written by both the API and the workers, short-lived), and batch jobs' files (kept for their
# window and download period).

resource "google_storage_bucket" "models" {
  #checkov:skip=CKV_GCP_62:Access to weights is audited through Cloud Audit Logs; a second access-log bucket adds cost without information.
  name     = local.model_bucket_name
  location = var.region
  labels   = local.labels

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # Weights are published under <model>/<version>/; versioning protects them from an accidental
  # overwrite or delete while workers are loading them.
  versioning {
    enabled = true
  }

  force_destroy = false

  depends_on = [google_project_service.enabled]
}

resource "google_storage_bucket" "payloads" {
  #checkov:skip=CKV_GCP_62:Payloads live for a day, batch files two weeks; Cloud Audit Logs cover access, a separate access-log bucket adds cost without information.
  #checkov:skip=CKV_GCP_78:Payloads are transient request inputs and results, written once and deleted by the lifecycle rule; old versions would only keep them longer than promised.
  name     = local.payload_bucket_name
  location = var.region
  labels   = local.labels

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # One request's payloads (inputs/, results/, flows/) only need to outlive the request and the result cache;
  # deleting them bounds both storage cost and how long user images are kept.
  lifecycle_rule {
    condition {
      age            = var.payload_retention_days
      matches_prefix = ["inputs/", "results/", "flows/"]
    }
    action {
      type = "Delete"
    }
  }

  # A batch's input, results and errors parts, images and batch.json mirror (batches/{id}/) outlive its longest
  # window (7 days) plus the download period after it ends (7 days): the mirror is rewritten at every change, the
  # end included, so its age counts from the batch's end. The batches-active/ markers have no rule: the API
  # deletes each when its batch ends, and a running batch's marker never expires.
  lifecycle_rule {
    condition {
      age            = var.batch_retention_days
      matches_prefix = ["batches/"]
    }
    action {
      type = "Delete"
    }
  }

  # Destroying the system must not be blocked by leftover transient payloads.
  force_destroy = true

  depends_on = [google_project_service.enabled]
}
