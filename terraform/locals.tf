# Names and facts shared by every other file. The resource names below follow the convention in
# contract/naming.py; tests/infra/test_terraform.py renders them for every catalog model and
# compares them with that module, so change both together.
locals {
  # The model catalog is the single list of served models: two request queues (one per priority),
  # a dead-letter queue and an alert set per entry. Only models.yaml: models.local.yaml holds the
  # local stack's synthetic models and never reaches production.
  catalog_path = "${path.module}/../contract/models.yaml"
  catalog      = yamldecode(file(local.catalog_path))

  # Every servable unit, keyed by its queue name (contract.naming.version_queue): a model without
  # `versions` is one unit named after it; each of a model's `versions` is a unit of its own,
  # "<model>--<version>", the model's fields overridden by the version's, with its own request topics,
  # subscriptions and dead-letter queue (ModelCatalog.units in contract/catalog.py).
  catalog_units = merge([
    for name, entry in local.catalog.models : {
      for version, override in try(entry.versions, { (entry.version) = {} }) :
      (can(entry.versions) ? "${name}--${version}" : name) => merge(entry, override)
    }
  ]...)

  # The catalog fields Terraform reads, one uniform object per unit. Fields the catalog may leave
  # out (runner, worker_group, weights_path for non-diffusers runners) go through try(), so a model
  # that omits them still decodes; everything else is a required field of contract.catalog.ModelSpec.
  models = {
    for name, spec in local.catalog_units : name => {
      runner                  = try(spec.runner, "diffusers")
      weights_path            = try(spec.weights_path, "")
      hardware                = spec.hardware
      gpu_sharing             = spec.gpu_sharing
      worker_group            = coalesce(try(spec.worker_group, null), name)
      request_timeout_seconds = spec.request_timeout_seconds
      ack_deadline_seconds    = spec.ack_deadline_seconds
      max_delivery_attempts   = spec.max_delivery_attempts
    }
  }

  # The BigQuery log table schema is the one the API validates its rows against.
  inference_log_schema_path = "${path.module}/../contract/inference_log_schema.json"

  # contract.naming.PRIORITIES, and the suffix each adds to a request topic and its subscription.
  priority_suffixes = {
    high   = "-high"
    normal = ""
    batch  = "-batch"
  }

  # One request queue (topic and worker subscription) per model and priority, keyed "model/priority"
  # so that adding a model or a priority never renumbers another queue.
  request_queues = {
    for pair in setproduct(keys(local.models), keys(local.priority_suffixes)) : "${pair[0]}/${pair[1]}" => {
      model    = pair[0]
      priority = pair[1]
    }
  }

  # Flows (the catalog's `flows:`) publish to their first stage's request topics like any request: no topic of
  # their own. A stage served by another worker deployment gets the flow from the worker that ran the stage
  # before it, which publishes to that stage's request topics itself (never through the API): the models of
  # every stage after the first, whose request topics (each of their units', both priorities) workers publish to.
  flow_forwarded_models = toset(flatten([
    for name, flow in try(local.catalog.flows, {}) : [for index, stage in flow.stages : stage.model if index > 0]
  ]))
  flow_forwarded_queues = {
    for key, queue in local.request_queues : key => queue if contains(local.flow_forwarded_models, split("--", queue.model)[0])
  }

  request_topic_names            = { for key, queue in local.request_queues : key => "maas-requests-${queue.model}${local.priority_suffixes[queue.priority]}" }
  worker_subscription_names      = { for key, queue in local.request_queues : key => "maas-requests-${queue.model}${local.priority_suffixes[queue.priority]}-workers" }
  dead_letter_topic_names        = { for model in keys(local.models) : model => "maas-requests-${model}-dead-letter" }
  dead_letter_subscription_names = { for model in keys(local.models) : model => "maas-requests-${model}-dead-letter-sub" }
  replies_topic_name             = "maas-replies"
  batch_replies_topic_name       = "maas-batch-replies"
  batch_replies_subscription     = "maas-batch-replies-collector"

  model_bucket_name   = "${var.project_id}-maas-models"
  payload_bucket_name = "${var.project_id}-maas-payloads"

  bigquery_dataset    = "maas"
  inference_log_table = "inference_log"
  rollout_audit_table = "rollout_audit"

  # Analytics views: one view per infra/sql/<view>.sql, rendered with templatefile. The directory
  # may hold no files; fileset then yields an empty set and no views are created.
  analytics_sql_dir   = "${path.module}/../infra/sql"
  analytics_sql_files = fileset(local.analytics_sql_dir, "*.sql")
  # Views the analytics views read (e.g. the log with one row per request id), created before them.
  analytics_base_sql_files = fileset("${local.analytics_sql_dir}/base", "*.sql")

  # Workers run under this Kubernetes service account; infra/k8s manifests create it.
  worker_namespace       = "maas"
  worker_service_account = "model-worker"

  gke_pods_range_name     = "gke-pods"
  gke_services_range_name = "gke-services"

  api_service_name    = "maas-api"
  artifact_repository = "maas"

  # GPU hardware classes named by the catalog's `hardware` field. The accelerator type is also the
  # node label `cloud.google.com/gke-accelerator` that the worker manifests select on.
  gpu_hardware = {
    l4 = {
      machine_type     = "g2-standard-8"
      accelerator_type = "nvidia-l4"
    }
    a100 = {
      machine_type     = "a2-highgpu-1g"
      accelerator_type = "nvidia-tesla-a100"
    }
    # An 80 GB card: a model in bf16 the memory plan (contract/memory_plan.py) does not fit an L4 or a 40 GB A100.
    a100-80 = {
      machine_type     = "a2-ultragpu-1g"
      accelerator_type = "nvidia-a100-80gb"
    }
    h100 = {
      machine_type     = "a3-highgpu-1g"
      accelerator_type = "nvidia-h100-80gb"
    }
  }

  # The API's request timeout must outlast the slowest model's, or Cloud Run cuts off replies the
  # workers are still producing.
  max_model_request_timeout_seconds = max([for model in values(local.models) : model.request_timeout_seconds]...)

  pubsub_service_agent = "serviceAccount:service-${data.google_project.this.number}@gcp-sa-pubsub.iam.gserviceaccount.com"

  labels = merge(var.labels, {
    app        = "maas"
    managed-by = "terraform"
  })
}
