"""PNG plots of a ``dilu sim`` comparison (matplotlib, Agg backend: no display needed), one line
per policy: active GPUs over time, the CDF of latency / SLO, cold-start requests over time, and
allocation and idle fragmentation over time. Inputs are the JSON of :func:`run.simulate`: the
reports and each policy's ``timeline`` rows ``[t_s, active GPUs, cold-start requests so far,
allocation fragmentation, idle fragmentation]`` (fragmentation over each sample interval)."""
from __future__ import annotations

from pathlib import Path


def write_plots(out: dict, directory: Path) -> list[Path]:
    """Write ``active_gpus.png``, ``latency_cdf.png``, ``cold_starts.png`` and
    ``fragmentation.png`` into ``directory`` (created); returns their paths. The CDF is drawn
    from each policy's ``latency_slo_cdf`` ([fraction, latency / SLO] of the completed requests).
    Raises OSError when the directory cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    facts = out["sim"]["policies"]
    paths = []

    def save(fig, ax, title: str, xlabel: str, ylabel: str, name: str, legend_size: str | None = None) -> None:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=legend_size)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = directory / name
        fig.savefig(path, dpi=100, metadata={"Software": None})  # no version stamp: same run, same bytes
        plt.close(fig)
        paths.append(path)

    def series(col: int, title: str, ylabel: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(8, 4))
        for policy, f in facts.items():
            rows = f["timeline"]
            ax.plot([r[0] / 3600.0 for r in rows], [r[col] for r in rows], label=policy, linewidth=1)
        save(fig, ax, title, "trace time (h)", ylabel, name)

    series(1, "Active GPUs", "GPUs holding an instance", "active_gpus.png")
    series(2, "Cold-start requests (cumulative)", "requests", "cold_starts.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    for policy, f in facts.items():
        rows = f["timeline"]
        hours = [r[0] / 3600.0 for r in rows]
        line, = ax.plot(hours, [r[3] * 100 for r in rows], label=f"{policy} allocation", linewidth=1)
        ax.plot(hours, [r[4] * 100 for r in rows], label=f"{policy} idle", linewidth=1, linestyle="--",
                color=line.get_color())
    ax.set_ylim(0, 100)
    save(fig, ax, "Fragmentation (allocation: solid, idle: dashed)", "trace time (h)", "% of active GPUs",
         "fragmentation.png", legend_size="small")

    fig, ax = plt.subplots(figsize=(8, 4))
    for policy, f in facts.items():
        cdf = f.get("latency_slo_cdf") or []
        if cdf:
            ax.step([r for _, r in cdf], [q for q, _ in cdf], where="post", label=policy, linewidth=1)
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    save(fig, ax, "Latency CDF, normalised by each function's SLO",
         "latency / SLO (completed requests; right of 1: SLO missed)", "fraction of requests", "latency_cdf.png")
    return paths
