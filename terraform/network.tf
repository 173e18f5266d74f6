# The private network: GKE nodes and pods, Cloud Run's direct VPC egress (to reach Redis), and the
# Memorystore peering all live here.

resource "google_compute_network" "maas" {
  name                    = var.network_name
  auto_create_subnetworks = false
  routing_mode            = "REGIONAL"

  depends_on = [google_project_service.enabled]
}

resource "google_compute_subnetwork" "gke" {
  name          = "${var.network_name}-gke"
  network       = google_compute_network.maas.id
  region        = var.region
  ip_cidr_range = var.gke_nodes_cidr

  # Private nodes reach Artifact Registry, GCS (weights, payloads) and Pub/Sub without public IPs.
  private_ip_google_access = true

  secondary_ip_range {
    range_name    = local.gke_pods_range_name
    ip_cidr_range = var.gke_pods_cidr
  }

  secondary_ip_range {
    range_name    = local.gke_services_range_name
    ip_cidr_range = var.gke_services_cidr
  }

  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# Cloud Run instances take their egress IPs from this subnet (direct VPC egress); it is separate so
# API scale-out never competes with GKE nodes for addresses.
resource "google_compute_subnetwork" "cloud_run" {
  name                     = "${var.network_name}-cloud-run"
  network                  = google_compute_network.maas.id
  region                   = var.region
  ip_cidr_range            = var.cloud_run_egress_cidr
  private_ip_google_access = true

  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.5
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# Private nodes have no public IPs; NAT lets them reach anything outside Google APIs (e.g. a
# third-party webhook receiver) without exposing them.
resource "google_compute_router" "maas" {
  name    = "${var.network_name}-router"
  network = google_compute_network.maas.id
  region  = var.region
}

resource "google_compute_router_nat" "maas" {
  name                               = "${var.network_name}-nat"
  router                             = google_compute_router.maas.name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

# Nothing outside the VPC may open connections to it. GKE adds its own higher-priority rules for
# control-plane-to-node traffic; this makes the default explicit and logs what it drops.
resource "google_compute_firewall" "deny_external_ingress" {
  name      = "${var.network_name}-deny-external-ingress"
  network   = google_compute_network.maas.id
  direction = "INGRESS"
  priority  = 65534

  source_ranges = ["0.0.0.0/0"]

  deny {
    protocol = "all"
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}
