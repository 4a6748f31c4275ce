"""``python -m dilu.services.horizontal_scaler`` (also ``dilu service horizontal-scaler``)."""
from __future__ import annotations

import click

from dilu.services.common.cliopts import Finite, log_level_option, metrics_port_option, nats_options, service_main

from dilu.services.common.policies import PARK_AFTER_S
from dilu.services.common.runner import run

from .policy import IDLE_BINS, MODES, TICK_MS, HorizontalConfig
from .service import HorizontalScaler

# The longest window (s) of any of the time options below. ``dilu demo`` and ``dilu chaos`` divide
# the trace-time windows by their --speedup (cli.demo.scaler_windows), down to 0.01, so a minute's
# stable window becomes 6,000 s and the keep-alive 60,000 s: one ceiling, a day, takes them all.
WINDOW_MAX_S = 86_400


@click.command()
@nats_options
@click.option("--mode", type=click.Choice(MODES), default="lazy", show_default=True,
              help="lazy: scale out once vertical headroom is used (dilu); kpa: Knative's KPA as it ships, "
                   "scale to zero after a stable window + grace idle (horizontal-only); eager: on load alone, "
                   "dilu's keep-alive (static-mps, exclusive)")
@click.option("--initial-scale", type=click.IntRange(0, 1000), default=HorizontalConfig.initial_scale, show_default=True,
              help="instances a newly deployed function gets before its first request (Knative's initial-scale)")
@click.option("--tick-ms", type=Finite(10, 60_000), default=TICK_MS, show_default=True)
@click.option("--stable-window-s", type=Finite(0.1, WINDOW_MAX_S), default=HorizontalConfig.stable_window_s, show_default=True)
@click.option("--panic-window-pct", type=Finite(1, 100), default=HorizontalConfig.panic_window_pct, show_default=True)
@click.option("--panic-threshold", type=Finite(1.01, 100), default=HorizontalConfig.panic_threshold, show_default=True,
              help="panic when the panic estimate reaches this multiple of the ready instances")
@click.option("--keep-alive-s", type=Finite(0, WINDOW_MAX_S), default=HorizontalConfig.keep_alive_s, show_default=True,
              help="fixed keep-alive while the idle-time histogram is not representative (lazy, eager)")
@click.option("--scale-to-zero-grace-s", type=Finite(0, WINDOW_MAX_S), default=HorizontalConfig.scale_to_zero_grace_s, show_default=True,
              help="kpa: the last instance goes this long after a stable window with no request "
                   "(Knative's scale-to-zero-grace-period)")
@click.option("--idle-bin-s", type=Finite(0.1, WINDOW_MAX_S), default=HorizontalConfig.idle_bin_s, show_default=True,
              help=f"idle-time histogram bin width (its range is {IDLE_BINS} bins)")
@click.option("--target", type=Finite(0, 10_000), default=0.0, show_default=True,
              help="in-flight requests per instance for every function (0: each profile's batch size)")
@click.option("--headroom-min", type=Finite(0, 8), default=HorizontalConfig.headroom_min, show_default=True,
              help="lazy: vertical headroom (quota) below which it counts as used up")
@click.option("--lazy-max-hold-s", type=Finite(0, 3600), default=HorizontalConfig.lazy_max_hold_s, show_default=True,
              help="lazy: scale out anyway after headroom stayed unused this long (0: one panic window)")
@click.option("--max-scale-up-rate", type=Finite(1.01, 10_000), default=HorizontalConfig.max_scale_up_rate, show_default=True,
              help="at most this many times the ready instances per decision (Knative's max-scale-up-rate)")
@click.option("--scale-down-delay-s", type=Finite(0, WINDOW_MAX_S), default=HorizontalConfig.scale_down_delay_s, show_default=True,
              help="no scale-in to a non-zero count this long after a scale-out (Knative's scale-down-delay)")
@click.option("--park-after-s", type=Finite(0, WINDOW_MAX_S), default=PARK_AFTER_S, show_default=True,
              help="park an idle function's instances after this long within its keep-alive: their GPU share "
                   "and device memory are given back, their weights wait in host memory (0: never; the "
                   "default is the dilu policy's, as --mode lazy is)")
@click.option("--target-utilization", type=Finite(0.01, 1), default=HorizontalConfig.target_utilization,
              show_default=True,
              help="scale an instance without vertical headroom (kpa, eager; a rigid function in lazy mode) "
                   "at this fraction of its in-flight target (Knative's container-concurrency-target-percentage)")
@metrics_port_option("horizontal_scaler")
@log_level_option
def main(nats, mode, initial_scale, tick_ms, stable_window_s, panic_window_pct, panic_threshold, keep_alive_s,
         scale_to_zero_grace_s, idle_bin_s,
         target, headroom_min, lazy_max_hold_s, max_scale_up_rate, scale_down_delay_s, park_after_s, target_utilization,
         metrics_port, log_level):
    """Run the horizontal scaler: backlog, burst windows and headroom in, placements and retirements out."""
    config = HorizontalConfig(mode=mode, initial_scale=initial_scale, stable_window_s=stable_window_s, panic_window_pct=panic_window_pct,
                              panic_threshold=panic_threshold, keep_alive_s=keep_alive_s,
                              scale_to_zero_grace_s=scale_to_zero_grace_s, idle_bin_s=idle_bin_s,
                              headroom_min=headroom_min,
                              lazy_max_hold_s=lazy_max_hold_s, max_scale_up_rate=max_scale_up_rate,
                              scale_down_delay_s=scale_down_delay_s, park_after_s=park_after_s,
                              target_utilization=target_utilization)
    scaler = HorizontalScaler(config, tick_s=tick_ms / 1000.0, target=target)
    run(scaler, nats, metrics_port=metrics_port, log_level=log_level)


if __name__ == "__main__":
    service_main(main)
