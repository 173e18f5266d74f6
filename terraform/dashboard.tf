# The fleet on one Cloud Monitoring dashboard: the API on top (request rate by class, error share, latency), the
# dead letters and the batch backlog, then one row per model: its Pub/Sub backlog by priority, requests answered
# (by the workers' reply status) and refused or fallen back (admission, from the API's log lines), latency p50
# and p95 (queue wait and inference, from the workers' own metrics), and images per pipeline call beside the
# GPU busy share. The workers' series come from Managed Service for Prometheus (gke.tf), queried in PromQL.

# Admission's refusals and fallbacks (api_server/predict/admission.py logs one line per refused request, with its model
# and what became of it: `refused`, its 503, or `fallback`, answered by the fallback; never both): Cloud Run does not
# export the API's Prometheus metrics, so the dashboard counts these lines instead.
resource "google_logging_metric" "admission_decisions" {
  name   = "maas-admission-decisions"
  filter = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND jsonPayload.admission:*"

  metric_descriptor {
    metric_kind = "DELTA"
    value_type  = "INT64"
    unit        = "1"
    labels {
      key         = "model"
      value_type  = "STRING"
      description = "the model asked for"
    }
    labels {
      key         = "decision"
      value_type  = "STRING"
      description = "refused (503 at once) or fallback (answered by the model's fallback instead): one per request"
    }
  }
  label_extractors = {
    model    = "EXTRACT(jsonPayload.admission.model)"
    decision = "EXTRACT(jsonPayload.admission.decision)"
  }
}

locals {
  dashboard_row_height = 4
  dashboard_api_tiles = [
    {
      title = "API requests per second, by response class"
      xyChart = { dataSets = [{
        plotType = "STACKED_AREA"
        timeSeriesQuery = { timeSeriesFilter = {
          filter      = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND metric.type = \"run.googleapis.com/request_count\""
          aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_RATE", crossSeriesReducer = "REDUCE_SUM", groupByFields = ["metric.labels.response_code_class"] }
        } }
      }] }
    },
    {
      title = "API 5xx share"
      xyChart = { dataSets = [{
        plotType = "LINE"
        timeSeriesQuery = { timeSeriesFilterRatio = {
          numerator = {
            filter      = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND metric.type = \"run.googleapis.com/request_count\" AND metric.labels.response_code_class = \"5xx\""
            aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_RATE", crossSeriesReducer = "REDUCE_SUM" }
          }
          denominator = {
            filter      = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND metric.type = \"run.googleapis.com/request_count\""
            aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_RATE", crossSeriesReducer = "REDUCE_SUM" }
          }
        } }
      }] }
    },
    {
      title = "API latency p50 and p95"
      xyChart = { dataSets = [for reducer in ["REDUCE_PERCENTILE_50", "REDUCE_PERCENTILE_95"] : {
        plotType = "LINE"
        timeSeriesQuery = { timeSeriesFilter = {
          filter      = "resource.type = \"cloud_run_revision\" AND resource.labels.service_name = \"${local.api_service_name}\" AND metric.type = \"run.googleapis.com/request_latencies\""
          aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_DELTA", crossSeriesReducer = reducer }
        } }
      }] }
    },
    {
      title = "Dead-lettered requests, and the batch lines waiting"
      xyChart = { dataSets = [
        {
          plotType = "STACKED_BAR"
          timeSeriesQuery = { timeSeriesFilter = {
            filter      = "resource.type = \"pubsub_subscription\" AND metric.type = \"pubsub.googleapis.com/subscription/dead_letter_message_count\""
            aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_DELTA", crossSeriesReducer = "REDUCE_SUM", groupByFields = ["resource.labels.subscription_id"] }
          } }
        },
        {
          plotType = "LINE"
          timeSeriesQuery = { timeSeriesFilter = {
            filter      = "resource.type = \"pubsub_subscription\" AND resource.labels.subscription_id = one_of(${join(", ", [for model in keys(local.models) : "\"${local.worker_subscription_names["${model}/batch"]}\""])}) AND metric.type = \"pubsub.googleapis.com/subscription/num_undelivered_messages\""
            aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_MAX", crossSeriesReducer = "REDUCE_SUM" }
          } }
        },
      ] }
    },
  ]
  dashboard_model_tiles = {
    for model, spec in local.models : model => [
      {
        title = "${model}: Pub/Sub backlog by priority"
        xyChart = { dataSets = [{
          plotType = "LINE"
          timeSeriesQuery = { timeSeriesFilter = {
            filter      = "resource.type = \"pubsub_subscription\" AND resource.labels.subscription_id = one_of(${join(", ", [for priority in keys(local.priority_suffixes) : "\"${local.worker_subscription_names["${model}/${priority}"]}\""])}) AND metric.type = \"pubsub.googleapis.com/subscription/num_undelivered_messages\""
            aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_MAX", crossSeriesReducer = "REDUCE_SUM", groupByFields = ["resource.labels.subscription_id"] }
          } }
        }] }
      },
      {
        title = "${model}: answered by reply status, refused and fallen back (per second)"
        xyChart = { dataSets = [
          {
            plotType        = "STACKED_AREA"
            timeSeriesQuery = { prometheusQuery = "sum by (status) (rate(maas_worker_requests_total{model=\"${model}\"}[5m]))" }
          },
          {
            plotType = "STACKED_AREA"
            timeSeriesQuery = { timeSeriesFilter = {
              filter      = "metric.type = \"logging.googleapis.com/user/${google_logging_metric.admission_decisions.name}\" AND metric.labels.model = \"${model}\""
              aggregation = { alignmentPeriod = "60s", perSeriesAligner = "ALIGN_RATE", crossSeriesReducer = "REDUCE_SUM", groupByFields = ["metric.labels.decision"] }
            } }
          },
        ] }
      },
      {
        title = "${model}: latency p50 and p95 (queue wait, inference), seconds"
        xyChart = { dataSets = [for pair in setproduct(["queue_wait", "inference"], ["0.5", "0.95"]) : {
          plotType        = "LINE"
          timeSeriesQuery = { prometheusQuery = "histogram_quantile(${pair[1]}, sum by (le) (rate(maas_worker_${pair[0]}_seconds_bucket{model=\"${model}\"}[5m])))" }
        }] }
      },
      {
        title = "${model}: images per pipeline call, GPU busy share (${spec.worker_group})"
        xyChart = { dataSets = [
          {
            plotType        = "LINE"
            timeSeriesQuery = { prometheusQuery = "sum(rate(maas_worker_batch_images_sum{model=\"${model}\"}[5m])) / sum(rate(maas_worker_batch_images_count{model=\"${model}\"}[5m]))" }
          },
          {
            plotType        = "LINE"
            timeSeriesQuery = { prometheusQuery = "1 - avg(rate(maas_worker_device_idle_seconds_total{namespace=\"${local.worker_namespace}\", pod=~\"model-worker-${spec.worker_group}-.*\"}[5m]))" }
          },
        ] }
      },
    ]
  }
  dashboard_rows = concat([local.dashboard_api_tiles], [for model in sort(keys(local.models)) : local.dashboard_model_tiles[model]])
}

resource "google_monitoring_dashboard" "fleet" {
  dashboard_json = jsonencode({
    displayName = "maas: the fleet"
    labels      = { maas = "" }
    mosaicLayout = {
      columns = 12
      tiles = flatten([
        for row, tiles in local.dashboard_rows : [
          for column, tile in tiles : {
            xPos   = column * 3
            yPos   = row * local.dashboard_row_height
            width  = 3
            height = local.dashboard_row_height
            widget = tile
          }
        ]
      ])
    }
  })

  depends_on = [google_project_service.enabled]
}
