"""``python -m dilu.services.scheduler --nats-url URL --nodes node0 --gpus 4 --gpu-memory-gb 40 --gamma 1.5``."""
from __future__ import annotations

import click

from ..common.runner import run
from .policy import ALLOCATIONS
from .service import GB, SchedulerService


@click.command()
@click.option("--nats-url", default="nats://127.0.0.1:4222", show_default=True)
@click.option("--metrics-port", type=int, default=0, show_default=True, help="/metrics, /healthz, /readyz (0: any free port).")
@click.option("--nodes", default="node0", show_default=True, help="Comma-separated node names.")
@click.option("--gpus", type=int, default=4, show_default=True, help="GPUs per node.")
@click.option("--gpu-memory-gb", type=float, default=40, show_default=True)
@click.option("--gamma", type=float, default=1.5, show_default=True, help="Cap on Σ limit quotas per GPU.")
@click.option("--defrag-interval-s", type=float, default=0.0, show_default=True,
              help="Plan and apply defragmenting migrations this often (0: never).")
@click.option("--policy", "allocation", type=click.Choice(ALLOCATIONS), default="dilu", show_default=True,
              help="dilu: request/limit from the profile; static-mps: fixed slice at the request; exclusive: whole GPUs")
@click.option("--log-level", default="info", show_default=True)
def main(nats_url, metrics_port, nodes, gpus, gpu_memory_gb, gamma, defrag_interval_s, allocation, log_level) -> None:
    """The scheduler service: single writer of the dilu-placement table."""
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    if not names:
        raise click.BadParameter("at least one node", param_hint="--nodes")
    run(SchedulerService(names, gpus, int(gpu_memory_gb * GB), gamma, defrag_interval_s, allocation), nats_url, metrics_port=metrics_port,
        log_level=log_level)


if __name__ == "__main__":
    main()
