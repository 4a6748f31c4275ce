"""``python -m dilu.services.profiler [--nats-url URL] [--metrics-port N] [--node NAME] [--backend node|surface]``."""
from __future__ import annotations

import click

from dilu.services.common.cliopts import METRICS_PORTS, service_main

from ..common.runner import run
from .service import ProfilerService


@click.command()
@click.option("--nats-url", default="nats://127.0.0.1:4222", show_default=True)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=METRICS_PORTS["profiler"], show_default=True,
              help="/metrics, /healthz, /readyz (0: any free port).")
@click.option("--node", default="", help="Node agent that runs profiling trials (default: the first node in the dilu-nodes inventory with a healthy GPU).")
@click.option("--backend", type=click.Choice(["node", "surface"]), default="node", show_default=True,
              help="node: trials on the node agent's emulated GPU; surface: the model's recorded A100 surface.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Batches per trial.")
@click.option("--trial-timeout-s", type=float, default=30.0, show_default=True)
@click.option("--log-level", default="info", show_default=True)
def main(nats_url, metrics_port, node, backend, repeats, trial_timeout_s, log_level) -> None:
    """The profiler service."""
    run(ProfilerService(node=node, backend=backend, repeats=repeats, trial_timeout_s=trial_timeout_s),
        nats_url, metrics_port=metrics_port, log_level=log_level)


if __name__ == "__main__":
    service_main(main)
