"""``python -m dilu.services.profiler [--nats-url URL] [--metrics-port N] [--node NAME] [--backend node|surface]``."""
from __future__ import annotations

import click

from dilu.services.common.cliopts import Finite, log_level_option, metrics_port_option, nats_options, service_main

from ..common.runner import run
from .service import ProfilerService


@click.command()
@nats_options
@metrics_port_option("profiler")
@click.option("--node", default="", help="Node agent that runs profiling trials (default: the first node in the dilu-nodes inventory with a healthy GPU).")
@click.option("--backend", type=click.Choice(["node", "surface"]), default="node", show_default=True,
              help="node: trials on the node agent's emulated GPU; surface: the model's recorded A100 surface.")
@click.option("--repeats", type=click.IntRange(1, 100), default=5, show_default=True, help="Batches per trial.")
@click.option("--trial-timeout-s", type=Finite(0.1, 3600), default=30.0, show_default=True)
@log_level_option
def main(nats, metrics_port, node, backend, repeats, trial_timeout_s, log_level) -> None:
    """The profiler service."""
    run(ProfilerService(node=node, backend=backend, repeats=repeats, trial_timeout_s=trial_timeout_s),
        nats, metrics_port=metrics_port, log_level=log_level)


if __name__ == "__main__":
    service_main(main)
