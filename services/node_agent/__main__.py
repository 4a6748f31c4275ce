"""``python -m dilu.services.node_agent`` (also ``dilu service node-agent``)."""
from __future__ import annotations

import click

from dilu.services.common.runner import run

from .service import NodeAgent


def parse_gpus(value: str) -> int:
    """``--gpus``: a count 1..64 of emulated GPUs, or ``cpu`` (returned as 0). Raises
    click.BadParameter otherwise."""
    if value == "cpu":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise click.BadParameter(f"expected a GPU count or 'cpu', got {value!r}") from None
    if not 1 <= n <= 64:
        raise click.BadParameter(f"GPU count must be 1..64, got {n}")
    return n


@click.command()
@click.option("--nats-url", default="nats://127.0.0.1:4222", show_default=True, envvar="DILU_NATS_URL")
@click.option("--node", default="node0", show_default=True, envvar="DILU_NODE")
@click.option("--gpus", default="4", show_default=True, help="emulated GPUs on this node, or 'cpu' for a CPU node (torch handlers)")
@click.option("--gpu-memory-gb", type=click.FloatRange(1, 1024), default=40.0, show_default=True)
@click.option("--sms", type=click.IntRange(1, 1024), default=108, show_default=True, help="SMs per emulated GPU (A100: 108)")
@click.option("--sample-ms", type=click.FloatRange(1, 1000), default=10.0, show_default=True)
@click.option("--telemetry-ms", type=click.FloatRange(10, 10000), default=250.0, show_default=True)
@click.option("--initial-grant", type=click.Choice(["request", "limit"]), default="request", show_default=True)
@click.option("--metrics-port", type=int, default=0, show_default=True, envvar="DILU_METRICS_PORT")
@click.option("--log-level", default="info", show_default=True)
def main(nats_url, node, gpus, gpu_memory_gb, sms, sample_ms, telemetry_ms, initial_grant, metrics_port, log_level):
    """Run the node agent: instances on this node's GPUs, telemetry, grants."""
    agent = NodeAgent(node=node, gpus=parse_gpus(gpus), gpu_memory_gb=gpu_memory_gb, sms=sms, sample_ms=sample_ms,
                      telemetry_ms=telemetry_ms, initial_grant=initial_grant, nats_url=nats_url)
    run(agent, nats_url, metrics_port=metrics_port, log_level=log_level)


if __name__ == "__main__":
    main()
