"""``dilu profile``: run the profiler's procedure (:class:`.policy.ProfileSearch`, the same one the
profiler service drives) on a recorded surface and compare with the exhaustive optimum."""
from __future__ import annotations

import json
from pathlib import Path

import click
from rich import box
from rich.table import Table

from dilu.services.common.cliopts import Finite, writable_output, write_output
from dilu.services.common.console import PipeConsole

from .policy import QUEUEING_BUDGET, NoFeasibleSetting, ProfileSearch
from .surface import SurfaceBackend, SurfaceError, load_surface, run_search, surface_files

SLO_FACTORS = (2.0, 3.0, 5.0)

# Every column of the printed table, defined once: the legend under the table and --help.
LEGEND = (
    ("SLO ms", "request latency SLO (ms); a batch must finish in --queueing-budget x it"),
    ("quota", "request quota: the token grant (share of GPU SM-time) an instance needs as deployed"),
    ("batch", "batch size served at the request quota"),
    ("limit", "limit quota: the instance's SM width; its burst batch meets the SLO there"),
    ("lat ms", "latency (ms) of one batch as deployed: width = limit, paced to the request quota"),
    ("TE", "throughput efficacy: requests/s at the request quota / request quota"),
    ("optimum TE", "best TE of any grid point within the bound, unpaced (width = grant)"),
    ("TE/opt", "TE / optimum TE (below 1: pacing at the limit costs quota, or an early stop)"),
    ("trials", "trials the search measured / trials of an exhaustive search"),
)


def profile_surface(path: Path, slo_ms: float, stop_threshold: float = 0.15,
                    queueing_budget: float = QUEUEING_BUDGET, deployed: bool = True) -> dict:
    """Profile one surface at one request SLO (ms) as the profiler service does: batch latency
    within ``queueing_budget`` × ``slo_ms``, limit knee, the burst batch measured at the limit,
    and (``deployed``, one-axis surfaces) the request raised until its batch meets the bound at
    width = limit paced to it (paced trials answered by ``models.pacing_stretch``).
    A dict of the choice, its trial count and the exhaustive optimum under the same latency bound
    (unpaced: width = grant at every grid point).

    Raises NoFeasibleSetting when no grid point meets the bound, SurfaceError for a bad file.
    """
    surf = load_surface(path)
    bound = slo_ms * queueing_budget
    opt = surf.exhaustive(bound)
    if opt is None:
        raise NoFeasibleSetting(f"{path.name}: no grid point meets the SLO of {slo_ms:.4g} ms "
                                f"(batch latency ≤ {bound:.4g} ms)")
    backend = SurfaceBackend(surf)
    search = ProfileSearch("inference", surf.batches, surf.quota_axes, slo_ms, queueing_budget=queueing_budget,
                           stop_threshold=stop_threshold, deployed=deployed)
    res = run_search(search, backend)
    return {
        "surface": str(path),
        "format": surf.fmt,
        "slo_ms": slo_ms,
        "batch_latency_bound_ms": bound,
        "baseline_latency_ms": surf.baseline_latency_ms(),
        "request_quota": res.request_quota,
        "request_setting": list(res.request_setting),
        "batch_size": res.batch_size,
        "limit_quota": res.limit_quota,
        "limit_setting": list(res.limit_setting),
        "burst_batch": res.burst_batch,
        "te": res.te,
        "latency_ms": res.latency_ms,
        "throughput_rps": res.throughput_rps,
        "limit_latency_ms": res.limit_latency_ms,
        "limit_throughput_rps": res.limit_throughput_rps,
        "trials": backend.trials,
        "optimum": {
            "te": opt.te, "quota": opt.quota, "setting": list(opt.setting), "batch": opt.batch,
            "trials": opt.trials,
        },
        "te_ratio": res.te / opt.te,
        "trial_ratio": backend.trials / opt.trials,
    }


def _legend_text() -> str:
    return "\n".join(f"{name}: {text}" for name, text in LEGEND)


@click.command("profile", epilog="Columns:\n\n\b\n" + _legend_text())
@click.option("--surface", "surface_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Surface CSV (a100-mps or v100-sm-quota format). Without it: every shipped surface.")
@click.option("--slo-ms", type=Finite(min=0, min_open=True, max=1e7), help="Request latency SLO in ms. Default: 2, 3 and 5 × batch-1 full-GPU latency.")
@click.option("--queueing-budget", type=Finite(min=0, min_open=True, max=1), default=QUEUEING_BUDGET,
              show_default=True, help="Share of the SLO a batch may take (a request waits for the batch ahead).")
@click.option("--stop-threshold", type=Finite(min=0, max=1), default=0.15, show_default=True,
              help="Relative TE margin below the best within which the search keeps growing.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), callback=writable_output,
              help="Write the results here.")
def profile(surface_path: Path | None, slo_ms: float | None, queueing_budget: float, stop_threshold: float,
            json_path: Path | None) -> None:
    """Profile on a recorded surface: request/limit quota, batch, TE and trials vs the exhaustive optimum.

    The request quota is profiled as an instance is deployed: at SM width = its limit, paced by
    tokens to its request (on the surfaces with one quota axis).
    """
    paths = [surface_path] if surface_path else surface_files()
    rows: list[dict] = []
    try:
        for path in paths:
            base = load_surface(path).baseline_latency_ms()
            for slo in [slo_ms] if slo_ms else [f * base for f in SLO_FACTORS]:
                try:
                    rows.append(profile_surface(path, slo, stop_threshold, queueing_budget))
                except NoFeasibleSetting as exc:
                    if slo_ms:  # the SLO the user asked for cannot be met: bad input (exit 2), saying why
                        raise click.BadParameter(str(exc), param_hint="--slo-ms") from None
    except SurfaceError as exc:  # bad input: the surface given, or one of those bundled (exit 2)
        raise click.BadParameter(str(exc), param_hint="--surface") from None
    if json_path:  # first: the figures are kept even when the reader of the output leaves
        out = rows[0] if surface_path and slo_ms else rows
        write_output(json_path, json.dumps(out, indent=2) + "\n")
    _print(rows)


def _print(rows: list[dict]) -> None:
    # light borders, so that the longest surface name fits whole beside the figures in 100 columns
    names = [Path(r["surface"]).stem for r in rows]
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
    table.add_column("surface", no_wrap=True, min_width=max(map(len, names), default=7))
    for name, _ in LEGEND:
        table.add_column(name, no_wrap=True)
    for r in rows:
        table.add_row(
            Path(r["surface"]).stem, f"{r['slo_ms']:.1f}", f"{r['request_quota']:.3f}", str(r["batch_size"]),
            f"{r['limit_quota']:.3f}", f"{r['latency_ms']:.1f}", f"{r['te']:.1f}", f"{r['optimum']['te']:.1f}",
            f"{r['te_ratio']:.3f}", f"{r['trials']}/{r['optimum']['trials']}",
        )
    console = PipeConsole(width=100)  # a reader that leaves ends the command with 141
    console.print(table)
    console.print(_legend_text(), highlight=False)
