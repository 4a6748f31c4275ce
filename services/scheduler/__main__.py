"""``python -m dilu.services.scheduler --nats-url URL --gamma 1.5``: the cluster is what the node
agents publish in KV ``dilu-nodes`` (no node list here)."""
from __future__ import annotations

import click

from dilu.services.common.cliopts import (Finite, ZeroOrAtLeast, log_level_option, metrics_port_option, nats_options,
                                          service_main)
from dilu.services.common.policies import DEFRAG_INTERVAL_MIN_S, DEFRAG_INTERVAL_S
from dilu.services.common.runner import run

from .policy import ALLOCATIONS
from .service import SchedulerService


@click.command()
@nats_options
@metrics_port_option("scheduler")
@click.option("--gamma", type=Finite(1, 8), default=1.5, show_default=True, help="Cap on Σ limit quotas per GPU.")
@click.option("--defrag-interval-s", type=ZeroOrAtLeast(DEFRAG_INTERVAL_MIN_S, 86_400), default=None,
              help="Every this many seconds, move instances off lightly used GPUs onto fuller ones, each "
                   "drained once its replacement is ready, when the GPU time freed outweighs the launches "
                   f"(0: never; default: every {DEFRAG_INTERVAL_S:g} s under --policy dilu, never under "
                   "the baselines, which do not defragment)")
@click.option("--policy", type=click.Choice(ALLOCATIONS), default="dilu", show_default=True,
              help="dilu: request/limit from the profile; static-mps: fixed slice at the request; exclusive: whole GPUs")
@log_level_option
def main(nats, metrics_port, gamma, defrag_interval_s, policy, log_level) -> None:
    """The scheduler service: single writer of the dilu-placement table; its cluster is the
    node inventories in dilu-nodes."""
    if defrag_interval_s is None:
        defrag_interval_s = DEFRAG_INTERVAL_S if policy == "dilu" else 0.0
    run(SchedulerService(gamma, defrag_interval_s, policy), nats, metrics_port=metrics_port,
        log_level=log_level)


if __name__ == "__main__":
    service_main(main)
