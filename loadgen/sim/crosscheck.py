"""``dilu crosscheck``: live runs against their simulation, each with its own run's overheads.

Each live run (a policy's log directory under ``dilu demo`` / ``dilu compare --log-dir``) is
simulated on its own plan and policy, ``draws`` times (``--overheads-seed`` 1..draws: other
draws of its overheads and another phase of the node agent's telemetry), with the
overheads :mod:`.calibrate` measures from that run alone: its way in and back, its batch
overhead, its pickups and dispatches, which say how loaded its machine was (one run's tail can be
twenty times another's on the same machine), its loop timing (its horizontal scaler's tick, when
its first request and a defragmentation round came after the deploy's tick: every draw replays
them, so its threshold decisions fall on the ticks they fell on live), its own deploy's launches
by launch order (when each was up: the keep-alive of an instance the deploy placed runs from its
readiness), and the process starts of the later launches of all the runs given (one run launches
too few instances for them). Runs of one comparison (:func:`dilu.loadgen.summary.span_key`) and policy form
a row; for each figure of :data:`FIGURES` a row holds the live runs' spread, the draws' spread,
the relative difference of the means and that difference in standard errors. README, At cluster
scale: the cross-check.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dilu.loadgen import report as rp
from dilu.loadgen.summary import Spread, span_key
from dilu.services.common.console import PROGRESS_EVERY_S

from . import calibrate as cal

FIGURES = ("SLO violation rate", "cold-start requests", "instance launches", "active GPU·s")
TOLERANCE = 0.15  # agreement: the simulated mean within 15 % of the live mean (the cross-check's margin)
# Draws of each run's overheads and loop phases: the README's table. A draw that meets a
# scale-out one tick later can double a run's late requests: on the twelve runs of the README,
# the violation rate's relative difference over draws 1-8, 9-16 and 17-24 spread by up to 31
# points in a row (seed 3: +47, +16, +38 %), over the two halves of 12 by up to 12 (2.5 min for
# 24 runs of 24 draws here).
DRAWS = 24


@dataclass(frozen=True)
class Figure:
    """One figure of one row: ``live`` over the live runs, ``sim`` over every draw of every run,
    ``sim_runs`` each run's mean over its draws (the samples of the simulated mean's standard
    error, as the live runs are of the live one's)."""

    live: Spread
    sim: Spread
    sim_runs: Spread

    @property
    def relative(self) -> float | None:
        """(simulated mean - live mean) / live mean; None when the live mean is 0."""
        return (self.sim.mean - self.live.mean) / self.live.mean if self.live.mean else None

    @property
    def within(self) -> bool:
        """Whether the simulated mean lies within :data:`TOLERANCE` of the live mean."""
        return abs(self.sim.mean - self.live.mean) <= TOLERANCE * abs(self.live.mean)

    @property
    def standard_errors(self) -> float | None:
        """The difference of the means over their combined standard error (live runs' and the
        runs' simulated means'); None with fewer than two runs or no spread at all."""
        a, b = self.live.stderr, self.sim_runs.stderr
        if a is None or b is None or math.hypot(a, b) == 0:
            return None
        return (self.sim.mean - self.live.mean) / math.hypot(a, b)


@dataclass(frozen=True)
class Row:
    """The runs of one comparison under one policy: their ``seed``, ``policy``, log directories
    (``runs``) and one :class:`Figure` per name of :data:`FIGURES`."""

    seed: int
    policy: str
    runs: tuple[str, ...]
    figures: dict[str, Figure]

    def to_dict(self) -> dict:
        return {"seed": self.seed, "policy": self.policy, "runs": list(self.runs),
                "figures": {name: {"live": f.live.to_dict(), "sim": f.sim.to_dict(), "sim_runs": f.sim_runs.to_dict(),
                                   "relative_difference": f.relative, "within_tolerance": f.within,
                                   "standard_errors": f.standard_errors} for name, f in self.figures.items()}}


def _plan(rep: rp.Report) -> dict[str, tuple[str, int]]:
    """What a run replays: function -> (model, requests offered)."""
    return {f.name: (f.model, f.offered) for f in rep.functions}


def crosscheck(log_dirs: list[Path], draws: int = DRAWS, min_batches: int = cal.MIN_BATCHES,
               progress: Callable[[Path, int], None] | None = None,
               clock: Callable[[], float] = time.monotonic,
               warn: Callable[[str], None] | None = None) -> list[Row]:
    """The rows of ``log_dirs`` (module docstring), in the order their first run is given.
    ``progress(log_dir, draws_done)`` is called before each run's calibration (0 done) and after
    a draw when :data:`PROGRESS_EVERY_S` have passed on ``clock`` (monotonic s) since it was
    last called, so that a long run (``--draws 1000``) shows it is alive. ``warn(line)`` is told
    of a run whose loop timing could not be measured (no horizontal scaler's log, or no initial
    scale in it): its draws meet the loops at drawn phases. Raises OSError,
    ValueError (:func:`calibrate.calibrate`'s) naming what cannot be used, ValueError for
    ``draws`` < 1 or for a live run whose simulation offers other requests (stopped early)."""
    from .run import Simulation, prepare

    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    runs = cal.read_runs(log_dirs)
    each = [cal.starts_of([run]) for run in runs]  # each run's log read once
    starts = cal.Starts([s for e in each for s in e.initial], [s for e in each for s in e.later])
    getters = {label: get for label, get, _fmt, _better in rp._COMPARE_ROWS if label in FIGURES}
    groups: dict[tuple, list[tuple[str, rp.Report, list[rp.Report]]]] = {}
    for run, own in zip(runs, each):
        d, live, _ = run
        if progress is not None:
            progress(d, 0)
            said = clock()
        try:
            ov = cal.measure([run], cal.own_deploy(own, starts), min_batches, log_dirs)
        except ValueError as exc:  # one run of many: say which
            raise ValueError(f"{d}: {exc}") from None
        if not ov.loop_timings and warn is not None:
            warn(f"{d}: no loop timing measured (its {cal.HORIZONTAL_LOG} is missing or holds no initial scale): "
                 "its draws meet the control loops at drawn phases")
        simulated = []
        work = None  # the run's plan and profiles, the same for every draw (as simulate() shares them)
        for k in range(1, draws + 1):
            cfg = cal.sim_config(live.run, len(live.training), overheads=ov, overheads_seed=k,
                                 process_start_ms=ov.start_ms,
                                 process_start_by_starting_ms=ov.process_start_by_starting_ms,
                                 process_start_initial_ms=ov.process_start_initial_ms, keep_records=False)
            work = work or prepare(cfg)
            sim = Simulation(cfg, live.run.policy, work).run()[0]
            if (sim.totals.offered, _plan(sim)) != (live.totals.offered, _plan(live)):
                raise ValueError(f"{d}: its simulation offers {sim.totals.offered:,} requests of other functions or "
                                 f"models than the live run's {live.totals.offered:,}: not a replay of its plan "
                                 f"(a run stopped early, or a report edited?)")
            simulated.append(sim)
            if progress is not None and k < draws and clock() - said >= PROGRESS_EVERY_S:
                progress(d, k)
                said = clock()
        groups.setdefault((span_key(live.run), live.run.policy), []).append((str(d), live, simulated))
    rows = []
    for members in groups.values():
        figures = {}
        for name in FIGURES:
            get = getters[name]
            figures[name] = Figure(Spread.of([get(live) for _, live, _ in members]),
                                   Spread.of([get(s) for _, _, sims in members for s in sims]),
                                   Spread.of([sum(get(s) for s in sims) / len(sims) for _, _, sims in members]))
        first = members[0][1].run
        rows.append(Row(first.seed, first.policy, tuple(d for d, _, _ in members), figures))
    return rows
