"""``dilu summarize``: several runs of one comparison as the mean and range of each figure, and
each policy against the first by the ratio of the means with its range run by run
(:mod:`dilu.loadgen.summary`)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from dilu.services.common.cliopts import flag_envvar, writable_output, write_output


def _distinct(run_files) -> None:
    """Raise ValueError for a file given twice (it would count as two runs)."""
    seen: dict[Path, str] = {}
    for path in run_files:
        real = Path(path).resolve()
        if real in seen:
            also = "" if seen[real] == path else f" (as {seen[real]})"
            raise ValueError(f"{path} is given twice{also}: each run counts once")
        seen[real] = path


@click.command("summarize")
@click.argument("run_files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_output,
              envvar=flag_envvar("--json"), show_envvar=True,
              help='also write the summary as JSON: {"files", "runs", "policies": {P: {figure: {mean, min, max, '
                   'stderr, values}}}, "versus": {"P / FIRST": {figure: {of_means, per_run}}}}')
def summarize(run_files, json_path) -> None:
    """Summarise RUN_FILES, each written by dilu compare --json, dilu sim --json or dilu demo
    --json (runs of the same comparison): per policy, each
    figure's mean over the runs with the lowest and highest run; per policy after the first,
    the ratio of its mean to the first's (for a rate, the difference in percentage points) with
    the lowest and highest of that comparison run by run. One live run is one sample; read a
    direction from the means and how often the runs agree. Runs of other spans (trace, start
    minute, seed, duration, speed-up, functions), on other numbers of GPUs, with other numbers
    of training jobs, of a policy with another parking delay or defragmentation interval,
    simulated runs with another keep-alive, process start or tick, with --overheads beside
    runs without, or a simulated run beside a live one are refused (other overheads files and
    draws of other --overheads-seed are not: each live run's calibration is its machine's), and
    so are a file given twice and one with no run in it."""
    from dilu.cli.demo import make_console
    from dilu.loadgen import summary

    if json_path and any(Path(json_path).resolve() == Path(p).resolve() for p in run_files):
        raise click.BadParameter(f"{json_path} is one of the runs: the summary would overwrite it",
                                 param_hint="'--json'")
    try:
        _distinct(run_files)
        runs = [(path, summary.read_runs(path)) for path in run_files]
        summary.check_comparable(runs)
        summary.check_same_simulation(run_files)
        result = summary.summarize([reports for _, reports in runs])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="RUN_FILES") from None
    console = make_console()
    summary.render_summary(result, console)
    if json_path:
        write_output(json_path, json.dumps({"files": list(run_files), **result.to_dict()}, indent=2))
        console.print(f"summary written to {json_path}")
