"""The seeded model-assignment rule: weighted draw, capacity check, fallback, determinism."""
from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from dilu.loadgen.assign import MODELS, assign_models, catalogue_capacity, surface_capacity

CAPACITY = {"bert_base": 100.0, "gpt2_large": 150.0, "llama2": 20.0, "resnet152": 1000.0}


class Fn(msgspec.Struct, frozen=True):
    name: str
    peak_minute_count: int


def light(n: int) -> list[Fn]:
    return [Fn(f"fn-{i:04d}", 6) for i in range(n)]  # 6/min: 1 rps at speedup 10


def test_light_functions_follow_the_weights_and_every_model_is_used():
    got = Counter(assign_models(light(1000), seed=1, speedup=10, capacity_rps=CAPACITY.__getitem__).values())
    assert set(got) == set(MODELS)
    # default weights 0.35 / 0.35 / 0.2 / 0.1: loose bounds, 1000 draws
    assert 280 <= got["bert_base"] <= 420 and 280 <= got["resnet152"] <= 420
    assert 140 <= got["gpt2_large"] <= 260 and 60 <= got["llama2"] <= 140


def test_a_model_is_kept_only_if_one_gpu_carries_the_peak_else_the_next_lighter():
    heavy = [Fn(f"hot-{i}", 720) for i in range(300)]  # 720/min at speedup 10 = 120 rps
    got = assign_models(heavy, seed=3, speedup=10, capacity_rps=CAPACITY.__getitem__)
    # bert (100) and llama2 (20) cannot carry 120 rps: they fall back to gpt2_large (150), the
    # least capacity that can; resnet152 draws stay
    assert set(got.values()) == {"gpt2_large", "resnet152"}
    assert all(CAPACITY[m] >= 120 for m in got.values())
    beyond = assign_models([Fn("flood", 60_000)], seed=3, speedup=10, capacity_rps=CAPACITY.__getitem__)
    assert beyond == {"flood": "resnet152"}  # nothing carries it: the model with the most capacity


def test_speedup_raises_the_rate_the_model_must_carry():
    fns = [Fn(f"fn-{i}", 60) for i in range(400)]  # 60/min
    slow = assign_models(fns, seed=2, speedup=1, capacity_rps=CAPACITY.__getitem__)  # 1 rps
    fast = assign_models(fns, seed=2, speedup=30, capacity_rps=CAPACITY.__getitem__)  # 30 rps
    assert "llama2" in slow.values() and "llama2" not in fast.values()
    # only the llama2 draws moved, and they moved to the least-capacity model able to carry 30 rps
    for name, model in slow.items():
        assert fast[name] == (model if model != "llama2" else "bert_base")


def test_assignment_is_seeded_and_independent_of_the_other_functions():
    fns = light(50)
    a = assign_models(fns, seed=7, speedup=10, capacity_rps=CAPACITY.__getitem__)
    assert a == assign_models(list(reversed(fns)), seed=7, speedup=10, capacity_rps=CAPACITY.__getitem__)
    alone = assign_models(fns[10:11], seed=7, speedup=10, capacity_rps=CAPACITY.__getitem__)
    assert alone == {fns[10].name: a[fns[10].name]}
    other = assign_models(fns, seed=8, speedup=10, capacity_rps=CAPACITY.__getitem__)
    assert other != a


def test_bad_weights_or_capacity_are_rejected():
    with pytest.raises(ValueError, match="weights"):
        assign_models(light(1), 0, 10, CAPACITY.__getitem__, weights={"bert_base": -1})
    with pytest.raises(ValueError, match="capacity_rps must be positive"):
        assign_models(light(1), 0, 10, {**CAPACITY, "llama2": 0.0}.__getitem__)


def _surface(path, rows):
    path.write_text("batch,sm_percent,latency_s,throughput_rps\n" + "".join(f"{b},{sm},{lat},{tp}\n" for b, sm, lat, tp in rows))


def test_surface_capacity_takes_the_best_batch_within_half_the_default_slo(tmp_path):
    # SLO = 5 x 10 ms = 50 ms, budget 25 ms: batch 4 (20 ms, 200 rps) is the best that fits;
    # batch 8 has more throughput but its 30 ms batch misses the budget; the 50 % SM row is ignored
    _surface(tmp_path / "bert_base.csv", [
        (8, 100, 0.030, 266.7), (1, 100, 0.010, 100.0), (4, 100, 0.020, 200.0),
        (2, 100, 0.015, 133.3), (4, 50, 0.001, 4000.0),
    ])
    # LLaMA2 latency is per token: a request of 32 tokens at batch 1 takes 32 x 30 ms = 0.96 s
    _surface(tmp_path / "llama2.csv", [(1, 100, 0.030, 1.04), (32, 100, 0.070, 14.3), (8, 100, 0.040, 6.25)])
    cap = surface_capacity(tmp_path)
    assert cap("bert_base") == 200.0
    # budget 2.5 x 0.96 s = 2.4 s; batch 32 takes 2.24 s, so it fits
    assert cap("llama2") == 14.3
    with pytest.raises(ValueError, match="no performance surface for model 'resnet152'"):
        cap("resnet152")


def test_surface_capacity_reports_a_malformed_row(tmp_path):
    (tmp_path / "gpt2_large.csv").write_text("batch,sm_percent,latency_s,throughput_rps\n1,100,0.01,100\n2,100,fast,1\n")
    with pytest.raises(ValueError, match="gpt2_large.csv line 3"):
        surface_capacity(tmp_path)("gpt2_large")


def test_catalogue_capacity_plugs_a_latency_model_in():
    def latency_ms(model, batch, sm):
        assert sm == 1.0  # the whole GPU
        return 10.0 + 5.0 * batch  # 15 ms at batch 1

    cap = catalogue_capacity(latency_ms, lambda m: 75.0)  # budget 37.5 ms: batches 1, 2, 4 fit
    assert cap("bert_base") == pytest.approx(1000 * 4 / 30.0)


def test_catalogue_capacity_with_the_platform_catalogue_when_present():
    from dilu.services.common import models
    cap = catalogue_capacity(models.latency_ms, models.default_slo_ms)
    got = {m: cap(m) for m in MODELS}
    # the A100 surfaces: the 7B LLM serves tens of requests/s, ResNet152 hundreds
    assert got["llama2"] < got["bert_base"] < got["resnet152"]
    assert 10 < got["llama2"] < 40 and got["resnet152"] > 500
