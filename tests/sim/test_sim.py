"""dilu sim: deterministic per seed, the live report's schema (check-report.py), policies that
differ where they must, the scheduling workloads within the placement rules, one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dilu.cli.main import main
from dilu.loadgen.sim.run import SimConfig, Simulation, Workload, prepare, simulate, warm_up_ms
from dilu.services.common import models
from dilu.services.horizontal_scaler.policy import tick_order

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "services" / "scheduler" / "workloads"
SMALL = dict(functions=8, hours=0.05, nodes=1, gpus_per_node=4)


def _run(args: list[str], tmp_path: Path, name: str = "out.json") -> tuple[dict, str]:
    out = tmp_path / name
    r = CliRunner().invoke(main, ["sim", *args, "--json", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text()), out.read_text()


def _without_wall(text: str) -> str:
    data = json.loads(text)
    for facts in data["sim"]["policies"].values():
        facts.pop("compute_s")
    return json.dumps(data, sort_keys=True)


def test_same_seed_same_json_other_seed_differs(tmp_path):
    args = ["--functions", "8", "--hours", "0.05", "--policies", "dilu,horizontal-only", "--training-jobs", "0.25"]
    _, a = _run([*args, "--seed", "3"], tmp_path, "a.json")
    _, b = _run([*args, "--seed", "3"], tmp_path, "b.json")
    _, c = _run([*args, "--seed", "4"], tmp_path, "c.json")
    # byte-identical but for the real seconds each policy took (compute_s in "sim")
    assert _without_wall(a) == _without_wall(b)
    assert json.loads(a)["policies"] == json.loads(b)["policies"]
    assert json.loads(a)["policies"] != json.loads(c)["policies"]


def test_the_legend_says_simulated_seconds(tmp_path):
    r = CliRunner().invoke(main, ["sim", "--functions", "4", "--hours", "0.02", "--policies", "dilu,horizontal-only"],
                           env={"COLUMNS": "200"})
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "simulated seconds of the replay" in text and "per simulated second" in text
    assert "wall-clock" not in text


def test_a_training_fraction_that_rounds_to_no_job_says_so():
    def run(fraction):
        r = CliRunner().invoke(main, ["sim", "--functions", "2", "--hours", "0.01", "--nodes", "1", "--gpus-per-node",
                                      "2", "--policies", "dilu", "--training-jobs", fraction], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        return " ".join(r.output.split())

    assert "--training-jobs 0.1: 10% of 2 GPUs rounds to no job; simulated none" in run("0.1")
    assert "rounds to no job" not in run("0.5")  # one job on one of the two GPUs


def test_report_passes_check_report(tmp_path, check_report):
    data, _ = _run(["--functions", "8", "--hours", "0.05", "--policies",
                    "dilu,horizontal-only,static-mps,exclusive,dilu-published", "--training-jobs", "0.25"], tmp_path)
    assert set(data["policies"]) == {"dilu", "horizontal-only", "static-mps", "exclusive", "dilu-published"}
    r = subprocess.run([sys.executable, str(check_report), str(tmp_path / "out.json")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PROBLEM" not in r.stdout
    dilu = data["policies"]["dilu"]
    assert dilu["totals"]["offered"] > 0 and dilu["mechanism"]["profiler_trials"] > 0
    assert dilu["training"] and dilu["training"][0]["iterations"] > 0
    assert dilu["mechanism"]["grant_changes"] > 0 and dilu["mechanism"]["vertical_reaction_ms_p99"] is None  # not modelled
    facts = data["sim"]["policies"]["dilu"]
    assert facts["events"] > 0 and facts["peak_active_gpus"] >= 1 and facts["max_limit_sum"] <= 1.5 + 1e-9


def test_exclusive_pays_at_least_dilus_gpu_seconds():
    cfg = SimConfig(**SMALL, seed=1)
    out = simulate(cfg, ["dilu", "exclusive"])
    gpu_s = {p: r["totals"]["active_gpu_seconds"] for p, r in out["policies"].items()}
    assert gpu_s["exclusive"] >= gpu_s["dilu"] > 0


def test_vertical_headroom_saves_cold_starts_on_a_bursty_trace():
    """One function, idle then a burst several times one instance's request capacity: dilu's lazy
    scaler lets the instance burst to its limit; horizontal-only launches (cold) instances, and so
    does dilu-published, whose vertical scaling waits for a stretch that comes too late: the
    burst's batches follow each other without an idle gap, one kernel cycle that closes (and is
    reported) only when the queue has emptied."""
    from dilu.loadgen.arrivals import Invocation

    cfg = SimConfig(**SMALL, seed=1, park_after_s=0.0)  # held on its GPU through the idle minute
    base = prepare(cfg)
    spec = next(s for s in base.specs if s.model == "resnet152") if any(s.model == "resnet152" for s in base.specs) \
        else base.specs[0]
    profile = base.profiles[spec.name][0]
    rate = 1.6 * profile.throughput_rps  # requests/s: above the request's capacity, within the limit's
    invs, n = [], 0
    for k in range(int(rate * 20)):  # 20 s of burst after 60 s idle
        invs.append(Invocation(id=f"b{n:06d}", function=spec.name, scheduled_ns=int((60 + k / rate) * 1e9),
                               trace_minute=0))
        n += 1
    plan = base.plan.__class__(**{**{f: getattr(base.plan, f) for f in base.plan.__struct_fields__},
                                  "invocations": tuple(invs), "duration_s": 90.0})
    work = Workload(plan, [spec], {spec.name: base.profiles[spec.name]})
    cold, violations = {}, {}
    for p in ("dilu", "horizontal-only", "dilu-published"):
        rep, _ = Simulation(cfg, p, work).run()
        cold[p], violations[p] = rep.totals.cold_start_requests, rep.totals.slo_violation_rate
    assert cold["horizontal-only"] >= cold["dilu"]
    assert cold["horizontal-only"] > 0
    # the published policy raises an instance only on a kernel-cycle stretch, which one instance
    # alone shows only once its burst is over: it serves the burst at its request and scales out
    # as horizontal-only does
    assert cold["dilu-published"] > cold["dilu"] and violations["dilu-published"] > violations["dilu"]


@pytest.mark.parametrize("name", ["instances-100.txt", "instances-400.txt"])
def test_workload_limits_within_capacity(tmp_path, name):
    out = tmp_path / "w.json"
    r = CliRunner().invoke(main, ["sim", "--workload", str(WORKLOADS / name), "--nodes", "100", "--json", str(out)],
                           env={"COLUMNS": "100"})  # as piped: REPORT_WIDTH, whatever this shell's width
    assert r.exit_code == 0, r.output
    s = json.loads(out.read_text())["sim"]
    assert 0 < s["peak_active_gpus"] <= 400
    assert s["max_limit_sum"] <= s["gamma"] + 1e-9  # Σ limits on a GPU within the cap
    assert s["violations"] == 0 and s["lower_bound_peak"] <= s["peak_active_gpus"]
    # the table says each figure in words, beside its JSON key, within 100 columns
    rows = {line.split("│")[3].strip(): line.split("│")[1:3] for line in r.output.splitlines() if line.count("│") == 4}
    assert rows["peak_active_gpus"][0].strip() == "peak active GPUs"
    assert set(rows) == {"events", "peak_active_gpus", "lower_bound_peak", "mean_active_gpus", "max_limit_sum",
                         "allocation_fragmentation", "unplaced", "violations"}
    assert int(rows["peak_active_gpus"][1].replace(",", "")) == s["peak_active_gpus"]
    assert max(len(line) for line in r.output.splitlines()) <= 100


def test_workload_too_big_for_the_cluster_says_so(tmp_path):
    out = tmp_path / "w.json"
    r = CliRunner().invoke(main, ["sim", "--workload", str(WORKLOADS / "instances-100.txt"), "--nodes", "1",
                                  "--gpus-per-node", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    unplaced = json.loads(out.read_text())["sim"]["unplaced"]
    assert unplaced > 0 and f"{unplaced:,} instances found no GPU with room on 1 x 1 GPUs" in " ".join(r.output.split())
    r = CliRunner().invoke(main, ["sim", "--workload", str(WORKLOADS / "instances-100.txt"), "--nodes", "100"])
    assert "found no GPU with room" not in r.output


@pytest.mark.parametrize("args, words", [
    (["--policies", "dilu,nope"], "unknown policies nope"),
    (["--policies", ","], "no policy given"),
    (["--policies", ",dilu"], "an empty policy name"),
    (["--policies", "dilu,dilu"], "named twice"),
    (["--functions", "zero"], "expected a count"),
    (["--hours", "-1"], "--hours"),
    (["--training-jobs", "2"], "--training-jobs"),
    (["--start-minute", "5"], "outside the trace"),
    (["--hours", "nan"], "--hours"),  # refused while parsing (exit 2), not later by the simulator
    (["--speedup", "inf"], "--speedup"),
    (["--speedup", "1e-6"], "--speedup"),  # dilu demo's lower bound: below it a replay never ends
    (["--hours", "1e-9"], "holds no invocation"),
    (["--json", ""], "an empty path"),
])
def test_bad_input_is_one_line(args, words):
    r = CliRunner().invoke(main, ["sim", *args])
    assert r.exit_code == 2, r.output  # a bad option, never a failed run
    errors = [line for line in r.output.splitlines() if "Error" in line]
    assert len(errors) == 1 and words in r.output, r.output


def test_bad_workload_line_is_one_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("{'Time': 'nope'}\n")
    r = CliRunner().invoke(main, ["sim", "--workload", str(bad)])
    assert r.exit_code == 2 and "--workload" in r.output and "bad.txt:1" in r.output and len(r.output.strip().splitlines()) == 1, r.output


GOOD = ("{'Time': '2024-01-01 00:00:00', 'Action': 'start', 'Instance': {'service_name': 'a', "
        "'type': 'inference', 'gpu_num': 1, 'sm_requests': 0.3, 'sm_limits': 0.5, 'memory': [4]}}")


@pytest.mark.parametrize("text, words", [
    ("", "no events"),
    ("\n\n", "no events"),
    (GOOD.replace("'gpu_num': 1", "'gpu_num': 0"), "gpu_num must be a whole number"),
    (GOOD.replace("'gpu_num': 1", "'gpu_num': 1.5"), "gpu_num must be a whole number"),
    (GOOD.replace("'gpu_num': 1", "'gpu_num': 1e23"), "gpu_num must be a whole number"),
    (GOOD.replace("'gpu_num': 1", "'gpu_num': 1000"), "gpu_num must be a whole number"),
    (GOOD.replace("'gpu_num': 1", "'gpu_num': 2").replace("'inference'", "'training'"), "memory lists 1 GPUs for gpu_num 2"),
    (GOOD.replace("'gpu_num': 1", "'gpu_num': 2"), "only training spans several GPUs"),
    (GOOD.replace("0.5", "0.2"), "sm_requests <= sm_limits"),
    (GOOD.replace("'memory': [4]", "'memory': []"), "memory must be"),
    (GOOD.replace("'type': 'inference', ", ""), "missing 'type'"),
    ("__import__('os').system('true')", "not a dict literal"),
    ("[1, 2]", "expected a dict"),
])
def test_workload_refusals_say_what_is_wrong(tmp_path, text, words):
    bad = tmp_path / "w.txt"
    bad.write_text(text)
    r = CliRunner().invoke(main, ["sim", "--workload", str(bad)])
    assert r.exit_code == 2 and words in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert "0x" not in r.output and "KeyError" not in r.output  # no Python internals for people
    good = tmp_path / "ok.txt"
    good.write_text(GOOD + "\n")
    assert CliRunner().invoke(main, ["sim", "--workload", str(good), "--nodes", "1"]).exit_code == 0


def test_outputs_that_cannot_be_written_fail_in_one_line(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    r = CliRunner().invoke(main, ["sim", "--functions", "2", "--hours", "0.01", "--plots", str(afile / "p")])
    assert r.exit_code == 2 and "cannot write into" in r.output, r.output
    r = CliRunner().invoke(main, ["sim", "--functions", "2", "--hours", "0.01", "--json", "/dev/full"])
    assert r.exit_code == 1 and "cannot write /dev/full" in r.output and "Traceback" not in r.output, r.output


def test_the_span_is_checked_before_anything_is_simulated():
    """A start minute the trace does not hold is a bad option (exit 2, naming it); --hours past the
    trace's end is said before the first policy runs, not after the last."""
    r = CliRunner().invoke(main, ["sim", "--start-minute", "99999999", "--hours", "0.01"])
    assert r.exit_code == 2 and "'--start-minute'" in r.output and "outside the trace" in r.output, r.output
    r = CliRunner().invoke(main, ["sim", "--functions", "1", "--hours", "0.05", "--start-minute", "958",
                                  "--policies", "exclusive"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    warned = out.find("--hours 0.05: the trace has only 0.0333333 hours from its start minute")
    assert 0 <= warned < out.find("simulating policy exclusive"), r.output


def test_options_from_the_environment(tmp_path, monkeypatch):
    """Each option from its DILU_<FLAG>; the report file from DILU_JSON_PATH, while DILU_JSON=1
    (the switch that makes other commands print JSON) is not taken for a file named '1'."""
    out = tmp_path / "env.json"
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["sim"], env={"DILU_FUNCTIONS": "4", "DILU_HOURS": "0.02", "DILU_JSON": "1",
                                               "DILU_POLICIES": "exclusive", "DILU_JSON_PATH": str(out)})
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert list(data["policies"]) == ["exclusive"] and data["policies"]["exclusive"]["run"]["functions"] == 4
    assert not (tmp_path / "1").exists()


def test_plots_are_written(tmp_path):
    plots = tmp_path / "plots"
    r = CliRunner().invoke(main, ["sim", "--functions", "4", "--hours", "0.05", "--policies", "dilu,exclusive",
                                  "--plots", str(plots)])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["active_gpus.png", "cold_starts.png", "fragmentation.png", "latency_cdf.png"]
    assert all((plots / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)


def test_speedup_replays_the_live_plan_and_shrinks_the_windows():
    """--speedup S compresses trace time as dilu demo --speedup does: the same requests as the
    live replay's plan (same rule, same seed), in 1/S of the time, with the horizontal windows
    of the live replay at S (cli.demo.scaler_windows)."""
    from dilu.cli.demo import RunOptions, build_plan
    from dilu.loadgen.sim.run import horizontal_config

    cfg = SimConfig(functions=4, hours=1 / 6, speedup=10.0, seed=2)
    work = prepare(cfg)
    live, _, _ = build_plan(RunOptions(duration=60.0, speedup=10.0, seed=2, trace_dir=None, start_minute=None,
                                       functions=4, gpus="4", nats_url=None, log_dir=None, training_jobs=0,
                                       progress=False), "sim")
    assert work.plan.duration_s == pytest.approx(60.0)
    assert [(i.function, i.scheduled_ns) for i in work.plan.invocations] == \
        [(i.function, i.scheduled_ns) for i in live.invocations]
    assert horizontal_config("lazy", 10.0).stable_window_s == pytest.approx(6.0)
    assert horizontal_config("lazy", 1.0).stable_window_s == pytest.approx(60.0)
    # the idle histogram spans 240 bins, as the service's main sets it (6 s bins at speed-up 10)
    assert horizontal_config("lazy", 10.0).idle_range == pytest.approx(6.0 * 240)
    assert horizontal_config("lazy", 0.001).idle_bin_s * 240 == horizontal_config("lazy", 0.001).idle_range
    rep = Simulation(cfg, "dilu", work).run()[0]
    assert rep.totals.offered == len(live.invocations) and rep.run.speedup == 10.0
    with pytest.raises(ValueError, match="speedup"):
        SimConfig(speedup=0.0)


def test_progress_ticks_change_nothing_simulated(monkeypatch):
    from dilu.loadgen.sim import run as sim_run

    cfg = SimConfig(**SMALL, seed=5)
    quiet = simulate(cfg, ["dilu"])
    monkeypatch.setattr(sim_run, "PROGRESS_EVERY_S", 0.0)  # a tick at every timeline sample
    ticks: list = []
    loud = simulate(cfg, ["dilu"], tick=lambda p, done, total: ticks.append((p, done, total)))
    assert len(ticks) > 3 and all(p == "dilu" and 0 <= d <= t for p, d, t in ticks)
    assert [d for _, d, _ in ticks] == sorted(d for _, d, _ in ticks)
    for out in (quiet, loud):
        out["sim"]["policies"]["dilu"].pop("compute_s")
    assert quiet == loud


def test_gpu_time_ends_with_the_last_request_not_the_drain():
    """GPU time is integrated to the replay's end (the last request ended), as a live replay's
    is: a longer drain allowance changes nothing once every request has ended, and the GPU·s
    stay under the active GPUs' count times the span plus the drain."""
    runs = {d: Simulation(SimConfig(**SMALL, seed=1, drain_s=d), "dilu", prepare(SimConfig(**SMALL, seed=1, drain_s=d)))
            for d in (20.0, 120.0)}
    reports = {d: sim.run()[0] for d, sim in runs.items()}
    short, long = reports[20.0], reports[120.0]
    assert short.totals.offered == short.totals.completed  # every request ended before the drain did
    assert short.totals.active_gpu_seconds == pytest.approx(long.totals.active_gpu_seconds)
    assert [f.quota_seconds for f in short.functions] == pytest.approx([f.quota_seconds for f in long.functions])
    cut_s = (runs[20.0].cut.at_ms - runs[20.0].t0) / 1000.0
    assert SMALL["hours"] * 3600 <= cut_s < SMALL["hours"] * 3600 + 20.0
    assert short.totals.active_gpu_seconds <= runs[20.0].facts.peak_active_gpus * cut_s + 1e-6


def test_counters_stop_when_the_replay_ends_as_a_live_runs_do():
    """At speed-up 10 a keep-alive runs out in the drain after the last answer: those retirements
    are no longer the run's (a live run has stopped counting by then), nor is any launch."""
    cfg = SimConfig(functions=16, hours=1 / 6, speedup=10, seed=1)
    sim = Simulation(cfg, "horizontal-only", prepare(cfg))
    gone_at, placed_at = [], []
    gone, place = sim._gone, sim._place

    def record_gone(inst):
        gone_at.append(sim.loop.now)
        gone(inst)

    def record_place(f):
        placed_at.append(sim.loop.now)
        return place(f)

    sim._gone, sim._place = record_gone, record_place
    rep, _ = sim.run()
    end = sim.cut.at_ms
    assert any(t > end for t in gone_at)  # some did retire in the drain: the case is exercised
    assert rep.mechanism.retirements == sum(1 for t in gone_at if t <= end)
    assert rep.totals.instance_launches == sum(1 for t in placed_at if t <= end)


def test_an_interrupted_run_keeps_and_reports_the_policies_that_finished(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) during the second policy: the first one's report is still printed and
    written, nothing of the second is, and the exit status says how the run ended (130)."""
    from dilu.loadgen.sim import run as sim_run

    real = sim_run.Simulation.run

    def second_interrupted(self):
        if self.policy == "horizontal-only":
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(sim_run.Simulation, "run", second_interrupted)
    with pytest.raises(sim_run.Interrupted) as caught:
        simulate(SimConfig(**SMALL, seed=1), ["dilu", "horizontal-only"])
    assert list(caught.value.partial["policies"]) == ["dilu"] and caught.value.policy == "horizontal-only"
    out = tmp_path / "out.json"
    r = CliRunner().invoke(main, ["sim", "--functions", "8", "--hours", "0.05", "--json", str(out)])
    assert r.exit_code == 130, r.output
    assert "interrupted during horizontal-only: dilu finished" in r.output
    written = json.loads(out.read_text())
    assert list(written["policies"]) == ["dilu"]
    assert written["sim"]["interrupted"] == {"during": "horizontal-only", "policies_asked": ["dilu", "horizontal-only"]}


def test_keep_alive_and_process_start_move_what_they_should():
    """A shorter fallback keep-alive trades cold starts for GPU·s; a slower process start makes
    every cold start longer, so more requests wait for one (--keep-alive-s, --process-start-ms)."""
    def totals(**kw):
        cfg = SimConfig(functions=16, hours=0.5, nodes=1, gpus_per_node=4, seed=1, **kw)
        return simulate(cfg, ["dilu"])["policies"]["dilu"]["totals"]

    # 10 s: on 16 functions packed on two GPUs, a 30 s keep-alive frees no whole GPU (3,657 GPU·s,
    # as the default's); 10 s does (3,526)
    base, short = totals(), totals(keep_alive_s=10.0)
    assert short["cold_start_requests"] > base["cold_start_requests"]
    assert short["active_gpu_seconds"] < base["active_gpu_seconds"]
    slow = totals(keep_alive_s=10.0, process_start_ms=5000.0)
    assert slow["cold_start_requests"] > short["cold_start_requests"]
    with pytest.raises(ValueError, match="process_start_ms"):
        SimConfig(process_start_ms=-1.0)


def test_the_replay_starts_when_the_initial_instances_are_ready():
    """As the demo starts its replay once every function has a warm instance: a keep-alive
    shorter than a fixed warm-up (Knative's 9 s at speed-up 10) must not unload them first."""
    from dilu.loadgen.sim.run import warm_up_ms
    from dilu.services.common import models

    cfg = SimConfig(functions=16, hours=0.05, speedup=10, seed=2)
    work = prepare(cfg)
    longest = max(models.cold_start_ms(s.model) for s in work.specs)
    launched = [s.model for s in work.specs]
    assert warm_up_ms(cfg, launched, "kpa") == pytest.approx(cfg.process_start_ms + longest)
    sim = Simulation(cfg, "horizontal-only", work)
    sim.run()
    first = {}
    for k, inv in enumerate(sim.inv):
        first.setdefault(inv.function, k)
    early = [k for k in first.values() if sim.sched[k] - sim.t0 < 5000.0]  # well within the 9 s keep-alive
    assert early and not any(sim.cold[k] for k in early)


def test_the_replay_starts_within_a_new_functions_keep_alive():
    """A cold start longer than Knative's keep-alive (90 trace s, 9 s at --speedup 10) does not
    hold the replay back past it, live (the demo's wait, cli.demo.warm_up_limit_s) or simulated,
    and the keep-alive runs from each function's first ready instance: the slow initial
    instances are not scaled in before they could serve, and the functions' first requests
    after they are ready find them warm. dilu's fallback keep-alive (10 min) leaves the 30 s
    wait as it was."""
    from dilu.cli.demo import WARM_UP_TIMEOUT_S, warm_up_limit_s
    from dilu.loadgen.sim.run import warm_up_ms
    from dilu.services.common import models

    assert warm_up_limit_s("kpa", 10.0) == pytest.approx(9.0)
    assert warm_up_limit_s("lazy", 10.0) == WARM_UP_TIMEOUT_S
    assert warm_up_limit_s("kpa", 1.0) == WARM_UP_TIMEOUT_S
    assert warm_up_limit_s("lazy", 10.0, keep_alive_s=60.0) == pytest.approx(6.0)
    # the span (18 s from 9 s) ends before any initial instance has been ready for 9 s
    cfg = SimConfig(functions=16, hours=0.05, speedup=10, seed=2, process_start_ms=20_000.0, drain_s=1.0)
    work = prepare(cfg)
    launched = [s.model for s in work.specs]
    assert warm_up_ms(cfg, launched, "kpa") == pytest.approx(9000.0)
    assert warm_up_ms(cfg, launched, "lazy") > 20_000.0  # the cold start itself: within dilu's 30 s
    sim = Simulation(cfg, "horizontal-only", work)
    rep, facts = sim.run()
    assert facts.warm_up_s == pytest.approx(9.0) and sim.t0 == pytest.approx(9000.0)
    first_ready_ms = cfg.process_start_ms + min(models.cold_start_ms(s.model) for s in work.specs)
    assert first_ready_ms + 9000.0 > sim.end  # so no keep-alive may run out within the run
    assert rep.mechanism.scale_to_zero == 0  # no starting initial instance was given up

def test_a_span_longer_than_the_trace_says_what_was_simulated():
    r = CliRunner().invoke(main, ["sim", "--functions", "1", "--hours", "20", "--policies", "horizontal-only"])
    assert r.exit_code == 0, r.output
    assert "--hours 20: the trace has only 8 hours" in " ".join(r.output.split())


def test_refused_placements_are_said():
    r = CliRunner().invoke(main, ["sim", "--functions", "20", "--hours", "0.05", "--gpus-per-node", "1",
                                  "--policies", "exclusive"])
    assert r.exit_code == 0, r.output
    assert "placements refused (no GPU had room" in " ".join(r.output.split())


def test_options_a_workload_run_does_not_read_are_refused(tmp_path):
    r = CliRunner().invoke(main, ["sim", "--workload", str(WORKLOADS / "instances-100.txt"), "--policies", "dilu",
                                  "--seed", "3"])
    assert r.exit_code == 2
    assert "--policies, --seed do not apply" in " ".join(r.output.split())


def test_an_empty_plots_path_is_refused():
    r = CliRunner().invoke(main, ["sim", "--plots", ""])
    assert r.exit_code == 2 and "an empty path" in r.output


def test_a_profile_is_searched_once_per_cache_key_as_the_profiler_service_does():
    """Functions of one model, kind, SLO and max batch share one search: its trials count once."""
    from dilu.services.profiler.policy import cache_key

    work = prepare(SimConfig(functions=16, hours=1 / 6, speedup=10, seed=1))
    seen: dict = {}
    for s in work.specs:
        profile, trials = work.profiles[s.name]
        key = cache_key(s)
        if key in seen:
            assert trials == 0 and profile.request_quota == seen[key].request_quota
        else:
            assert trials > 0
            seen[key] = profile
    assert len(seen) < len(work.specs)  # some functions do share a key here


def test_a_lone_request_at_a_paced_instance_takes_the_token_buckets_time():
    """One request after an idle minute at an instance held at its request below its width: it
    takes what the interceptor's bucket allows (the burst, then the refill), shorter than the
    first-order L · w / q, and no shorter than the unpaced batch."""
    cfg = SimConfig(**SMALL, seed=1, park_after_s=0.0)  # held on its GPU through the idle minute
    sim, busy, rate = _lone_request(cfg)
    rep, _ = sim.run()
    want, _ = models.bucket_paced_ms(busy, models.kernels_per_batch("resnet152"), rate, models.BURST_MS)
    assert rep.totals.latency_ms.p50 == pytest.approx(want, abs=0.1)  # the HDR histogram's resolution
    assert busy < want < busy / rate


def _lone_request(cfg: SimConfig) -> tuple[Simulation, float, float]:
    """A simulation of one ResNet-152 request after an idle minute, with the busy time (ms) of
    its batch and its instance's token rate (request / limit)."""
    from dilu.loadgen.arrivals import Invocation

    base = prepare(cfg)
    spec = next(s for s in base.specs if s.model == "resnet152")
    profile = base.profiles[spec.name][0]
    assert profile.request_quota < profile.limit_quota  # paced at its request
    plan = base.plan.__class__(**{**{f: getattr(base.plan, f) for f in base.plan.__struct_fields__},
                                  "invocations": (Invocation(id="one", function=spec.name, scheduled_ns=60 * 10**9,
                                                             trace_minute=0),), "duration_s": 90.0})
    sim = Simulation(cfg, "dilu", Workload(plan, [spec], {spec.name: base.profiles[spec.name]}))
    return sim, models.latency_ms("resnet152", 1, profile.limit_quota), profile.request_quota / profile.limit_quota


def test_a_grant_written_while_a_batch_runs_paces_its_kernels_not_yet_launched():
    """The interceptor reads the grant at each launch and wakes a launch waiting for tokens: a
    grant raised to the width 10 ms into a paced batch lets its remaining kernels go unpaced, so
    the batch ends when the bucket's state at 10 ms and the new rate say, sooner than timed at
    its start (which the request would take without it: the test above)."""
    cfg = SimConfig(**SMALL, seed=1, park_after_s=0.0)
    sim, busy, rate = _lone_request(cfg)
    start = sim._start_batch

    def started(inst):
        start(inst)
        if inst.inflight:
            sim.loop.at(sim.loop.now + 10.0, lambda _: sim._fit(inst.gpu, inst, inst.width))

    sim._start_batch = started
    rep, _ = sim.run()
    kernels = models.kernels_per_batch("resnet152")
    charged, balance, free = models.bucket_charged(busy, kernels, rate, models.BURST_MS, 10.0)
    assert 0 < charged < kernels
    rest, _ = models.bucket_paced_ms(busy * (kernels - charged) / kernels, kernels - charged, 1.0, balance,
                                     free_ms=max(0.0, free - 10.0))
    unraised, _ = models.bucket_paced_ms(busy, kernels, rate, models.BURST_MS)
    assert rep.totals.latency_ms.p50 == pytest.approx(10.0 + rest, abs=0.1)  # the HDR histogram's resolution
    assert busy <= 10.0 + rest < unraised - 2.0


@pytest.mark.parametrize("args", [
    ["--workload", str(WORKLOADS / "instances-100.txt")],  # refused: --plots does not apply to a workload
    ["--functions", "2", "--hours", "0.01", "--start-minute", "100000000"],  # fails: past the trace's end
])
def test_a_refused_or_failed_run_creates_no_plots_directory(tmp_path, args):
    plots = tmp_path / "new" / "plots"
    r = CliRunner().invoke(main, ["sim", *args, "--plots", str(plots)])
    assert r.exit_code in (1, 2) and "Error" in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_functions_place_in_the_live_scalers_tick_order():
    """The initial instances go out largest first (tick_order), as the live scaler ticks its
    functions, not in deploy order (the busiest first): their GPUs then match a live run's."""
    cfg = SimConfig(functions=16, hours=0.01, speedup=10, seed=3)
    work = prepare(cfg)
    sim = Simulation(cfg, "dilu", work)
    placed: list[str] = []
    place = sim._place

    def record(f, *a, **kw):
        inst = place(f, *a, **kw)
        if inst is not None and sim.loop.now == 0.0:
            placed.append(f.name)
        return inst

    sim._place = record
    sim.run()
    deployed = [s.name for s in work.specs if work.profiles[s.name][0] is not None]
    key = {s.name: tick_order(work.profiles[s.name][0].limit_quota, s.memory_bytes, s.name) for s in work.specs}
    assert sorted(placed) == sorted(deployed) and placed == sorted(placed, key=key.get)
    assert placed != deployed  # this seed deploys a small function before a large one


def test_overheads_add_the_live_nodes_time_and_nothing_else():
    """--overheads (what ``dilu calibrate`` measures): a way in and back of 5 ms adds exactly 5 ms
    to every answered request and changes no decision, holding no instance; 5 ms more per batch
    holds the instance, so requests wait longer still (it also parts a busy instance's batches
    into kernel cycles of their own, node.Cycles, so its decisions may differ: its tail is not
    compared). (Overheads of 0 as the base: any overheads draw the control loops' phases, the
    same ones for the same seed.)"""
    from dilu.loadgen.sim.overheads import QUANTILE_POINTS, Overheads

    def totals(transport_ms: float, batch_ms: float) -> dict:
        ov = Overheads((transport_ms,) * QUANTILE_POINTS, (batch_ms,) * QUANTILE_POINTS)
        cfg = SimConfig(**SMALL, seed=2, overheads=ov)
        return simulate(cfg, ["dilu"])["policies"]["dilu"]["totals"]

    base, way, batch = totals(0, 0), totals(5.0, 0), totals(0, 5.0)
    for k in ("cold_start_requests", "instance_launches", "active_gpu_seconds", "completed"):
        assert way[k] == base[k], k
    assert way["latency_ms"]["p50"] == pytest.approx(base["latency_ms"]["p50"] + 5.0, rel=0.002)
    assert way["latency_ms"]["p99"] == pytest.approx(base["latency_ms"]["p99"] + 5.0, rel=0.002)
    assert batch["latency_ms"]["p50"] >= base["latency_ms"]["p50"] + 5.0 * 0.998


def test_a_defragmentation_round_prices_moves_with_what_the_live_scheduler_knows():
    """The live scheduler prices a move with the spec's cold start (the model's load,
    ``Placement.cold_start_ms``); it is not told a node's process start, so the simulated
    round is not either, whatever ``--process-start-ms`` says."""
    cfg = SimConfig(**SMALL, seed=2, process_start_ms=9000.0, defrag_interval_s=5.0)
    sim = Simulation(cfg, "dilu", prepare(cfg))
    rounds = []
    plan_round = sim.cluster.plan_round
    sim.cluster.plan_round = lambda placed: rounds.append(placed) or plan_round(placed)
    sim.run()
    priced = {p.cold_start_ms for placed in rounds for p in placed.values()}
    assert priced and priced <= {s.cold_start_ms for s in sim.work.specs}, priced

def test_a_live_nodes_control_loops_tick_at_drawn_phases():
    """With overheads (a live node's run) each draw meets the control loops at other phases, as
    live reruns do: the deploy's launches start up to half a horizontal tick sooner or later, and
    the replay with them; the telemetry and the defragmentation rounds at phases of their own;
    the same draw, the same phases. Without overheads every loop starts with the deploy (the
    idealised run)."""
    from dilu.loadgen.sim.overheads import QUANTILE_POINTS, Overheads
    from dilu.loadgen.sim.run import loop_phases

    plain = SimConfig(**SMALL, seed=2)
    assert loop_phases(plain, 3000.0) == (0.0, 0.0, 3000.0)
    ov = Overheads((0.0,) * QUANTILE_POINTS, (0.0,) * QUANTILE_POINTS)
    draws = [loop_phases(SimConfig(**SMALL, seed=2, overheads=ov, overheads_seed=k), 3000.0) for k in range(1, 41)]
    assert draws[0] == loop_phases(SimConfig(**SMALL, seed=2, overheads=ov, overheads_seed=1), 3000.0)
    for i, (tick, low) in enumerate(((plain.horizontal_tick_ms, -0.5), (plain.vertical_tick_ms, 0.0))):
        values = [d[i] for d in draws]
        assert all(low * tick <= v < (low + 1.0) * tick for v in values) and max(values) - min(values) > tick / 2
    assert all(0.0 < d[2] <= 3000.0 for d in draws) and len({d[2] for d in draws}) == len(draws)
    work = prepare(SimConfig(**SMALL, seed=2))
    starts = {Simulation(SimConfig(**SMALL, seed=2, overheads=ov, overheads_seed=k), "dilu", work).t0 for k in (1, 2)}
    assert starts == {Simulation(plain, "dilu", work).t0 + loop_phases(SimConfig(**SMALL, seed=2, overheads=ov,
                                                                                  overheads_seed=k), 0.0)[0]
                      for k in (1, 2)}


def test_an_overheads_file_sets_the_process_start_unless_it_is_given(tmp_path):
    from dilu.loadgen.sim.overheads import Overheads

    path = tmp_path / "ov.json"
    path.write_bytes(Overheads.from_samples([2.0], [1.0], 420.0, {"runs": ["x"]}, (400.0, 900.0)).to_json())
    args = ["--functions", "4", "--hours", "0.02", "--policies", "dilu", "--overheads", str(path)]
    data, _ = _run(args, tmp_path, "a.json")
    conf = data["sim"]["config"]
    assert conf["process_start_ms"] == 420.0 and conf["overheads"] == {"runs": ["x"]}
    assert conf["process_start_by_starting_ms"] == [400.0, 900.0]
    said = " ".join(CliRunner().invoke(main, ["sim", *args]).output.split())
    assert "process start 0: 400 ms, 1+: 900 ms" in said
    data, _ = _run([*args, "--process-start-ms", "300"], tmp_path, "b.json")  # one start for every launch
    assert data["sim"]["config"]["process_start_ms"] == 300.0
    assert data["sim"]["config"]["process_start_by_starting_ms"] == []
    other, _ = _run([*args, "--overheads-seed", "7"], tmp_path, "c.json")
    assert other["sim"]["config"]["overheads_seed"] == 7 and data["sim"]["config"]["overheads_seed"] == 1
    r = CliRunner().invoke(main, ["sim", "--functions", "4", "--hours", "0.02", "--overheads-seed", "7"])
    assert r.exit_code == 2 and "--overheads-seed" in r.output
    path.write_text('{"transport_ms": [1], "batch_ms": []}')
    r = CliRunner().invoke(main, ["sim", *args])
    assert r.exit_code == 2 and "--overheads" in r.output and "not an overheads file" in r.output


def test_a_launch_beside_others_starting_takes_the_tables_process_start():
    """process_start_by_starting_ms (``dilu calibrate``'s, from the overheads file): an instance
    launched while k others start on its node takes entry k. The deploy's launches start at once,
    each beside the others: they take the last entry (without a start of their own,
    process_start_initial_ms); a table flat at the constant changes nothing."""
    flat = SimConfig(**SMALL, seed=2, process_start_ms=500.0, process_start_by_starting_ms=(500.0,))
    const = SimConfig(**SMALL, seed=2, process_start_ms=500.0)
    assert simulate(flat, ["dilu"])["policies"] == simulate(const, ["dilu"])["policies"]
    cfg = SimConfig(**SMALL, seed=2, process_start_ms=500.0, process_start_by_starting_ms=(500.0, 3000.0))
    sim = Simulation(cfg, "dilu", prepare(cfg))
    starts = []
    place = sim._place

    def logged(f, slot=None):
        starting = sum(1 for i in sim.instances.values() if i.state == "starting")
        inst = place(f, slot)
        if inst is not None:
            starts.append((sim.loop.now, starting, inst.ready_ms - sim.loop.now - models.cold_start_ms(f.model)))
        return inst

    sim._place = logged
    sim.run()
    deploy = [ms for at, _, ms in starts if at == 0.0]
    later = [(k, ms) for at, k, ms in starts if at > 0.0]
    assert len(deploy) > 2 and set(deploy) == {3000.0}
    assert [ms for _, ms in later] == pytest.approx([500.0 if k == 0 else 3000.0 for k, _ in later])
    assert {k for k, _ in later} >= {0, 1}  # one alone, one beside another
    launched = [s.model for s in sim.work.specs]
    assert warm_up_ms(cfg, launched, "lazy") == warm_up_ms(const, launched, "lazy") + 2500.0  # the last initial one
    with pytest.raises(ValueError, match="process_start_by_starting_ms must be in"):
        SimConfig(process_start_by_starting_ms=(400.0, -1.0))


def test_drawn_overheads_repeat_per_seed_and_differ_by_overheads_seed():
    from dilu.loadgen.sim.overheads import Overheads

    ov = Overheads.from_samples([0.5 * k for k in range(200)], [0.2 * k for k in range(200)])

    def policies(**kw) -> dict:
        return simulate(SimConfig(**SMALL, seed=2, overheads=ov, **kw), ["dilu"])["policies"]

    a = policies()
    assert a == policies() and a == policies(overheads_seed=2)  # the default stream is --seed's
    assert a != policies(overheads_seed=3)


def test_a_pickup_parts_an_instances_batches_while_requests_wait():
    """pickup_ms (``dilu calibrate``'s): an instance whose function has requests waiting when its
    batch ends starts the next batch the pickup later, as the live puller acks and fetches
    first; without a pickup table it starts at once."""
    from dilu.loadgen.sim.overheads import QUANTILE_POINTS, Overheads

    def run(pickup_ms: float) -> tuple[list[float], dict]:
        ov = Overheads((0.0,) * QUANTILE_POINTS, (0.0,) * QUANTILE_POINTS,
                       pickup_ms=(pickup_ms,) * QUANTILE_POINTS if pickup_ms else ())
        cfg = SimConfig(**SMALL, seed=2, overheads=ov)
        sim = Simulation(cfg, "dilu", prepare(cfg))
        ended: dict[str, tuple[float, bool]] = {}
        gaps: list[float] = []
        start, end = sim._start_batch, sim._end_batch

        def started(inst):
            start(inst)
            at, waited = ended.pop(inst.iid, (None, False))
            if inst.inflight and waited:
                gaps.append(sim.loop.now - at)

        def finished(arg):
            inst, seq = arg
            if seq == inst.batch_seq:  # not an end void since (the batch re-timed by a grant)
                ended[inst.iid] = (sim.loop.now, bool(inst.fn.pending))
            end(arg)

        sim._start_batch, sim._end_batch = started, finished
        rep, _ = sim.run()
        return gaps, rep.to_dict()["totals"]

    (none, base), (some, slow) = run(0.0), run(3.0)
    assert len(none) > 100 and set(none) == {0.0}
    assert len(some) > 100 and some == pytest.approx([3.0] * len(some))
    # (its tail is not compared: a pickup longer than the cycle gap also parts the instance's
    # kernel cycles, so fewer stretches are reported and the grants differ)
    assert slow["completed"] == base["completed"]


def test_a_request_to_an_idle_instance_waits_for_its_dispatch():
    """dispatch_ms (``dilu calibrate``'s): a request that finds an idle instance starts its batch
    the dispatch later, as the live puller's fetch delivers and decodes it; requests that come
    meanwhile join that batch. Without a dispatch table the batch starts at once."""
    from dilu.loadgen.sim.overheads import QUANTILE_POINTS, Overheads

    def run(dispatch_ms: float) -> tuple[list[float], dict]:
        ov = Overheads((0.0,) * QUANTILE_POINTS, (0.0,) * QUANTILE_POINTS,
                       dispatch_ms=(dispatch_ms,) * QUANTILE_POINTS if dispatch_ms else ())
        cfg = SimConfig(**SMALL, seed=2, overheads=ov)
        sim = Simulation(cfg, "dilu", prepare(cfg))
        idle_waits: list[float] = []
        start, arrive = sim._start_batch, sim._arrive
        came: dict[str, float] = {}

        def arrived(i):
            if any(not inst.busy for inst in sim.by_fn[i].ready):  # an idle instance takes it
                came.setdefault(sim.by_fn[i].name, sim.loop.now)
            arrive(i)

        def started(inst):
            at = came.pop(inst.fn.name, None)
            start(inst)
            if at is not None and inst.inflight:
                idle_waits.append(sim.loop.now - at)

        sim._start_batch, sim._arrive = started, arrived
        rep, _ = sim.run()
        return idle_waits, rep.to_dict()["totals"]

    (none, base), (some, slow) = run(0.0), run(4.0)
    assert len(none) > 100 and set(none) == {0.0}
    assert len(some) > 100 and some == pytest.approx([4.0] * len(some))
    assert slow["latency_ms"]["p50"] >= base["latency_ms"]["p50"] + 4.0 * 0.99


def test_the_replay_starts_as_the_last_initial_instance_is_ready_at_any_phase_of_the_tick():
    """process_start_initial_ms (``dilu calibrate``'s, the deploy's launches all at once): the
    k-th launch of the deploy is up at entry k (the last also for more), and the replay starts as
    the last of them is ready, as the live demo's does (WarmWatch); each draw moves all by its
    jitter, so the replay meets the horizontal tick at any phase while the initial instances are
    as fresh at its start."""
    from dilu.loadgen.sim.overheads import QUANTILE_POINTS, Overheads

    ov = Overheads((0.0,) * QUANTILE_POINTS, (0.0,) * QUANTILE_POINTS)
    work = prepare(SimConfig(**SMALL, seed=2))
    table = (2000.0, 2100.0, 2150.0, 2400.0)
    phases, ahead = set(), set()
    for k in range(1, 9):
        cfg = SimConfig(**SMALL, seed=2, process_start_initial_ms=table, process_start_ms=400.0, overheads=ov,
                        overheads_seed=k)
        sim = Simulation(cfg, "dilu", work)
        ready: list[tuple[float, float]] = []  # (up, ready) of each launch at the deploy, in launch order
        place = sim._place

        def logged(f, slot=None, sim=sim, ready=ready, place=place):
            inst = place(f, slot)
            if inst is not None and sim.loop.now == 0.0:
                ready.append((inst.ready_ms - models.cold_start_ms(f.model), inst.ready_ms))
            return inst

        sim._place = logged
        sim.run()
        jitter = sim.phases[0]
        assert len(ready) == 8 and [up for up, _ in ready] == pytest.approx([v + jitter for v in table + (2400.0,) * 4])
        assert sim.t0 == pytest.approx(max(r for _, r in ready))
        ahead.add(tuple(round(sim.t0 - r, 6) for _, r in ready))  # how long before the replay each was ready
        phases.add(round(sim.t0 % cfg.horizontal_tick_ms, 3))
    assert len(ahead) == 1 and len(phases) == 8
    plain = SimConfig(**SMALL, seed=2, process_start_initial_ms=(2000.0,), process_start_ms=400.0)
    longest = max(models.cold_start_ms(s.model) for s in work.specs)
    assert warm_up_ms(plain, [s.model for s in work.specs], "lazy") == pytest.approx(2000.0 + longest)
    with pytest.raises(ValueError, match="process_start_initial_ms must be in"):
        SimConfig(process_start_initial_ms=(-1.0,))


def test_kernel_cycles_close_after_an_idle_gap_as_the_interceptors_do():
    """node.Cycles mirrors interceptor.c's note_cycle and the node agent's stretch test: batches
    closer than the cycle gap are one cycle, closed by the next launch after a longer gap; the
    baseline is the shortest warm cycle; the token wait of the last sample is taken out."""
    from dilu.loadgen.sim.node import Cycles
    from dilu.services.common.functions import SAMPLE_MS, STRETCH_RATIO

    source = (ROOT / "interceptor" / "interceptor.c").read_text()  # the mirrored defaults are the C's
    assert f'env_f("DILU_CYCLE_GAP_US", {models.CYCLE_GAP_MS * 1000:.1f})' in source
    assert f"#define WARM_CYCLES {models.WARM_CYCLES} " in source
    assert f"/ {models.BASELINE_DRIFT_MS / 1000:g}e9)" in source
    gap = models.CYCLE_GAP_MS
    c = Cycles()
    assert c.launch(0.0) is None
    c.served(10.0, 10.0, 0.0)
    assert c.launch(20.0) is None and c.baseline == 10.0  # a lone batch: the baseline, no stretch
    c.served(30.0, 10.0, 0.0)
    assert c.launch(30.0 + gap / 2) is None  # the next batch within the gap: the same cycle
    c.served(40.0 + gap / 2, 10.0, 0.0)
    ratio = c.launch(60.0)  # closes 20..40.5: two batches, twice the baseline
    span = 20.0 + gap / 2  # not shorter: it drifts the baseline by its span over the drift window
    assert c.baseline == pytest.approx(10.0 + (span - 10.0) * (60.0 - 20.0) / models.BASELINE_DRIFT_MS)
    assert ratio == pytest.approx(span / c.baseline) and ratio >= STRETCH_RATIO and c.count == 2
    # paced by its own grant: the wait of the last sample is throttling, not contention
    c.served(60.0 + 2 * SAMPLE_MS, 2 * SAMPLE_MS, 2 * SAMPLE_MS * 0.5)
    assert c.launch(100.0) is None  # 20 ms less the last 10 ms's 5 ms of wait: 1.5x would be 15
    # a warm cycle shorter than the baseline becomes it; after the warm cycles, only one of at
    # least half of it does, a shorter one moves it by its span over the drift window
    c.served(105.0, 5.0, 0.0)
    assert c.launch(120.0) is None and c.baseline == 5.0
    c.count = models.WARM_CYCLES
    c.served(121.0, 1.0, 0.0)
    c.launch(130.0)
    assert c.baseline == pytest.approx(5.0 + (1.0 - 5.0) * (130.0 - 120.0) / models.BASELINE_DRIFT_MS)


def test_an_instance_kept_busy_by_its_queue_reads_as_stretched_as_live():
    """Live, the busiest function's batches follow each other within the interceptor's cycle gap
    (0.7 ms from one to the next), so they are one long cycle and the node agent reports it as
    a stretch, which the vertical policy answers as pressure: seed 3's gpt2_large, 474
    stretches in a 60 s run, 504 a draw simulated. A pickup longer than the gap parts the
    batches into cycles of their own, and fewer stretches are reported."""
    from dilu.loadgen.sim.overheads import QUANTILE_POINTS, Overheads

    def stretches(pickup_ms: float) -> dict[str, int]:
        ov = Overheads((0.0,) * QUANTILE_POINTS, (0.0,) * QUANTILE_POINTS, pickup_ms=(pickup_ms,) * QUANTILE_POINTS)
        cfg = SimConfig(**SMALL, seed=2, overheads=ov)
        sim = Simulation(cfg, "dilu", prepare(cfg))
        seen: dict[str, int] = {}
        stretch = sim.vertical.on_stretch

        def reported(gpu, now, iid, ratio):
            inst = sim.instances[iid]
            assert inst.state == "ready" and not inst.training and ratio >= 1.5
            seen[inst.fn.name] = seen.get(inst.fn.name, 0) + 1
            return stretch(gpu, now, iid, ratio)

        sim.vertical.on_stretch = reported
        _, facts = sim.run()
        assert facts.stretches == seen  # the sim section of its JSON counts them per function
        return seen

    merged, parted = stretches(models.CYCLE_GAP_MS / 2), stretches(models.CYCLE_GAP_MS * 3)
    assert sum(merged.values()) > 2 * sum(parted.values()) > 0


def test_simulated_telemetry_means_what_the_node_agents_does():
    """The vertical policy reads the same fields live and simulated: the recent-latency average
    of the instance's process (RuntimeStats, through functions.recent_latency) kept across an idle
    window, the batch in hand as queue_depth (0 when idle), busy share = time on the device and
    token waits charged to the windows they fall in."""
    from dilu.services.common.functions import recent_latency
    from dilu.services.node_agent.instance import RuntimeStats

    stats = RuntimeStats(None)
    stats.record([100.0, 50.0, 200.0])
    avg = 0.0
    for n, lat in enumerate([100.0, 50.0, 200.0]):
        avg = recent_latency(avg, lat, n)
    assert stats.latency_us_ewma == pytest.approx(avg) and avg == pytest.approx(100.0 + 0.2 * -50.0 + 0.2 * (200.0 - 90.0))

    work = prepare(SimConfig(**SMALL, seed=2))
    sim = Simulation(SimConfig(**SMALL, seed=2), "dilu", work)
    rows: list = []
    seen = sim.vertical.on_telemetry

    def capture(gpu, now, tel):
        rows.extend(tel)
        return seen(gpu, now, tel)

    sim.vertical.on_telemetry = capture
    sim.run()
    batches = {s.name: s.max_batch for s in work.specs}
    served = [r for r in rows if r.latency_ms_recent > 0]
    assert served and all(r.queue_depth <= batches[r.function] for r in rows)
    assert any(r.busy_share == 0 and r.latency_ms_recent > 0 for r in served)  # kept over an idle window
    # a batch in hand is busy in every window it spans, not only in the one it started in
    assert any(r.queue_depth > 0 for r in rows) and all(r.queue_depth == 0 for r in rows if r.busy_share == 0)
    reported_wait_ms = sum(r.wait_us for r in rows) / 1000.0  # token waits, window by window
    assert reported_wait_ms > 0 and reported_wait_ms == pytest.approx(sim.mech.token_wait_ms, rel=0.05)


def test_an_idle_instance_told_to_drain_leaves_as_its_open_fetch_expires_serving_what_it_takes():
    """A live puller sees a stop only when its fetch returns (workqueue.FETCH_TIMEOUT_S, each
    fetch from the last batch's end or its readiness): an idle instance retired leaves at the
    next whole fetch, and a request that comes meanwhile, with no ready instance idle, is
    delivered to it and served warm before it leaves (live, the 18 ms answer where the
    simulator used to relaunch: a cold start)."""
    from dilu.services.common.workqueue import FETCH_TIMEOUT_S

    fetch = FETCH_TIMEOUT_S * 1000.0
    cfg = SimConfig(functions=16, hours=60 * 10 / 3600, nodes=1, gpus_per_node=4, seed=2, speedup=10.0,
                    start_minute=480)  # the demo's replay of seed 2: keep-alive retirements and scale-ins
    sim = Simulation(cfg, "horizontal-only", prepare(cfg))
    told: dict[str, tuple[float, float]] = {}  # idle instance -> (told to drain, its fetch's start)
    left: dict[str, float] = {}
    took: dict[str, list[int]] = {}
    retire, gone, take = sim._retire, sim._gone, sim._take_closing

    def retired(inst):
        if inst.state == "ready" and not inst.busy:
            told[inst.iid] = (sim.loop.now, inst.fetch_at)
        retire(inst)

    def went(inst):
        left[inst.iid] = sim.loop.now
        gone(inst)

    def taken(inst):
        take(inst)
        took[inst.iid] = list(inst.inflight)

    sim._retire, sim._gone, sim._take_closing = retired, went, taken
    sim.run()
    assert len(told) > 20 and took and set(took) < set(told)
    for iid, (at, since) in told.items():
        if iid not in left:
            continue  # still draining at the end of the run
        if iid in took:
            assert at < left[iid]  # served its batch, then left
            assert took[iid] and not any(sim.cold[i] for i in took[iid])  # a warm answer
        else:
            waited = left[iid] - at
            assert 0.0 < waited <= fetch
            assert (left[iid] - since) / fetch == pytest.approx(round((left[iid] - since) / fetch), abs=1e-6)


def test_a_placement_does_not_see_the_room_a_park_of_the_same_tick_frees():
    """The live horizontal scaler's tick sends each function's placement from its own task, but
    its parks one task later (``asyncio.gather``), so the scheduler serves a tick's first
    placement before its parks (requests.request_order): that placement does not see the room a
    park of the same tick frees (live, seed 1: a BERT-base scale-out placed beside an instance
    parking that tick filled its GPU, and a resume there 1.4 s later was relaunched elsewhere, a
    cold start). The demo's replay of seed 8 parks a ResNet-152 instance in the tick that scales
    out another ResNet-152 function, ticked after it."""
    cfg = SimConfig(functions=16, hours=1 / 6, speedup=10, nodes=1, gpus_per_node=4, seed=8)
    sim = Simulation(cfg, "dilu", prepare(cfg))
    parking: list[str] = []  # instances the tick under way decided to park
    placed_in_tick = [False]
    firsts: list[tuple[set[str], set[str]]] = []  # per tick that parks and places: (parking, of them still placed)
    tick, decide, place = sim._horizontal_tick, sim.horizontal.decide, sim._place

    def ticked(_=None):
        parking.clear()
        placed_in_tick[0] = False
        tick(_)
        parking.clear()  # a placement between ticks (a resume relaunched) is not of a tick

    def decided(fn, *args, **kw):
        d = decide(fn, *args, **kw)
        parking.extend(d.park)
        return d

    def placed(f, slot=None):
        if parking and not placed_in_tick[0]:  # the tick's first placement
            firsts.append((set(parking), {i for i in parking if i in sim.cluster.instances}))
        placed_in_tick[0] = placed_in_tick[0] or bool(parking)
        return place(f, slot)

    sim._horizontal_tick, sim.horizontal.decide, sim._place = ticked, decided, placed
    sim.run()
    assert firsts, "no tick both parked and placed: the replay no longer tests the order"
    assert all(still == wanted for wanted, still in firsts)  # every parking instance still held its room


def test_a_live_runs_loop_timing_is_replayed_where_its_deploy_matches():
    """Overheads measured from a live run (``dilu calibrate``): the horizontal tick at its
    measured period, the replay's start and a defragmentation round at that run's times after
    the deploy's tick, so that its threshold decisions fall as they fell live; a simulation
    whose deploy launches another count draws its phases instead."""
    from dilu.loadgen.sim.overheads import QUANTILE_POINTS, LoopTiming, Overheads

    work = prepare(SimConfig(**SMALL, seed=2))
    first = work.plan.invocations[0].scheduled_ns / 1e6
    timing = LoopTiming(launches=8, first_request_ms=4321.5, defrag_ms=-700.0)
    ov = Overheads((0.0,) * QUANTILE_POINTS, (0.0,) * QUANTILE_POINTS, horizontal_tick_ms=501.6,
                   loop_timings=(LoopTiming(launches=3, first_request_ms=9000.0), timing))
    for k in (1, 2):
        sim = Simulation(SimConfig(**SMALL, seed=2, overheads=ov, overheads_seed=k), "dilu", work)
        assert sim.timing == timing and sim.t0 == pytest.approx(4321.5 - first)
        assert sim.phases[0] == 0.0 and sim.phases[2] == pytest.approx(-700.0 % sim.defrag_every)
        ticks: list[float] = []
        tick = sim._horizontal_tick

        def ticked(_=None, sim=sim, ticks=ticks, tick=tick):
            ticks.append(sim.loop.now)
            tick(_)

        sim._horizontal_tick = ticked
        sim.run()
        assert ticks[:4] == pytest.approx([0.0, 501.6, 1003.2, 1504.8])
    other = Overheads((0.0,) * QUANTILE_POINTS, (0.0,) * QUANTILE_POINTS,
                      loop_timings=(LoopTiming(launches=3, first_request_ms=9000.0),))
    sim = Simulation(SimConfig(**SMALL, seed=2, overheads=other, overheads_seed=1), "dilu", work)
    assert sim.timing is None and sim.t0 != pytest.approx(9000.0 - first) and sim.tick_ms == 500.0
