# Cloud Monitoring alerts: queues falling behind, requests being dead-lettered, and the API failing
# or slowing down. Every policy notifies var.alert_notification_channels.

# A request still unacknowledged after its own timeout has been abandoned by the client: the
# workers for this model are not keeping up (too few nodes, GPU quota, or crashing workers). One
# policy per model and priority, so a starved normal queue behind a busy high one shows up too; a batch
# line waits for idle capacity by design, so its queue alerts only past a day.
resource "google_monitoring_alert_policy" "request_queue_backlog" {
  for_each = local.request_queues

  display_name          = "maas: ${each.value.model} ${each.value.priority}-priority requests waiting longer than their timeout"
  combiner              = "OR"
  notification_channels = var.alert_notification_channels
  user_labels           = merge(local.labels, { maas-model = each.value.model, maas-priority = each.value.priority })

  conditions {
    display_name = "Oldest unacked request on ${local.worker_subscription_names[each.key]} older than ${each.value.priority == "batch" ? var.batch_backlog_alert_seconds : local.models[each.value.model].request_timeout_seconds}s"
    condition_threshold {
      filter          = "resource.type = \"pubsub_subscription\" AND resource.labels.subscription_id = \"${local.worker_subscription_names[each.key]}\" AND metric.type = \"pubsub.googleapis.com/subscription/oldest_unacked_message_age\""
      comparison      = "COMPARISON_GT"
      threshold_value = each.value.priority == "batch" ? var.batch_backlog_alert_seconds : local.models[each.value.model].request_timeout_seconds
      duration        = "${var.alert_duration_seconds}s"

      aggregations {
        alignment_period   = "60s"
        per_series_aligner = "ALIGN_MAX"
      }
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = "${title(each.value.priority)}-priority requests for model `${each.value.model}` wait longer than the model's request timeout. Check the worker Deployment serving it (`model-worker-${local.models[each.value.model].worker_group}`): replicas and pending pods, the GPU node pool's autoscaler events and GPU quota."
  }

  depends_on = [google_project_service.enabled]
}

# A request that failed max_delivery_attempts times is moved to the model's dead-letter topic. The
# workers answer it with an error reply and acknowledge it, so the dead-letter subscription is
# usually empty: the first condition catches the dead-lettering itself, the second dead-lettered
# requests nobody answers (the model's workers are down).
resource "google_monitoring_alert_policy" "dead_lettered_requests" {
  for_each = local.models

  display_name          = "maas: ${each.key} requests dead-lettered"
  combiner              = "OR"
  notification_channels = var.alert_notification_channels
  user_labels           = merge(local.labels, { maas-model = each.key })

  conditions {
    display_name = "Requests moved from ${each.key}'s worker subscriptions to ${local.dead_letter_topic_names[each.key]}"
    condition_threshold {
      filter          = "resource.type = \"pubsub_subscription\" AND resource.labels.subscription_id = one_of(${join(", ", [for priority in keys(local.priority_suffixes) : "\"${local.worker_subscription_names["${each.key}/${priority}"]}\""])}) AND metric.type = \"pubsub.googleapis.com/subscription/dead_letter_message_count\""
      comparison      = "COMPARISON_GT"
      threshold_value = 0
      duration        = "0s"

      aggregations {
        alignment_period     = "60s"
        per_series_aligner   = "ALIGN_DELTA"
        cross_series_reducer = "REDUCE_SUM"
      }
    }
  }

  conditions {
    display_name = "Unanswered messages on ${local.dead_letter_subscription_names[each.key]}"
    condition_threshold {
      filter          = "resource.type = \"pubsub_subscription\" AND resource.labels.subscription_id = \"${local.dead_letter_subscription_names[each.key]}\" AND metric.type = \"pubsub.googleapis.com/subscription/num_undelivered_messages\""
      comparison      = "COMPARISON_GT"
      threshold_value = 0
      duration        = "${var.alert_duration_seconds}s"

      aggregations {
        alignment_period   = "60s"
        per_series_aligner = "ALIGN_MAX"
      }
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = "Requests for model `${each.key}` failed ${local.models[each.key].max_delivery_attempts} deliveries and were moved to `${local.dead_letter_topic_names[each.key]}`; their clients got an error reply from a worker. Find them in the worker logs and the inference log (status error), fix the cause. Messages left on `${local.dead_letter_subscription_names[each.key]}` were not answered: check that the model's workers run."
  }

  depends_on = [google_project_service.enabled]
}

resource "google_monitoring_alert_policy" "api_server_errors" {
  display_name          = "maas: API 5xx ratio above ${var.api_5xx_ratio_threshold}"
  combiner              = "OR"
  notification_channels = var.alert_notification_channels
  user_labels           = local.labels

  conditions {
    display_name = "Share of ${local.api_service_name} responses that are 5xx"
    condition_threshold {
      filter             = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND metric.type = \"run.googleapis.com/request_count\" AND metric.labels.response_code_class = \"5xx\""
      denominator_filter = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND metric.type = \"run.googleapis.com/request_count\""
      comparison         = "COMPARISON_GT"
      threshold_value    = var.api_5xx_ratio_threshold
      duration           = "${var.alert_duration_seconds}s"

      aggregations {
        alignment_period     = "60s"
        per_series_aligner   = "ALIGN_RATE"
        cross_series_reducer = "REDUCE_SUM"
        group_by_fields      = ["resource.labels.service_name"]
      }
      denominator_aggregations {
        alignment_period     = "60s"
        per_series_aligner   = "ALIGN_RATE"
        cross_series_reducer = "REDUCE_SUM"
        group_by_fields      = ["resource.labels.service_name"]
      }
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = "The API answers more than ${var.api_5xx_ratio_threshold * 100}% of requests with a 5xx. Check the Cloud Run logs of `${local.api_service_name}` and the request queue alerts (timeouts show up as 504)."
  }

  depends_on = [google_project_service.enabled]
}

resource "google_monitoring_alert_policy" "api_latency" {
  display_name          = "maas: API p99 latency above ${var.api_p99_latency_threshold_ms} ms"
  combiner              = "OR"
  notification_channels = var.alert_notification_channels
  user_labels           = local.labels

  conditions {
    display_name = "p99 request latency of ${local.api_service_name}"
    condition_threshold {
      filter          = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND metric.type = \"run.googleapis.com/request_latencies\""
      comparison      = "COMPARISON_GT"
      threshold_value = var.api_p99_latency_threshold_ms
      duration        = "${var.alert_duration_seconds}s"

      aggregations {
        alignment_period     = "60s"
        per_series_aligner   = "ALIGN_DELTA"
        cross_series_reducer = "REDUCE_PERCENTILE_99"
        group_by_fields      = ["resource.labels.service_name"]
      }
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = "The slowest 1% of API requests take longer than ${var.api_p99_latency_threshold_ms} ms. Usually the request queues are backing up: see the per-model backlog alerts and GPU node pool scaling."
  }

  depends_on = [google_project_service.enabled]
}
