"""Profiler searches: training binary search, inference guided growth on every measured surface."""
from __future__ import annotations

import json
import math
import random

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dilu.services.common import models
from dilu.services.profiler.cli import profile
from dilu.services.profiler.policy import (
    InferenceSearch,
    Measurement,
    NoFeasibleSetting,
    ProfileSearch,
    SearchProtocolError,
    TrainingSearch,
    Trial,
)
from dilu.services.profiler.surface import (
    Surface,
    SurfaceBackend,
    SurfaceError,
    load_surface,
    run_search,
    surface_files,
)

QUOTAS = [round(0.05 * i, 2) for i in range(1, 21)]


def drive(search, answer):
    """Run ``search`` with ``answer(trial) -> Measurement``; returns (result, trials proposed)."""
    proposed = []
    while (t := search.next_trial()) is not None:
        assert t not in proposed, "a measured trial was proposed twice"
        proposed.append(t)
        search.record(t, answer(t))
    return search.result(), proposed


# ----------------------------------------------------------------------------- training


def saturating(knee: float):
    """Throughput rises linearly up to ``knee`` then stays flat (monotone)."""
    return lambda t: Measurement(latency_ms=1.0, throughput_rps=100 * min(t.quota, knee) / knee)


@pytest.mark.parametrize("knee", [0.05, 0.3, 0.52, 0.8, 1.0])
def test_training_finds_true_minimum_on_monotone_curve(knee):
    res, proposed = drive(TrainingSearch(QUOTAS), saturating(knee))
    full = 100.0
    meets = [q for q in QUOTAS if 100 * min(q, knee) / knee >= 0.98 * full]
    assert res.request_quota == min(meets)
    assert res.limit_quota == min(q for q in QUOTAS if 100 * min(q, knee) / knee >= full)
    assert res.limit_quota >= res.request_quota
    # an ascending scan up to the limit plus the full-GPU reference, each point at most once
    assert len(proposed) <= len(QUOTAS)
    assert len(proposed) == min(len(QUOTAS), QUOTAS.index(res.limit_quota) + 2)
    assert res.trials == len(proposed)


@given(
    knee=st.floats(0.05, 1.0),
    noise=st.lists(st.floats(-0.05, 0.05), min_size=20, max_size=20),
    threshold=st.floats(0.8, 0.99),
)
@settings(max_examples=150, deadline=None)
def test_training_on_noisy_curve_returns_a_point_meeting_threshold(knee, noise, threshold):
    def answer(t):
        i = QUOTAS.index(t.setting[0])
        return Measurement(latency_ms=1.0, throughput_rps=max(0.0, 100 * min(t.quota, knee) / knee * (1 + noise[i])))

    search = TrainingSearch(QUOTAS, threshold=threshold)
    res, proposed = drive(search, answer)
    measured = {t.setting[0]: answer(t).throughput_rps for t in proposed}
    full = measured[1.0]
    assert res.request_quota in measured, "the answer is a measured grid point"
    assert measured[res.request_quota] >= threshold * full
    assert all(measured[q] < threshold * full for q in QUOTAS if q < res.request_quota), "the true minimum"
    assert len(proposed) <= len(QUOTAS)


def test_training_rejects_bad_arguments_and_protocol_misuse():
    with pytest.raises(ValueError):
        TrainingSearch([])
    with pytest.raises(ValueError):
        TrainingSearch(QUOTAS, threshold=1.5)
    with pytest.raises(ValueError):
        TrainingSearch([0.0, 0.5])
    s = TrainingSearch(QUOTAS)
    t = s.next_trial()
    with pytest.raises(SearchProtocolError):
        s.record(Trial((0.35,), 1), Measurement(1, 1))
    with pytest.raises(ValueError):
        s.record(t, Measurement(float("nan"), 1))
    with pytest.raises(RuntimeError):
        s.result()


# ----------------------------------------------------------------------------- inference: measured surfaces

SURFACES = {p.stem: load_surface(p) for p in surface_files()}


def surface_cases():
    for name, surf in SURFACES.items():
        for factor in (2, 3, 5):
            yield pytest.param(name, factor, id=f"{name}-{factor}x")


@pytest.mark.parametrize(("name", "factor"), list(surface_cases()))
def test_inference_meets_goal_on_every_surface(name, factor):
    """Goal of the profiler: TE within 5 % of the exhaustive optimum in ≤ 1/3 of its trials."""
    surf = SURFACES[name]
    slo = factor * surf.baseline_latency_ms()
    opt = surf.exhaustive(slo)
    assert opt is not None  # batch 1 on the full GPU always meets k × its own latency
    backend = SurfaceBackend(surf)
    res = run_search(InferenceSearch(surf.batches, surf.quota_axes, slo), backend)
    assert res.te >= 0.95 * opt.te
    assert backend.trials * 3 <= opt.trials
    assert res.trials == backend.trials
    # the answers are grid points that meet the SLO
    chosen = surf.measure(res.request_setting, res.batch_size)
    assert chosen.latency_ms <= slo
    assert math.isclose(res.te, chosen.throughput_rps / res.request_quota)
    assert surf.measure(res.limit_setting, res.burst_batch).latency_ms <= slo
    assert res.limit_quota >= res.request_quota
    assert res.burst_batch >= res.batch_size


def noisy(surf: Surface, seed: int, amp: float) -> Surface:
    """A copy of ``surf`` with independent multiplicative noise of ±amp on latency and throughput."""
    rng = random.Random(seed)
    pts = {
        k: Measurement(m.latency_ms * (1 + rng.uniform(-amp, amp)), m.throughput_rps * (1 + rng.uniform(-amp, amp)))
        for k, m in sorted(surf.points.items())
    }
    return Surface(surf.name, surf.fmt, surf.quota_axes, surf.batches, pts, surf.tokens_per_request)


@pytest.mark.parametrize("name", ["gpt2_large", "resnet152", "llama2", "resnet50"])
def test_inference_is_robust_to_extra_noise(name):
    """With another ±4 % of noise on every point, the search still lands within 5 % on most seeds."""
    hits = 0
    for seed in range(10):
        surf = noisy(SURFACES[name], seed, 0.04)
        slo = 3 * surf.baseline_latency_ms()
        opt = surf.exhaustive(slo)
        backend = SurfaceBackend(surf)
        res = run_search(InferenceSearch(surf.batches, surf.quota_axes, slo), backend)
        assert backend.trials * 3 <= opt.trials
        hits += res.te >= 0.95 * opt.te
    assert hits >= 8


def test_inference_does_not_stop_at_the_first_dip():
    """TE dips by 10 % between batch 2 and 4 at the smallest quota, then climbs 3x: the search goes on."""
    te_by_batch = {1: 100.0, 2: 110.0, 4: 99.0, 8: 200.0, 16: 300.0}

    def answer(t):
        thr = te_by_batch[t.batch] * t.quota * (1 - 0.3 * t.quota)  # sublinear in quota
        return Measurement(latency_ms=t.batch / thr * 1000, throughput_rps=thr)

    res, _ = drive(InferenceSearch(list(te_by_batch), [0.1, 0.2, 0.5, 1.0], slo_ms=1e9), answer)
    assert res.batch_size == 16 and res.request_quota == 0.1


def test_inference_without_any_feasible_setting_raises_clear_error():
    s = InferenceSearch([1, 2], [0.5, 1.0], slo_ms=1.0)
    _, proposed = None, []
    while (t := s.next_trial()) is not None:
        proposed.append(t)
        s.record(t, Measurement(latency_ms=10.0, throughput_rps=1.0))
    assert Trial((1.0,), 1) in proposed, "the full GPU at batch 1 is tried before giving up"
    with pytest.raises(NoFeasibleSetting, match="SLO"):
        s.result()


def test_an_infeasible_slo_is_named_as_given_beside_the_batch_budget():
    """ProfileSearch searches batches within half the SLO: the error names the SLO the user wrote
    (0.001 ms), not only the half of it the search used."""
    s = ProfileSearch("inference", [1, 2], [0.5, 1.0], slo_ms=0.001)
    while (t := s.next_trial()) is not None:
        s.record(t, Measurement(latency_ms=10.0, throughput_rps=1.0))
    with pytest.raises(NoFeasibleSetting, match=r"0.0005 ms \(50% of the SLO of 0.001 ms\)"):
        s.result()


def test_inference_rejects_bad_grids():
    for kwargs in ({"grid_batches": [], "grid_quotas": [0.5], "slo_ms": 1},
                   {"grid_batches": [1], "grid_quotas": [1.5], "slo_ms": 1},
                   {"grid_batches": [1], "grid_quotas": [0.5], "slo_ms": 0}):
        with pytest.raises(ValueError):
            InferenceSearch(**kwargs)


# ----------------------------------------------------------------------------- surfaces, models, CLI


def test_surface_formats_and_llama_per_token_latency():
    llama = SURFACES["llama2"]
    assert llama.fmt == "a100-mps" and llama.tokens_per_request == 32
    m = llama.measure((0.6,), 1)
    assert m.latency_ms == pytest.approx(32 * 32.176)  # 0.032176 s per token × 32 tokens
    v = SURFACES["resnet50"]
    assert v.fmt == "v100-sm-quota" and len(v.quota_axes) == 2
    assert v.measure((0.05, 0.1), 1).latency_ms == pytest.approx(244.2277)
    with pytest.raises(SurfaceError):
        v.measure((0.33, 0.1), 1)


def test_surface_backend_counts_distinct_points():
    b = SurfaceBackend(SURFACES["bert_base"])
    for _ in range(3):
        b.run(Trial((0.5,), 4))
    b.run(Trial((0.5,), 8))
    assert b.trials == 2


def test_bad_surface_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(SurfaceError, match="unknown header"):
        load_surface(bad)
    bad.write_text("batch,sm_percent,latency_s,throughput_rps\n1,10,x,3\n")
    with pytest.raises(SurfaceError, match="latency_s"):
        load_surface(bad)
    bad.write_bytes(bytes(range(256)) * 4)  # not text at all
    with pytest.raises(SurfaceError, match="not a text CSV"):
        load_surface(bad)
    bad.write_text("batch,sm_percent,latency_s,throughput_rps\n1,1000,0.01,3\n")  # a ValueError deep in the search
    with pytest.raises(SurfaceError, match=r"bad.csv:2: column 'sm_percent' is a percentage in \(0, 100\], got 1000"):
        load_surface(bad)
    bad.write_text("batch,sm_percent,time_quota_percent,latency_ms\n1,50,500,10\n")
    with pytest.raises(SurfaceError, match="'time_quota_percent' is a percentage"):
        load_surface(bad)
    bad.write_text("batch,sm_percent,latency_s,throughput_rps\n1.5,50,0.01,3\n")  # was read as batch 1
    with pytest.raises(SurfaceError, match="'batch' must be a whole number, got 1.5"):
        load_surface(bad)
    bad.write_text("batch,sm_percent,latency_s,throughput_rps\n1,50,0.01,100\n2,50,0.015,133\n1,50.0,0.02,50\n")
    with pytest.raises(SurfaceError, match=r"bad.csv:4: measures again the point of line 2 \(batch 1 at 0.5\)"):
        load_surface(bad)  # the last one was kept
    bad.write_text("batch,sm_percent,latency_s,throughput_rps\n1,50,1e308,100\n")  # finite in s, infinite in ms
    with pytest.raises(SurfaceError, match="bad.csv:2: column 'latency_s' is too large: 1e308"):
        load_surface(bad)


@pytest.mark.parametrize("args, words", [
    (["--slo-ms", "nan"], "is not a valid finite number"),
    (["--queueing-budget", "nan"], "is not a valid finite number"),
    (["--slo-ms", "98", "--json", "/nonexistent-dir/p.json"], "cannot write /nonexistent-dir/p.json"),
])
def test_dilu_profile_bad_options_are_one_line(args, words):
    from click.testing import CliRunner

    from dilu.services.profiler.cli import profile
    from dilu.services.profiler.surface import SURFACES_DIR

    surface = str(SURFACES_DIR / models.spec("resnet152").surface)
    r = CliRunner().invoke(profile, ["--surface", surface, *args])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output


def test_models_catalogue():
    # grid points are returned exactly; in between, bilinear interpolation lies between neighbours
    assert models.latency_ms("bert_base", 4, 0.5) == pytest.approx(SURFACES["bert_base"].measure((0.5,), 4).latency_ms)
    mid = models.latency_ms("resnet152", 3, 0.55)
    corners = [SURFACES["resnet152"].measure((q,), b).latency_ms for q in (0.5, 0.6) for b in (2, 4)]
    assert min(corners) <= mid <= max(corners)
    assert models.latency_ms("gpt2_large", 64, 1.0) == pytest.approx(2 * models.latency_ms("gpt2_large", 32, 1.0))
    assert models.latency_ms("gpt2_large", 1, 0.05) == pytest.approx(2 * models.latency_ms("gpt2_large", 1, 0.1))
    assert models.default_slo_ms("llama2") == pytest.approx(5 * 32 * 1000 * 0.030906)
    w = models.MODELS["llama2"].params * 2
    assert models.memory_bytes("llama2") == int(w + 1.5 * 2**30 + 0.2 * w)
    assert models.cold_start_ms("bert_base") == pytest.approx(110e6 * 2 / 4e9 * 1000)
    with pytest.raises(KeyError, match="known"):
        models.latency_ms("nope", 1, 1.0)
    with pytest.raises(ValueError):
        models.latency_ms("bert_base", 0, 1.0)


def test_cli_profile_writes_choice_and_optimum(tmp_path):
    path = next(p for p in surface_files() if p.stem == "resnet152")
    slo = 3 * SURFACES["resnet152"].baseline_latency_ms()
    out = tmp_path / "p.json"
    r = CliRunner().invoke(profile, ["--surface", str(path), "--slo-ms", str(slo), "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["request_quota"] in SURFACES["resnet152"].quota_axes[0]
    assert data["te"] >= 0.95 * data["optimum"]["te"]
    assert data["batch_latency_bound_ms"] == pytest.approx(slo / 2)  # the live queueing budget
    # the whole procedure (search, knee, trial at the limit): 22 of 60 points here
    assert data["trials"] * 2 <= data["optimum"]["trials"]
    assert data["limit_quota"] >= data["request_quota"] and data["limit_throughput_rps"] > 0
    r = CliRunner().invoke(profile, ["--surface", str(path), "--slo-ms", "0.001"])
    assert r.exit_code == 2 and "--slo-ms" in r.output and "no grid point meets" in r.output  # bad input


@given(
    alpha=st.floats(0.2, 1.0), beta=st.floats(0.3, 1.0), slo_factor=st.floats(1.0, 20.0),
    noise=st.lists(st.floats(-0.1, 0.1), min_size=60, max_size=60),
)
@settings(max_examples=150, deadline=None)
def test_inference_search_always_terminates_with_a_measured_slo_meeting_best(alpha, beta, slo_factor, noise):
    """On any noisy power-law surface: ends, never repeats a trial, answers the best measured
    SLO-meeting point, and a limit setting whose burst batch was measured or implied to meet the SLO."""
    quotas = [round(0.1 * i, 1) for i in range(1, 11)]
    batches = [1, 2, 4, 8, 16, 32]

    def answer(t):
        i = quotas.index(t.setting[0]) * 6 + batches.index(t.batch)
        lat = 10 * t.batch**alpha / t.quota**beta * (1 + noise[i])
        return Measurement(latency_ms=lat, throughput_rps=t.batch / lat * 1000)

    slo = 10 * slo_factor
    search = InferenceSearch(batches, quotas, slo)
    try:
        res, proposed = drive(search, answer)
    except NoFeasibleSetting:
        assert all(answer(Trial((q,), b)).latency_ms > slo for q in quotas for b in batches[:1] if q == 1.0)
        return
    assert len(proposed) <= 60
    ok = [t for t in proposed if answer(t).latency_ms <= slo]
    best = max(answer(t).throughput_rps / t.quota for t in ok)
    assert res.te == pytest.approx(best)
    assert res.limit_quota >= res.request_quota and res.burst_batch in batches
