# Dilu vertical scaler: one per GPU node (system job), next to that node's agent.
#
# It consumes the node's GpuTelemetry and KernelCycleStretch events and publishes TokenGrants on
# dilu.v1.grant.issued.<node>.<gpu>, reacting within milliseconds; running it on the node keeps the
# telemetry → grant loop off the network between nodes. It needs no GPU access itself: everything
# goes through NATS.
#
#   nomad job run -var='nats_url=nats://nats.dilu.internal:4222' deploy/nomad/dilu-vertical-scaler.nomad.hcl

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

variable "venv" {
  description = "Virtual environment with Dilu installed (pip install dilu)"
  type        = string
  default     = "/opt/dilu/.venv"
}

variable "nats_url" {
  description = "NATS client URL; a DNS name resolving to the cluster members (servers gossip the rest)"
  type        = string
  default     = "nats://nats.dilu.internal:4222"
}

variable "log_level" {
  type    = string
  default = "info"
}

variable "run_user" {
  type    = string
  default = "dilu"
}

job "dilu-vertical-scaler" {
  type        = "system"
  datacenters = var.datacenters
  # Grants are latency critical: outrank batch work on the node.
  priority = 80

  # Only GPU nodes: mark them in the client configuration with meta { dilu_gpu = "true" }.
  constraint {
    attribute = "${meta.dilu_gpu}"
    value     = "true"
  }

  # Roll node by node; a node's new version must be ready before the next node is touched.
  update {
    max_parallel     = 1
    min_healthy_time = "10s"
    healthy_deadline = "3m"
    auto_revert      = true
  }

  group "vertical-scaler" {
    restart {
      attempts = 5
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    network {
      port "metrics" {
        static = 9104
      }
    }

    service {
      name     = "dilu-vertical-scaler"
      provider = "nomad"
      port     = "metrics"
      tags     = ["dilu", "prometheus"]

      check {
        name     = "readyz"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "2s"
      }

      check {
        name     = "healthz"
        type     = "http"
        path     = "/healthz"
        interval = "10s"
        timeout  = "2s"

        check_restart {
          limit = 3
          grace = "30s"
        }
      }
    }

    task "vertical-scaler" {
      driver = "raw_exec"
      user   = var.run_user

      config {
        command = "${var.venv}/bin/python"
        args = [
          "-m", "dilu.services.vertical_scaler",
          "--nats-url", var.nats_url,
          "--metrics-port", "${NOMAD_PORT_metrics}",
        ]
      }

      env {
        DILU_NATS_URL     = var.nats_url
        DILU_METRICS_HOST = "${NOMAD_IP_metrics}"
        DILU_LOG_LEVEL    = var.log_level
        DILU_NODE         = "${node.unique.name}"
        PYTHONUNBUFFERED  = "1"
      }

      kill_signal  = "SIGTERM"
      kill_timeout = "35s"

      logs {
        max_files     = 5
        max_file_size = 20
      }

      resources {
        cpu    = 1000
        memory = 512
      }
    }
  }
}
