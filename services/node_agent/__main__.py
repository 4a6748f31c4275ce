"""``python -m dilu.services.node_agent`` (also ``dilu service node-agent``)."""
from __future__ import annotations

from pathlib import Path

import click

from dilu.services.common.cliopts import (Finite, check_creds, check_node, default_node, log_level_option, metrics_port_option,
                                        nats_options, service_main)

from dilu.services.common.functions import SAMPLE_MS
from dilu.services.common.runner import run
from dilu.services.common.digits import as_count

from . import devices
from .service import NodeAgent


def parse_gpus(value: str) -> int | None:
    """``--gpus``: ``all`` (None: every GPU NVML reports, or 4 on an emulated node), a count 1..64,
    or ``cpu`` (returned as 0: a CPU node). Raises click.BadParameter otherwise."""
    if value == "cpu":
        return 0
    if value == "all":
        return None
    n = as_count(value)
    if n is None:
        raise click.BadParameter(f"expected a GPU count, 'all' or 'cpu', got {value!r}")
    if not 1 <= n <= 64:
        raise click.BadParameter(f"GPU count must be 1..64, got {n}")
    return n


@click.command()
@nats_options
@click.option("--node", default=default_node, show_default="host name", callback=check_node,
              help="this node's name in subjects and the inventory")
@click.option("--device", type=click.Choice(devices.MODES), default="auto", show_default=True,
              help="nvml: this host's GPUs through NVML and the real driver; emulated: the fake NVML and driver; "
                   "auto: nvml when a GPU is there, else emulated")
@click.option("--gpus", default="all", show_default=True, callback=lambda _c, _p, v: (v, parse_gpus(v)),
              help="GPUs to use: all (an emulated node has 4), a count, or 'cpu' for a CPU node (torch handlers)")
@click.option("--emulated-gpu", type=click.Choice(sorted(devices.EMULATED_GPUS)), default=devices.DEFAULT_EMULATED,
              show_default=True, help="model of the emulated GPUs")
@click.option("--gpu-memory-bytes", type=click.IntRange(2**30, 2**44), default=None,
              help="device memory of each emulated GPU, bytes (default: the model's)")
@click.option("--sms", type=click.IntRange(1, 1024), default=None, help="SMs of each emulated GPU (default: the model's)")
@click.option("--mps-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="MPS pipe and log directories go here on a real GPU (default: $XDG_RUNTIME_DIR/dilu-mps, else /tmp/dilu-mps)")
@click.option("--sample-ms", type=Finite(1, 1000), default=SAMPLE_MS, show_default=True)
@click.option("--telemetry-ms", type=Finite(10, 10000), default=250.0, show_default=True)
@click.option("--instance-creds", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              envvar="DILU_INSTANCE_CREDS", callback=check_creds,
              help="NATS credentials the instances connect with (the instance role); TLS files are the agent's")
@click.option("--initial-grant", type=click.Choice(["request", "limit"]), default="request", show_default=True)
@metrics_port_option("node_agent")
@log_level_option
def main(nats, node, device, gpus, emulated_gpu, gpu_memory_bytes, sms, mps_dir, sample_ms, telemetry_ms, initial_grant,
         instance_creds, metrics_port, log_level):
    """Run the node agent: discover this node's GPUs, run its instances, publish telemetry, apply grants."""
    agent = NodeAgent(node=node, gpus=gpus[1], device=device, emulated_model=emulated_gpu,
                      memory_bytes=gpu_memory_bytes, sms=sms, mps_dir=mps_dir, sample_ms=sample_ms, telemetry_ms=telemetry_ms,
                      initial_grant=initial_grant, nats=nats,
                      instance_creds=instance_creds)
    run(agent, nats, metrics_port=metrics_port, log_level=log_level)


if __name__ == "__main__":
    service_main(main)
