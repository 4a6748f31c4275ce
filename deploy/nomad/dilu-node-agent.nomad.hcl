# Dilu node agent: one per GPU node (system job).
#
# The agent launches and retires this node's instances by watching the placement table, creates one
# shared-memory control block per instance in /dev/shm, samples the interceptor's counters from it
# every few ms (GpuTelemetry, KernelCycleStretch) and writes the vertical scaler's TokenGrants into it.
#
# Instances are child processes of the agent and are started with
#   LD_PRELOAD=<var.interceptor_lib>
# (the agent reads the path from DILU_INTERCEPTOR_LIB), so every CUDA driver call they make goes
# through the interceptor. The agent itself is never preloaded: it does not launch kernels.
#
# The agent names itself after the Nomad node (DILU_NODE) and publishes its GPUs, found through
# NVML, to the dilu-nodes KV bucket; the scheduler places onto whatever nodes are there.
#
# Why raw_exec: the agent and its instances need the host's /dev/nvidia* devices, the MPS control
# pipe if MPS is used, and a /dev/shm that agent and instances share; the exec driver's chroot and
# private /dev would hide them. The device block makes Nomad place the agent only where the NVIDIA
# device plugin reports GPUs and accounts them to it; instances inherit its allocation, so its
# memory reservation must cover them (var.memory_mb).
#
#   nomad job run -var='nats_url=nats://nats.dilu.internal:4222' -var='gpus_per_node=8' \
#     deploy/nomad/dilu-node-agent.nomad.hcl

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

variable "gpus_per_node" {
  description = "GPUs the agent manages on each node (all of them: instances share GPUs via quotas)"
  type        = number
  default     = 1
}

variable "interceptor_lib" {
  description = "Built interceptor shared object, preloaded into every instance"
  type        = string
  default     = "/opt/dilu/interceptor/build/libdilu_intercept.so"
}

variable "memory_mb" {
  description = "Host memory for the agent and all instances it launches on the node (MiB)"
  type        = number
  default     = 65536
}

job "dilu-node-agent" {
  type        = "system"
  datacenters = var.datacenters

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

  group "node-agent" {
    restart {
      attempts = 5
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    network {
      port "metrics" {
        static = 9105
      }
    }

    service {
      name     = "dilu-node-agent"
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

    task "node-agent" {
      driver = "raw_exec"
      # root is not required; the user needs read-write access to /dev/nvidia* (group video or
      # render on most distributions) and to /dev/shm.
      user = var.run_user

      config {
        command = "${var.venv}/bin/python"
        args = [
          "-m", "dilu.services.node_agent",
          "--nats-url", var.nats_url,
          "--metrics-port", "${NOMAD_PORT_metrics}",
        ]
      }

      env {
        DILU_NATS_URL        = var.nats_url
        DILU_METRICS_HOST    = "${NOMAD_IP_metrics}"
        DILU_LOG_LEVEL       = var.log_level
        DILU_NODE            = "${node.unique.name}"
        DILU_DEVICE          = "nvml"
        DILU_MPS_DIR         = "${NOMAD_TASK_DIR}/mps"
        DILU_INTERCEPTOR_LIB = var.interceptor_lib
        PYTHONUNBUFFERED     = "1"
      }

      # Stopping the agent drains and stops its instances (each answers the batch in hand; queued
      # requests wait in the work queue). Their placements stay: the agent relaunches them when it
      # starts again within the node TTL (15 s); after that the scheduler places them elsewhere.
      kill_signal  = "SIGTERM"
      kill_timeout = "35s"

      logs {
        max_files     = 5
        max_file_size = 50
      }

      resources {
        cpu    = 2000
        memory = var.memory_mb

        device "nvidia/gpu" {
          count = var.gpus_per_node
        }
      }
    }
  }
}
