# Pub/Sub: per catalog model, one request queue per priority (high, normal, and batch for batch jobs' lines:
# competing workers, retries) and one dead-letter queue every priority parks failing requests on; the shared replies topic. Per-request
# reply subscriptions are created at runtime by the API.

resource "google_pubsub_topic" "requests" {
  #checkov:skip=CKV_GCP_83:Google-managed encryption; messages hold prompts and GCS URIs, no secrets, and a CMEK key ring would be one more thing to provision per project.
  for_each = local.request_queues

  name   = local.request_topic_names[each.key]
  labels = merge(local.labels, { maas-model = each.value.model, maas-priority = each.value.priority })

  depends_on = [google_project_service.enabled]
}

resource "google_pubsub_topic" "dead_letter" {
  #checkov:skip=CKV_GCP_83:Google-managed encryption; same content as the request topics.
  for_each = local.models

  name   = local.dead_letter_topic_names[each.key]
  labels = merge(local.labels, { maas-model = each.key })

  depends_on = [google_project_service.enabled]
}

resource "google_pubsub_subscription" "workers" {
  for_each = local.request_queues

  name   = local.worker_subscription_names[each.key]
  topic  = google_pubsub_topic.requests[each.key].id
  labels = merge(local.labels, { maas-model = each.value.model, maas-priority = each.value.priority })

  # Short on purpose: the worker extends the lease while a request waits and runs, so a crashed
  # worker's requests are redelivered within seconds (the catalog keeps it under a third of the
  # request timeout).
  ack_deadline_seconds = local.models[each.value.model].ack_deadline_seconds

  # A request older than this is long past its own deadline; keeping it longer only makes workers
  # reply "expired" to it. A batch line waits for idle capacity, up to its batch's completion window.
  message_retention_duration = each.value.priority == "batch" ? "${var.batch_request_retention_seconds}s" : "${var.request_retention_seconds}s"
  retain_acked_messages      = false

  # Back off on nacks and expired leases so a failing request does not spin on the GPUs.
  retry_policy {
    minimum_backoff = "${var.request_retry_minimum_backoff_seconds}s"
    maximum_backoff = "${var.request_retry_maximum_backoff_seconds}s"
  }

  # A request that keeps failing (e.g. a poison input that crashes the pipeline) is moved to the
  # model's one dead-letter topic, whichever priority it came in on.
  dead_letter_policy {
    dead_letter_topic     = google_pubsub_topic.dead_letter[each.value.model].id
    max_delivery_attempts = local.models[each.value.model].max_delivery_attempts
  }

  # The worker subscription must never be deleted for inactivity (e.g. a model idle for weeks).
  expiration_policy {
    ttl = ""
  }

  depends_on = [google_pubsub_topic_iam_member.dead_letter_publisher]
}

# Messages published to a topic without a subscription are dropped. The workers pull this one and
# answer each dead-lettered request with an error reply, so its client is not left waiting for the
# timeout; retention keeps what no worker answered (all workers down) for inspection and replay.
resource "google_pubsub_subscription" "dead_letter" {
  for_each = local.models

  name   = local.dead_letter_subscription_names[each.key]
  topic  = google_pubsub_topic.dead_letter[each.key].id
  labels = merge(local.labels, { maas-model = each.key })

  ack_deadline_seconds       = 60
  message_retention_duration = "${var.dead_letter_retention_seconds}s"
  retain_acked_messages      = false

  expiration_policy {
    ttl = ""
  }
}

resource "google_pubsub_topic" "replies" {
  #checkov:skip=CKV_GCP_83:Google-managed encryption; replies carry results or GCS URIs, no secrets.
  name   = local.replies_topic_name
  labels = local.labels

  depends_on = [google_project_service.enabled]
}

# Batch lines' replies (issue 35): the API's batch runner drains the one subscription to wake its collector;
# the worker's stored answer in Redis is what it reads, so a message lost or expired here loses nothing.
resource "google_pubsub_topic" "batch_replies" {
  #checkov:skip=CKV_GCP_83:Google-managed encryption; replies carry results or GCS URIs, no secrets.
  name   = local.batch_replies_topic_name
  labels = local.labels

  depends_on = [google_project_service.enabled]
}

resource "google_pubsub_subscription" "batch_replies" {
  name                       = local.batch_replies_subscription
  topic                      = google_pubsub_topic.batch_replies.id
  labels                     = local.labels
  ack_deadline_seconds       = 30
  message_retention_duration = "3600s"

  expiration_policy {
    ttl = ""
  }
}

# Dead-lettering is done by the Pub/Sub service agent: it must publish to the dead-letter topic and
# acknowledge (subscribe to) every source subscription, the high-priority one included.
resource "google_pubsub_topic_iam_member" "dead_letter_publisher" {
  for_each = local.models

  topic  = google_pubsub_topic.dead_letter[each.key].name
  role   = "roles/pubsub.publisher"
  member = local.pubsub_service_agent
}

resource "google_pubsub_subscription_iam_member" "dead_letter_forwarder" {
  for_each = local.request_queues

  subscription = google_pubsub_subscription.workers[each.key].name
  role         = "roles/pubsub.subscriber"
  member       = local.pubsub_service_agent
}
