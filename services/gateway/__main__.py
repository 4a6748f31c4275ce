"""``python -m dilu.services.gateway`` (also ``dilu service gateway``)."""
from __future__ import annotations

import sys

import click

from dilu.services.common.cliopts import Finite, log_level_option, metrics_port_option, nats_options, service_main
from dilu.services.common.invoke import MAX_TIMEOUT_S
from dilu.services.common.runner import StartFailed, run

from .app import MIB, Limits
from .service import HTTP_KEEP_ALIVE_S, Gateway


@click.command()
@nats_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address the HTTP API listens on (0.0.0.0 or :: for every interface)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="HTTP API port")
@click.option("--max-body-bytes", type=click.IntRange(1, 64 * MIB), default=8 * MIB, show_default=True,
              help="largest request payload, bytes (larger: 413); keep it within NATS's max_payload")
@click.option("--default-timeout-s", type=Finite(0.001, 900), default=30.0, show_default=True,
              help="reply timeout of a request without a Dilu-Timeout header, s")
@click.option("--max-timeout-s", type=Finite(0.001, MAX_TIMEOUT_S), default=900.0, show_default=True,
              help="largest Dilu-Timeout accepted, s (larger: 400)")
@click.option("--drain-s", type=Finite(0, 15), default=10.0, show_default=True,
              help="on stop, how long in-flight requests may still finish, s (then 503)")
@click.option("--http-keep-alive-s", type=Finite(0.001, 3600), default=HTTP_KEEP_ALIVE_S, show_default=True,
              help="how long an idle HTTP connection stays open, s; keep it above the idle timeout "
                   "of the load balancer or client pool in front, so that they close first")
@metrics_port_option("gateway")
@log_level_option
def main(nats, host, port, max_body_bytes, default_timeout_s, max_timeout_s, drain_s, http_keep_alive_s, metrics_port,
         log_level):
    """Run the HTTP gateway: invoke functions over HTTP (server-sent events for llm streams)."""
    if default_timeout_s > max_timeout_s:
        raise click.BadParameter(f"{default_timeout_s:g} is above --max-timeout-s {max_timeout_s:g}",
                                 param_hint="--default-timeout-s")
    limits = Limits(max_body_bytes=max_body_bytes, default_timeout_s=default_timeout_s, max_timeout_s=max_timeout_s)
    gateway = Gateway(host=host, port=port, limits=limits, drain_s=drain_s, keep_alive_s=http_keep_alive_s)
    try:
        gateway.check_address()  # a taken port fails now, not once NATS is reachable
    except StartFailed as exc:
        print(f"dilu gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    run(gateway, nats, metrics_port=metrics_port, log_level=log_level)


if __name__ == "__main__":
    service_main(main)
