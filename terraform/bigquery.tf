# BigQuery: one row per API request (hits, misses and errors) for SQL usage analytics, plus the
# analytics views kept as SQL files in infra/sql.

resource "google_bigquery_dataset" "maas" {
  #checkov:skip=CKV_GCP_81:Google-managed encryption; rows hold request metadata and a truncated API key hash, no prompts or images.
  dataset_id    = local.bigquery_dataset
  friendly_name = "Model-as-a-Service inference log"
  description   = "One row per inference request served by the API, and analytics views over them."
  location      = var.bigquery_location
  labels        = local.labels

  # Deleting the dataset must not silently drop the usage history that billing is built on.
  delete_contents_on_destroy = false

  depends_on = [google_project_service.enabled]
}

resource "google_bigquery_table" "inference_log" {
  #checkov:skip=CKV_GCP_80:Google-managed encryption; see the dataset.
  dataset_id  = google_bigquery_dataset.maas.dataset_id
  table_id    = local.inference_log_table
  description = "One row per API request: model, status, latency breakdown, cache hit."
  labels      = local.labels

  # The API writes rows with this exact schema; it is read from the contract, never copied.
  schema = file("${path.module}/../contract/inference_log_schema.json")

  # Analytics queries are bounded by time: partitioning on the request time keeps them cheap.
  time_partitioning {
    type          = "DAY"
    field         = "created_at"
    expiration_ms = var.inference_log_retention_days == null ? null : var.inference_log_retention_days * 86400000
  }

  # Most queries filter by model, and billing by API key (contract/log_schema.py CLUSTERING_FIELDS).
  clustering = ["model", "api_key_id"]

  deletion_protection = var.deletion_protection
}

# Who changed a model's traffic split and when, from what to what, and every automatic rollback.
resource "google_bigquery_table" "rollout_audit" {
  #checkov:skip=CKV_GCP_80:Google-managed encryption; see the dataset.
  dataset_id  = google_bigquery_dataset.maas.dataset_id
  table_id    = local.rollout_audit_table
  description = "One row per traffic split change: set, reset or automatic rollback, with its actor and reason."
  labels      = local.labels

  # The API writes rows with this exact schema; it is read from the contract, never copied.
  schema = file("${path.module}/../contract/rollout_audit_schema.json")

  time_partitioning {
    type  = "DAY"
    field = "at"
  }

  deletion_protection = var.deletion_protection
}

# Each infra/sql/base/<view>.sql becomes the view <view>, before the analytics views that read it.
resource "google_bigquery_table" "analytics_base_views" {
  #checkov:skip=CKV_GCP_80:A view stores no data of its own to encrypt.
  #checkov:skip=CKV_GCP_121:A view holds no data and is rebuilt from infra/sql; protection would only block removing a view whose SQL file was deleted.
  for_each = local.analytics_base_sql_files

  dataset_id = google_bigquery_dataset.maas.dataset_id
  table_id   = trimsuffix(each.key, ".sql")
  labels     = local.labels

  view {
    query = templatefile("${local.analytics_sql_dir}/base/${each.key}", {
      project_id = var.project_id
      dataset    = google_bigquery_dataset.maas.dataset_id
    })
    use_legacy_sql = false
  }

  deletion_protection = false

  depends_on = [google_bigquery_table.inference_log]
}

# Each infra/sql/<view>.sql becomes the view <view>. The SQL refers to the log table as
# `${project_id}.${dataset}.inference_log`; see README.md, "Analytics views".
resource "google_bigquery_table" "analytics_views" {
  #checkov:skip=CKV_GCP_80:A view stores no data of its own to encrypt.
  #checkov:skip=CKV_GCP_121:A view holds no data and is rebuilt from infra/sql; protection would only block removing a view whose SQL file was deleted.
  for_each = local.analytics_sql_files

  dataset_id = google_bigquery_dataset.maas.dataset_id
  table_id   = trimsuffix(each.key, ".sql")
  labels     = local.labels

  view {
    query = templatefile("${local.analytics_sql_dir}/${each.key}", {
      project_id = var.project_id
      dataset    = google_bigquery_dataset.maas.dataset_id
    })
    use_legacy_sql = false
  }

  # Views are derived from files in the repository and cheap to recreate.
  deletion_protection = false

  depends_on = [google_bigquery_table.inference_log, google_bigquery_table.rollout_audit, google_bigquery_table.analytics_base_views]
}
