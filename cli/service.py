"""``dilu service <name> [OPTIONS]``: run one service in the foreground (hyphenated names)."""
from __future__ import annotations

import importlib

import click

from dilu.services.common.cliopts import service_main

SERVICES = {
    "profiler": "profiler",
    "scheduler": "scheduler",
    "vertical-scaler": "vertical_scaler",
    "horizontal-scaler": "horizontal_scaler",
    "node-agent": "node_agent",
    "gateway": "gateway",
}


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("name", required=False)
@click.pass_context
def service(ctx: click.Context, name: str | None) -> None:
    """Run service NAME (profiler, scheduler, vertical-scaler, horizontal-scaler, node-agent, gateway;
    underscores work too); its own options follow: ``dilu service NAME --help``."""
    if name in (None, "--help", "-h"):
        click.echo(ctx.get_help())
        ctx.exit(0 if name else 2)  # named without a service, as a group without its command
    key = name.replace("_", "-")
    if key not in SERVICES:
        raise click.BadParameter(f"{name!r} is not a service; choose from {', '.join(sorted(SERVICES))}", param_hint="NAME")
    module = importlib.import_module(f"dilu.services.{SERVICES[key]}.__main__")
    service_main(module.main, args=ctx.args, prog_name=f"dilu service {key}")
