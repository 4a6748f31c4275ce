"""``dilu service <name> [OPTIONS]``: run one service in the foreground (hyphenated names)."""
from __future__ import annotations

import importlib

import click

SERVICES = {
    "profiler": "profiler",
    "scheduler": "scheduler",
    "vertical-scaler": "vertical_scaler",
    "horizontal-scaler": "horizontal_scaler",
    "node-agent": "node_agent",
}


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("name", type=click.Choice(sorted(SERVICES)))
@click.pass_context
def service(ctx: click.Context, name: str) -> None:
    """Run service NAME; its own options follow (``dilu service NAME --help``)."""
    module = importlib.import_module(f"dilu.services.{SERVICES[name]}.__main__")
    module.main(args=ctx.args, prog_name=f"dilu service {name}")
