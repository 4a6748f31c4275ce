"""``python -m dilu.services.vertical_scaler`` (also ``dilu service vertical-scaler``)."""
from __future__ import annotations

import click

from dilu.services.common.cliopts import (Finite, check_node, default_node, log_level_option, metrics_port_option,
                                        nats_options, service_main)

from dilu.services.common.runner import run

from .policy import KNOB_MODES, MODES, VerticalConfig
from .service import VerticalScaler


@click.command()
@nats_options
@click.option("--node", default=default_node, show_default="host name", callback=check_node,
              help="this node's name in subjects and the inventory")
@click.option("--mode", type=click.Choice(MODES), default="dilu", show_default=True,
              help="dilu: adaptive; static: pinned at request; static-limit: pinned at limit; off: no grants; "
                   "published: Dilu as its paper describes it (20/40-sample windows, AIMD on training)")
@click.option("--hysteresis", type=Finite(0, 0.5), default=0.02, show_default=True, help="smallest quota change sent")
@click.option("--pressure-hold-ms", type=Finite(0, 60_000), default=500.0, show_default=True,
              help="dilu mode: how long a pressured instance stays at its limit after the last signal")
@click.option("--recovery-per-s", type=Finite(0.001, 100), default=0.5, show_default=True,
              help="dilu mode: additive recovery of yielding instances (quota per second)")
@click.option("--release-per-s", type=Finite(0.001, 10_000), default=0.5, show_default=True,
              help="dilu mode: how fast an instance whose demand fell gives share back (quota per second)")
@click.option("--decrease-factor", type=Finite(0.01, 0.99), default=0.5, show_default=True,
              help="dilu and published modes: multiplicative decrease of yielding instances on pressure")
@click.option("--be-floor", type=Finite(0.01, 1), default=0.05, show_default=True,
              help="the least quota a best-effort instance is granted")
@click.option("--park-idle/--no-park-idle", default=False, show_default=True,
              help="dilu mode only: give share nobody asked for to latency-sensitive instances, up to their limits")
@metrics_port_option("vertical_scaler")
@log_level_option
def main(nats, node, mode, hysteresis, pressure_hold_ms, recovery_per_s, release_per_s, decrease_factor, be_floor,
         park_idle, metrics_port, log_level):
    """Run the vertical scaler of NODE: telemetry and kernel-cycle stretch in, TokenGrants out."""
    ctx = click.get_current_context()
    unread = [f"--{name.replace('_', '-')}" for name, modes in KNOB_MODES.items()
              if mode not in modes and ctx.get_parameter_source(name).name != "DEFAULT"
              and ctx.params[name] is not False]  # --no-park-idle asks for nothing
    if unread:
        raise click.UsageError(f"--mode {mode} does not read {', '.join(unread)}")
    try:
        config = VerticalConfig(mode=mode, hysteresis=hysteresis, pressure_hold_ms=pressure_hold_ms,
                                recovery_per_s=recovery_per_s, release_per_s=release_per_s,
                                decrease_factor=decrease_factor, be_floor=be_floor, park_idle=park_idle)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    run(VerticalScaler(node, config), nats, metrics_port=metrics_port, log_level=log_level)


if __name__ == "__main__":
    service_main(main)
