"""``python -m dilu.services.scheduler --nats-url URL --gamma 1.5``: the cluster is what the node
agents publish in KV ``dilu-nodes`` (no node list here)."""
from __future__ import annotations

import click

from dilu.services.common.cliopts import METRICS_PORTS, service_main
from dilu.services.common.runner import run

from .policy import ALLOCATIONS
from .service import SchedulerService


@click.command()
@click.option("--nats-url", default="nats://127.0.0.1:4222", show_default=True)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=METRICS_PORTS["scheduler"], show_default=True,
              help="/metrics, /healthz, /readyz (0: any free port).")
@click.option("--gamma", type=click.FloatRange(min=1), default=1.5, show_default=True, help="Cap on Σ limit quotas per GPU.")
@click.option("--defrag-interval-s", type=float, default=0.0, show_default=True,
              help="Plan and apply defragmenting migrations this often (0: never).")
@click.option("--policy", "allocation", type=click.Choice(ALLOCATIONS), default="dilu", show_default=True,
              help="dilu: request/limit from the profile; static-mps: fixed slice at the request; exclusive: whole GPUs")
@click.option("--log-level", default="info", show_default=True)
def main(nats_url, metrics_port, gamma, defrag_interval_s, allocation, log_level) -> None:
    """The scheduler service: single writer of the dilu-placement table; its cluster is the
    node inventories in dilu-nodes."""
    run(SchedulerService(gamma, defrag_interval_s, allocation), nats_url, metrics_port=metrics_port,
        log_level=log_level)


if __name__ == "__main__":
    service_main(main)
