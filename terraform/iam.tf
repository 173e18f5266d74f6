# Identities and least-privilege grants: the API (Cloud Run), the model workers (GKE Workload
# Identity) and the GKE nodes. Grants are on individual topics, subscriptions, buckets, the dataset
# and secrets wherever the resource exists before the code runs.

resource "google_service_account" "api" {
  account_id   = "maas-api"
  display_name = "Model-as-a-Service API (Cloud Run)"

  depends_on = [google_project_service.enabled]
}

# infra/k8s annotates the model-worker Kubernetes service account with this account's email.
resource "google_service_account" "worker" {
  account_id   = "maas-worker"
  display_name = "Model-as-a-Service model workers (GKE Workload Identity)"

  depends_on = [google_project_service.enabled]
}

resource "google_service_account" "keda" {
  account_id   = "maas-keda"
  display_name = "KEDA operator: reads Pub/Sub backlog metrics (PromQL) to scale the model workers"

  depends_on = [google_project_service.enabled]
}

resource "google_service_account" "gke_nodes" {
  account_id   = "maas-gke-nodes"
  display_name = "Model-as-a-Service GKE nodes"

  depends_on = [google_project_service.enabled]
}

# --- API -------------------------------------------------------------------------------------

# Both priorities: the API picks the topic from the request's priority.
resource "google_pubsub_topic_iam_member" "api_publishes_requests" {
  for_each = local.request_queues

  topic  = google_pubsub_topic.requests[each.key].name
  role   = "roles/pubsub.publisher"
  member = google_service_account.api.member
}

# The API waits for each reply on a subscription it creates on the replies topic at runtime
# (per request, or one per API instance) and deletes afterwards. Attaching a subscription needs
# pubsub.topics.attachSubscription on the topic, granted here by roles/pubsub.subscriber on the
# replies topic only.
resource "google_pubsub_topic_iam_member" "api_attaches_reply_subscriptions" {
  topic  = google_pubsub_topic.replies.name
  role   = "roles/pubsub.subscriber"
  member = google_service_account.api.member
}

# Subscriptions that do not exist yet cannot carry their own IAM policy, and the creator of a
# subscription gets no implicit access to it, so the subscription-side permissions must be granted
# on the project. This role holds only what reply waiting needs (no topic, snapshot or schema
# permissions); `list` lets the API sweep leaked reply subscriptions by their maas-purpose label.
resource "google_project_iam_custom_role" "reply_waiter" {
  role_id     = "maasReplyWaiter"
  title       = "Model-as-a-Service reply waiter"
  description = "Create, read from and delete the API's ephemeral reply subscriptions."
  permissions = [
    "pubsub.subscriptions.consume",
    "pubsub.subscriptions.create",
    "pubsub.subscriptions.delete",
    "pubsub.subscriptions.get",
    "pubsub.subscriptions.list",
  ]

  depends_on = [google_project_service.enabled]
}

resource "google_project_iam_member" "api_waits_for_replies" {
  project = var.project_id
  role    = google_project_iam_custom_role.reply_waiter.id
  member  = google_service_account.api.member
}

resource "google_bigquery_dataset_iam_member" "api_writes_inference_log" {
  dataset_id = google_bigquery_dataset.maas.dataset_id
  role       = "roles/bigquery.dataEditor"
  member     = google_service_account.api.member
}

# A batch from a BigQuery table reads a snapshot of it taken at submit (api_server/batches/tables.py): a copy job
# (this role: running a job, nothing else) into the service's dataset (the role above); the table's owner grants
# bigquery.tables.createSnapshot on it.
resource "google_project_iam_custom_role" "batch_table_snapshots" {
  role_id     = "maasBatchTableSnapshots"
  title       = "Model-as-a-Service batch table snapshots"
  description = "Run the copy job that snapshots a batch's input table at submit."
  permissions = ["bigquery.jobs.create"]

  depends_on = [google_project_service.enabled]
}

resource "google_project_iam_member" "api_snapshots_batch_tables" {
  project = var.project_id
  role    = google_project_iam_custom_role.batch_table_snapshots.id
  member  = google_service_account.api.member
}

resource "google_storage_bucket_iam_member" "api_uses_payloads" {
  bucket = google_storage_bucket.payloads.name
  role   = "roles/storage.objectAdmin"
  member = google_service_account.api.member
}

# LoRA adapter registration: the API reads the model bucket (an adapter's file, and the base weights' safetensors
# headers it is checked against) and writes only under adapters/ (the registration records).
resource "google_storage_bucket_iam_member" "api_reads_models" {
  bucket = google_storage_bucket.models.name
  role   = "roles/storage.objectViewer"
  member = google_service_account.api.member
}

resource "google_storage_bucket_iam_member" "api_registers_adapters" {
  bucket = google_storage_bucket.models.name
  role   = "roles/storage.objectAdmin"
  member = google_service_account.api.member
  condition {
    title       = "adapters-prefix-only"
    description = "Adapter registration records under adapters/ only; never the weights"
    expression  = "resource.name.startsWith(\"projects/_/buckets/${local.model_bucket_name}/objects/adapters/\")"
  }
}

# The OpenAI Images API's `response_format: url`: the API signs its image links as itself through IAM signBlob
# (Cloud Run's credentials hold no key), which takes the token creator role on its own account, and no other.
resource "google_service_account_iam_member" "api_signs_result_links" {
  service_account_id = google_service_account.api.name
  role               = "roles/iam.serviceAccountTokenCreator"
  member             = google_service_account.api.member
}

resource "google_secret_manager_secret_iam_member" "api_reads_secrets" {
  for_each = google_secret_manager_secret.maas

  secret_id = each.value.id
  role      = "roles/secretmanager.secretAccessor"
  member    = google_service_account.api.member
}

# --- Model workers -----------------------------------------------------------------------------

# Pods running as Kubernetes service account maas/model-worker act as the worker Google service
# account.
resource "google_service_account_iam_member" "worker_workload_identity" {
  service_account_id = google_service_account.worker.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project_id}.svc.id.goog[${local.worker_namespace}/${local.worker_service_account}]"

  # The identity pool <project>.svc.id.goog exists once the cluster does.
  depends_on = [google_container_cluster.workers]
}

# Both priorities of every model: a worker serves every model of its deployment and takes high
# priority first.
resource "google_pubsub_subscription_iam_member" "worker_pulls_requests" {
  for_each = local.request_queues

  subscription = google_pubsub_subscription.workers[each.key].name
  role         = "roles/pubsub.subscriber"
  member       = google_service_account.worker.member
}

# Workers also pull the dead-letter subscription, to answer each dead-lettered request with an error
# reply instead of leaving its client to time out.
resource "google_pubsub_subscription_iam_member" "worker_answers_dead_letters" {
  for_each = local.models

  subscription = google_pubsub_subscription.dead_letter[each.key].name
  role         = "roles/pubsub.subscriber"
  member       = google_service_account.worker.member
}

resource "google_pubsub_topic_iam_member" "worker_publishes_replies" {
  topic  = google_pubsub_topic.replies.name
  role   = "roles/pubsub.publisher"
  member = google_service_account.worker.member
}

# A flow's stage served by another deployment: the worker that finished the stage before publishes the flow,
# its intermediate (a claim check in the payload bucket) and its reply address to that stage's request topic.
resource "google_pubsub_topic_iam_member" "worker_forwards_flow_stages" {
  for_each = local.flow_forwarded_queues

  topic  = google_pubsub_topic.requests[each.key].name
  role   = "roles/pubsub.publisher"
  member = google_service_account.worker.member
}

resource "google_pubsub_topic_iam_member" "worker_publishes_batch_replies" {
  topic  = google_pubsub_topic.batch_replies.name
  role   = "roles/pubsub.publisher"
  member = google_service_account.worker.member
}

# The batch runner (in the API: cloud_run.tf) drains the batch replies subscription. A batch's input file is
# read with the API's service account: a caller grants it roles/storage.objectViewer on their own bucket.
resource "google_pubsub_subscription_iam_member" "api_collects_batch_replies" {
  subscription = google_pubsub_subscription.batch_replies.name
  role         = "roles/pubsub.subscriber"
  member       = google_service_account.api.member
}

resource "google_storage_bucket_iam_member" "worker_reads_weights" {
  bucket = google_storage_bucket.models.name
  role   = "roles/storage.objectViewer"
  member = google_service_account.worker.member
}

resource "google_storage_bucket_iam_member" "worker_uses_payloads" {
  bucket = google_storage_bucket.payloads.name
  role   = "roles/storage.objectAdmin"
  member = google_service_account.worker.member
}

# --- Worker autoscaling (KEDA) ----------------------------------------------------------------

# KEDA's prometheus scaler reads the worker subscriptions' backlog from Cloud Monitoring through its
# PromQL endpoint (Managed Service for Prometheus), as the KEDA operator's Kubernetes service account.
# roles/monitoring.viewer holds monitoring.timeSeries.list, which PromQL queries need; metric reads
# cannot be scoped below the project.
resource "google_service_account_iam_member" "keda_workload_identity" {
  service_account_id = google_service_account.keda.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project_id}.svc.id.goog[${var.keda_operator_service_account}]"

  depends_on = [google_container_cluster.workers]
}

resource "google_project_iam_member" "keda_reads_queue_metrics" {
  project = var.project_id
  role    = "roles/monitoring.viewer"
  member  = google_service_account.keda.member
}

# --- GKE nodes ---------------------------------------------------------------------------------

# The minimum a node needs: ship logs and metrics, and pull the worker image. Workloads get their
# own identity through Workload Identity, never the node's.
resource "google_project_iam_member" "gke_node_telemetry" {
  for_each = toset([
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
  ])

  project = var.project_id
  role    = each.key
  member  = google_service_account.gke_nodes.member
}

resource "google_artifact_registry_repository_iam_member" "gke_nodes_pull_images" {
  location   = google_artifact_registry_repository.maas.location
  repository = google_artifact_registry_repository.maas.name
  role       = "roles/artifactregistry.reader"
  member     = google_service_account.gke_nodes.member
}
