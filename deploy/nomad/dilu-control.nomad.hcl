# Dilu control plane: the profiler, the scheduler, the horizontal scaler and the HTTP gateway (one
# group each).
#
#   nomad job run -var='nats_url=nats://nats.dilu.internal:4222' deploy/nomad/dilu-control.nomad.hcl
#
# Each service runs as `python -m dilu.services.<package> --nats-url URL --metrics-port PORT` from
# the venv, logs JSON lines to stderr (Nomad keeps them: `nomad alloc logs -stderr`), and serves
# /metrics, /healthz and /readyz on its metrics port. On SIGTERM it stops taking work, finishes what
# is in flight and drains its NATS connection within 30 s; kill_timeout leaves a margin over that
# (the client's max_kill_timeout must be at least as large, its default is 30s).
#
# One instance of each: the scheduler serialises placements through the placement table's
# compare-and-set, and the horizontal scaler's burst windows must see all of a function's load;
# running two of either would double decisions. See docs/operations.md, "Scaling".

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

job "dilu-control" {
  type        = "service"
  datacenters = var.datacenters

  # Control-plane services need no GPU: prefer other nodes, but run on GPU nodes if that is all
  # the cluster has.
  affinity {
    attribute = "${meta.dilu_gpu}"
    value     = "true"
    weight    = -50
  }

  # Roll one group at a time; a new version must pass /readyz for min_healthy_time, else revert.
  update {
    max_parallel      = 1
    health_check      = "checks"
    min_healthy_time  = "15s"
    healthy_deadline  = "3m"
    progress_deadline = "10m"
    auto_revert       = true
  }

  group "profiler" {
    count = 1

    restart {
      attempts = 3
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    network {
      port "metrics" {
        static = 9101
      }
    }

    service {
      name     = "dilu-profiler"
      provider = "nomad"
      port     = "metrics"
      tags     = ["dilu", "prometheus"]

      # Readiness: NATS connected and every subscription live. Gates deployments.
      check {
        name     = "readyz"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "2s"
      }

      # Liveness: the process answers at all. Three misses restart the task.
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

    task "profiler" {
      driver = "raw_exec"
      user   = var.run_user

      config {
        command = "${var.venv}/bin/python"
        args = [
          "-m", "dilu.services.profiler",
          "--nats-url", var.nats_url,
          "--metrics-port", "${NOMAD_PORT_metrics}",
        ]
      }

      env {
        DILU_NATS_URL     = var.nats_url
        DILU_METRICS_HOST = "${NOMAD_IP_metrics}"
        DILU_LOG_LEVEL    = var.log_level
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

  group "scheduler" {
    count = 1

    restart {
      attempts = 3
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    network {
      port "metrics" {
        static = 9102
      }
    }

    service {
      name     = "dilu-scheduler"
      provider = "nomad"
      port     = "metrics"
      tags     = ["dilu", "prometheus"]

      # Readiness: NATS connected and every subscription live. Gates deployments.
      check {
        name     = "readyz"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "2s"
      }

      # Liveness: the process answers at all. Three misses restart the task.
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

    task "scheduler" {
      driver = "raw_exec"
      user   = var.run_user

      config {
        command = "${var.venv}/bin/python"
        args = [
          "-m", "dilu.services.scheduler",
          "--nats-url", var.nats_url,
          "--metrics-port", "${NOMAD_PORT_metrics}",
        ]
      }

      env {
        DILU_NATS_URL     = var.nats_url
        DILU_METRICS_HOST = "${NOMAD_IP_metrics}"
        DILU_LOG_LEVEL    = var.log_level
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

  group "horizontal-scaler" {
    count = 1

    restart {
      attempts = 3
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    network {
      port "metrics" {
        static = 9103
      }
    }

    service {
      name     = "dilu-horizontal-scaler"
      provider = "nomad"
      port     = "metrics"
      tags     = ["dilu", "prometheus"]

      # Readiness: NATS connected and every subscription live. Gates deployments.
      check {
        name     = "readyz"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "2s"
      }

      # Liveness: the process answers at all. Three misses restart the task.
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

    task "horizontal-scaler" {
      driver = "raw_exec"
      user   = var.run_user

      config {
        command = "${var.venv}/bin/python"
        args = [
          "-m", "dilu.services.horizontal_scaler",
          "--nats-url", var.nats_url,
          "--metrics-port", "${NOMAD_PORT_metrics}",
        ]
      }

      env {
        DILU_NATS_URL     = var.nats_url
        DILU_METRICS_HOST = "${NOMAD_IP_metrics}"
        DILU_LOG_LEVEL    = var.log_level
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

  # The HTTP gateway: stateless, so count may be raised; its ports are static, so each copy
  # needs a host of its own (distinct_hosts). Put a load balancer in front of dilu-gateway-http.
  group "gateway" {
    count = 1

    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    restart {
      attempts = 3
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    network {
      port "metrics" {
        static = 9106
      }
      port "http" {
        static = 8080
      }
    }

    service {
      name     = "dilu-gateway"
      provider = "nomad"
      port     = "metrics"
      tags     = ["dilu", "prometheus"]

      # Readiness: NATS connected and the function list loaded. Gates deployments.
      check {
        name     = "readyz"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "2s"
      }

      # Liveness: the process answers at all. Three misses restart the task.
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

    # The HTTP API, for load balancers: in rotation only while ready.
    service {
      name     = "dilu-gateway-http"
      provider = "nomad"
      port     = "http"
      tags     = ["dilu", "http"]

      check {
        name     = "api-readyz"
        type     = "http"
        path     = "/readyz"
        interval = "10s"
        timeout  = "2s"
      }
    }

    task "gateway" {
      driver = "raw_exec"
      user   = var.run_user

      config {
        command = "${var.venv}/bin/python"
        args = [
          "-m", "dilu.services.gateway",
          "--nats-url", var.nats_url,
          "--port", "${NOMAD_PORT_http}",
          "--metrics-port", "${NOMAD_PORT_metrics}",
        ]
      }

      env {
        DILU_NATS_URL     = var.nats_url
        DILU_HOST         = "${NOMAD_IP_http}"
        DILU_METRICS_HOST = "${NOMAD_IP_metrics}"
        DILU_LOG_LEVEL    = var.log_level
        PYTHONUNBUFFERED  = "1"
      }

      # SIGTERM: in-flight requests get the drain time (10 s), the rest are answered 503.
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
