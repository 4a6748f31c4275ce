"""The simulator against the live platform on the demo's configuration (one node, 4 emulated
GPUs, the 16 busiest functions, the same trace span and seed, no training jobs): ``dilu demo``
and ``dilu sim --speedup`` replay the same requests under the same policy objects, the simulator
with the overheads ``dilu calibrate`` measures from the live run's own logs (process start, a
request's way in and back, a batch's service beyond the simulated one), four draws of them, as
``dilu crosscheck`` does (it refuses a simulation that offers other requests than the live
run); README, At cluster scale, the cross-check table. On this 30 s span they must agree within
30 % on active GPU·s (the last run: 90.0 live, 91.7 simulated, the mean of four draws): the
start-up weighs more on 30 s than on the README's 60 s runs, where GPU·s agree within 15 % of
the mean of repeated live runs (within 5 % in all six rows). The SLO violation rate, the
cold-start requests and the launches are reported, not asserted (1.7 %, 2 and 20 live against
2.0 %, 8.8 and 25.8 simulated in that run). The live run is also the end-to-end check of a
whole demo and of what it leaves for calibration: its report accounts for every request, every
answer carried the instance's times into ``requests.jsonl``, and it leaves no process behind."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proctree import alive, tree

pytestmark = [pytest.mark.nats, pytest.mark.native, pytest.mark.slow]

DILU = [sys.executable, "-m", "dilu.cli.main"]
SEED, DURATION_S, SPEEDUP = 2, 30, 10
DRAWS = 4  # simulations of the live run, each drawing its overheads anew (dilu crosscheck --draws)
GPU_S_REL = 0.30  # the live spread on this span (see above); the 15 % is for the 60 s runs


def _run(args, path: Path, timeout_s: float) -> tuple[dict, str]:
    """The command's JSON and what it printed (a line never wrapped: as piped)."""
    out = subprocess.run([*DILU, *args, "--json", str(path)], capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(path.read_text()), out.stdout


def _demo(args, path: Path, timeout_s: float) -> dict:
    """Run ``dilu demo``, watching every process it starts; its report, once all of them ended."""
    proc = subprocess.Popen([*DILU, "demo", *args, "--json", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= tree(proc.pid)  # every service, instance and nats-server it started
        time.sleep(0.5)
    out = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0]
    assert proc.returncode == 0, out[-3000:]
    assert len(seen) >= 6, "expected nats-server and five services as child processes"
    time.sleep(1)
    assert alive(seen) == [], "processes left behind by the demo"
    assert "policy dilu" in out
    return json.loads(path.read_text())


def _accounts(r: dict, functions: int) -> None:
    """The report accounts for every request, function and mechanism it claims."""
    t = r["totals"]
    assert t["offered"] > 0 and t["offered"] == t["completed"] + t["dropped"] + t["failed"] + t["timed_out"]
    assert t["offered"] == sum(f["offered"] for f in r["functions"])
    assert len(r["functions"]) == functions and t["completed"] > 0.9 * t["offered"]
    assert 0 <= t["allocation_fragmentation"] <= 1 and 0 <= t["idle_fragmentation"] <= 1
    assert t["active_gpu_seconds"] > 0 and t["instance_launches"] >= functions
    m = r["mechanism"]
    assert m["profiler_trials"] > 0 and m["scale_outs"] >= functions


def test_live_and_simulated_runs_agree(tmp_path: Path):
    logs = tmp_path / "logs"
    report = _demo(["--policy", "dilu", "--seed", str(SEED), "--duration", str(DURATION_S), "--speedup",
                    str(SPEEDUP), "--training-jobs", "0", "--log-dir", str(logs)], tmp_path / "live.json", 300)
    _accounts(report, 16)
    live = report["totals"]
    assert json.loads((logs / "dilu" / "report.json").read_text()) == report  # beside the request log
    # the emulated node's own overheads (process start, way in and back, a batch's service), not an A100 node's
    ov = tmp_path / "overheads.json"
    out = subprocess.run([*DILU, "calibrate", str(logs / "dilu"), "--json", str(ov)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    measured = json.loads(ov.read_text())
    assert measured["source"]["transport_samples"] == live["completed"]  # every answer carried the instance's times
    # the control loops as this run met them: the scaler's tick (500 ms plus its own work) and the
    # deploy's tick, from the info-level logs the demo keeps
    assert 500.0 <= measured["horizontal_tick_ms"] < 520.0
    (timing,) = measured["loop_timings"]
    assert timing["launches"] == 16 and 0 < timing["first_request_ms"] < 60_000 and timing["defrag_ms"] is not None
    # (dilu defragments: its rounds are whole intervals after the scheduler's start, or logged)
    xc, said_xc = _run(["crosscheck", str(logs / "dilu"), "--draws", str(DRAWS)], tmp_path / "xc.json", 300)
    # the footer says what the marks and the last column mean, and counts the rows within 15 %
    assert "*: the simulated mean is within 15 % of the live mean; of 1 seed and policy row, within it: SLO" in said_xc
    assert "SE: the difference (sim - live) in standard errors of the two means together" in said_xc
    (row,) = xc["rows"]
    assert row["seed"] == SEED and row["policy"] == "dilu" and row["runs"] == [str(logs / "dilu")]
    fig = row["figures"]
    assert len(fig["active GPU·s"]["sim"]["values"]) == DRAWS
    gpu_s = fig["active GPU·s"]["live"]["mean"], fig["active GPU·s"]["sim"]["mean"]
    assert gpu_s[0] == live["active_gpu_seconds"]
    reported = {k: (fig[k]["live"]["mean"], fig[k]["sim"]["mean"])
                for k in ("SLO violation rate", "cold-start requests", "instance launches")}
    said = {k: measured[k][50::49] for k in ("transport_ms", "batch_ms")}  # p50 and p99
    print("live, sim: active GPU·s", gpu_s, reported, "process start ms", measured["process_start_ms"], said)
    assert abs(gpu_s[0] - gpu_s[1]) <= GPU_S_REL * max(gpu_s), f"active GPU·s (live, sim) {gpu_s}; also {reported}"

    # a long cross-check says it is alive: before each run's calibration, then after a draw once
    # the progress period has passed (here every draw: each clock reading is 11 s on)
    from dilu.loadgen.sim import crosscheck as xcmod

    readings = iter(range(0, 10_000, 11))
    alive_at = []
    xcmod.crosscheck([logs / "dilu"], draws=3, progress=lambda d, done: alive_at.append((d, done)),
                     clock=lambda: next(readings))
    assert alive_at == [(logs / "dilu", 0), (logs / "dilu", 1), (logs / "dilu", 2)]
    assert "no loop timing measured" not in said_xc
    # a run without its horizontal scaler's log is cross-checked at drawn phases, and says so
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(logs / "dilu", bare)
    (bare / "horizontal_scaler.log").unlink()
    warned: list[str] = []
    xcmod.crosscheck([bare], draws=1, warn=warned.append)
    assert len(warned) == 1 and "no loop timing measured" in warned[0] and str(bare) in warned[0]
