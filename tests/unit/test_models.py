"""The emulated GPU's timing comes from the measured surfaces, not invented curves."""
import csv

import pytest

from dilu.services.common import models


@pytest.mark.parametrize("model", sorted(models.MODELS))
def test_grid_points_reproduce_the_measured_file(model):
    path = models.SURFACES / models.spec(model).surface
    for row in csv.DictReader(path.open()):
        b, w = int(float(row["batch"])), float(row["sm_percent"]) / 100
        assert models.step_latency_ms(model, b, w) == pytest.approx(float(row["latency_s"]) * 1000, rel=1e-9)


def test_llama_request_is_32_decode_steps():
    assert models.latency_ms("llama2", 4, 0.5) == pytest.approx(32 * models.step_latency_ms("llama2", 4, 0.5))
    assert models.latency_ms("bert_base", 4, 0.5) == models.step_latency_ms("bert_base", 4, 0.5)


def test_between_grid_points_is_between_neighbours():
    lo, hi = models.step_latency_ms("gpt2_large", 8, 0.3), models.step_latency_ms("gpt2_large", 8, 0.4)
    mid = models.step_latency_ms("gpt2_large", 8, 0.35)
    assert min(lo, hi) <= mid <= max(lo, hi)


def test_below_measured_width_scales_inversely():
    assert models.step_latency_ms("resnet152", 1, 0.05) == pytest.approx(2 * models.step_latency_ms("resnet152", 1, 0.1))


def test_defaults_follow_documented_constants():
    assert models.default_slo_ms("bert_base") == pytest.approx(5 * models.latency_ms("bert_base", 1, 1.0))
    w = 110_000_000 * 2
    assert models.memory_bytes("bert_base") == int(w + models.MEMORY_FIXED_BYTES + 0.2 * w)
    assert models.cold_start_ms("llama2") == pytest.approx(6.74e9 * 2 / 4e9 * 1000)


@pytest.mark.parametrize("batch,width", [(0, 0.5), (1, 0.0), (1, 1.5)])
def test_out_of_range_settings_are_rejected(batch, width):
    with pytest.raises(ValueError):
        models.step_latency_ms("bert_base", batch, width)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(KeyError, match="bert_base"):
        models.spec("alexnet")
