# GKE: the GPU cluster that runs the model workers. Private nodes, Workload Identity, GKE-installed
# NVIDIA drivers, and one autoscaled node pool per entry of var.gpu_node_pools.

resource "google_container_cluster" "workers" {
  #checkov:skip=CKV_GCP_12:Network policy is enforced by GKE Dataplane V2 (ADVANCED_DATAPATH), which replaces the Calico network_policy block this check looks for.
  #checkov:skip=CKV_GCP_65:RBAC through Google Groups needs a Workspace groups domain the project may not have; access is granted per user/service account with IAM.
  #checkov:skip=CKV_GCP_66:Binary Authorization needs an attestation pipeline for the two images; images come only from this project's Artifact Registry, pushed by CI.
  name     = var.cluster_name
  location = var.region

  resource_labels = local.labels

  network         = google_compute_network.maas.id
  subnetwork      = google_compute_subnetwork.gke.id
  networking_mode = "VPC_NATIVE"

  ip_allocation_policy {
    cluster_secondary_range_name  = local.gke_pods_range_name
    services_secondary_range_name = local.gke_services_range_name
  }

  # Node pools are managed below; the default pool only exists because the API requires one at
  # creation.
  remove_default_node_pool = true
  initial_node_count       = 1

  # Private nodes: GPU nodes get no public IP. The control plane endpoint stays reachable from the
  # authorized networks so `kubectl apply` works from an operator's machine or CI.
  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = false
    master_ipv4_cidr_block  = var.gke_control_plane_cidr
  }

  master_authorized_networks_config {
    dynamic "cidr_blocks" {
      for_each = var.gke_authorized_networks
      content {
        cidr_block   = cidr_blocks.value
        display_name = cidr_blocks.key
      }
    }
  }

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  release_channel {
    channel = var.gke_release_channel
  }

  # Worker pods act as the worker Google service account, never as the node.
  workload_identity_config {
    workload_pool = "${var.project_id}.svc.id.goog"
  }

  # Managed Service for Prometheus: its collectors scrape the workers' /metrics (the PodMonitoring
  # objects infra/k8s renders). The Pub/Sub backlog KEDA scales on is a Cloud Monitoring system metric,
  # queryable through the same PromQL endpoint without any collector.
  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]
    managed_prometheus {
      enabled = true
    }
  }

  datapath_provider           = "ADVANCED_DATAPATH"
  enable_intranode_visibility = true
  enable_shielded_nodes       = true

  # Applies to the short-lived default pool only.
  node_config {
    service_account = google_service_account.gke_nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    image_type      = "COS_CONTAINERD"
    metadata = {
      disable-legacy-endpoints = "true"
    }
    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }

  deletion_protection = var.deletion_protection

  depends_on = [google_project_service.enabled]
}

# Untainted nodes for cluster services (DNS, metrics, GPU device plugin controllers), which would
# otherwise have nowhere to run: every GPU node is tainted.
resource "google_container_node_pool" "system" {
  name     = "system"
  cluster  = google_container_cluster.workers.id
  location = var.region

  node_locations = var.gke_zones

  autoscaling {
    total_min_node_count = 1
    total_max_node_count = 3
    location_policy      = "BALANCED"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = "e2-standard-4"
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = 50
    service_account = google_service_account.gke_nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    resource_labels = local.labels
    metadata = {
      disable-legacy-endpoints = "true"
    }
    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }
}

resource "google_container_node_pool" "gpu" {
  for_each = var.gpu_node_pools

  name     = each.key
  cluster  = google_container_cluster.workers.id
  location = var.region

  node_locations = var.gke_zones

  # Totals across zones; "ANY" places nodes wherever GPUs (or spot capacity) are available.
  autoscaling {
    total_min_node_count = each.value.min_node_count
    total_max_node_count = each.value.max_node_count
    location_policy      = "ANY"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  # Surge one node at a time: GPU quota is usually the limit, and workers drain gracefully.
  upgrade_settings {
    max_surge       = 1
    max_unavailable = 0
  }

  node_config {
    machine_type    = local.gpu_hardware[each.value.hardware].machine_type
    spot            = each.value.spot
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = each.value.disk_size_gb
    service_account = google_service_account.gke_nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    resource_labels = local.labels

    # GKE also labels GPU nodes cloud.google.com/gke-accelerator=<accelerator type> (and, when
    # time-shared, cloud.google.com/gke-gpu-sharing-strategy=time-sharing); the worker manifests
    # select on those. These labels name the pool in the catalog's terms.
    labels = {
      "maas-hardware"    = each.value.hardware
      "maas-gpu-sharing" = each.value.max_shared_clients_per_gpu > 1 ? "time-sharing" : "exclusive"
      "maas-capacity"    = each.value.spot ? "spot" : "on-demand"
    }

    # Only pods that tolerate the GPU taint (the model workers) land on these expensive nodes.
    taint {
      key    = "nvidia.com/gpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }

    # Spot pools (issue 35) run only the batch workers (`model-batch-*`, which tolerate this and select
    # cloud.google.com/gke-spot=true): an interactive worker never lands on a node that can be preempted with
    # 30 s notice. A preempted batch worker hands its lines back in the 15 s GKE gives its pods; lines it could
    # not are redelivered when their leases lapse, and answered once (the results store).
    dynamic "taint" {
      for_each = each.value.spot ? toset(["spot"]) : toset([])
      content {
        key    = "maas-capacity"
        value  = taint.value
        effect = "NO_SCHEDULE"
      }
    }

    guest_accelerator {
      type  = local.gpu_hardware[each.value.hardware].accelerator_type
      count = 1

      gpu_driver_installation_config {
        gpu_driver_version = "LATEST"
      }

      # Time-sharing lets several small-model workers share one GPU; a pool with one client per
      # GPU gives each worker the whole device.
      dynamic "gpu_sharing_config" {
        for_each = each.value.max_shared_clients_per_gpu > 1 ? toset([each.value.max_shared_clients_per_gpu]) : toset([])
        content {
          gpu_sharing_strategy       = "TIME_SHARING"
          max_shared_clients_per_gpu = gpu_sharing_config.value
        }
      }
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
  }

  lifecycle {
    precondition {
      condition     = contains(keys(local.gpu_hardware), each.value.hardware)
      error_message = "gpu_node_pools[*].hardware must be one of the catalog hardware classes: ${join(", ", keys(local.gpu_hardware))}."
    }
  }
}
