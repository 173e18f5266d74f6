terraform {
  required_version = ">= 1.5"

  required_providers {
    # 6.14 is the first 6.x release where every argument used here (Cloud Run v2
    # deletion_protection, GKE GPU sharing and driver installation) is generally available.
    google = {
      source  = "hashicorp/google"
      version = "~> 6.14"
    }
    google-beta = {
      source  = "hashicorp/google-beta"
      version = "~> 6.14"
    }
  }
}

provider "google" {
  project = var.project_id
  region  = var.region
}

provider "google-beta" {
  project = var.project_id
  region  = var.region
}
