"""Rules about deployed functions: the llm request objective, which devices run a function, the
scheduler's admission, the profiles made without trials, and a function's own initial scale and
keep-alive in the horizontal policy (fake clock, s)."""
from __future__ import annotations

import pytest

from dilu.contracts.events import FunctionSpec, GpuInfo, NodeInventory, Profile
from dilu.services.common.functions import LLM_REFERENCE_TOKENS, request_slo_ms, runs_on
from dilu.services.horizontal_scaler.policy import FunctionParams, HorizontalConfig, HorizontalPolicy
from dilu.services.profiler.policy import CPU_BATCH, CPU_SHARE, cpu_profile, given_profile
from dilu.services.scheduler.inventory import admission

GiB = 2**30


def test_llm_request_objective_is_first_token_then_the_rest_at_the_per_token_objective():
    assert request_slo_ms("llm", ttft_ms=500, tpot_ms=50) == 500 + (LLM_REFERENCE_TOKENS - 1) * 50
    assert request_slo_ms("llm", slo_ms=9000, ttft_ms=500, tpot_ms=50) == 9000, "an explicit objective wins"
    assert request_slo_ms("inference", slo_ms=80) == 80
    assert request_slo_ms("training", slo_ms=80) == 0


def test_which_devices_run_a_function():
    emulated_only = FunctionSpec(name="e", model="bert_base")
    user = FunctionSpec(name="u", entry="m:C", handler="")
    both = FunctionSpec(name="b", entry="m:C", handler="", model="resnet152")
    assert runs_on(emulated_only, "emulated") is None
    assert "only emulated" in runs_on(emulated_only, "cpu") and runs_on(emulated_only, "nvml")
    assert runs_on(user, "cpu") is None and runs_on(user, "nvml") is None
    assert "emulation" in runs_on(user, "emulated")
    assert all(runs_on(both, d) is None for d in ("cpu", "nvml", "emulated"))
    assert "llama9" in runs_on(FunctionSpec(name="x", model="llama9"), "emulated")


def _gpu_node(name, memory, healthy=True):
    return NodeInventory(node=name, device="emulated", gpus=[
        GpuInfo(index=0, uuid=f"GPU-{name}", name="A100", memory_bytes=memory, sms=108, healthy=healthy)])


def test_admission_finds_the_nodes_that_fit_or_says_why_none_does():
    spec = FunctionSpec(name="f", model="bert_base", memory_bytes=30 * GiB)
    nodes, why = admission(spec, {})
    assert not nodes and "no node" in why
    inv = {"a": _gpu_node("a", 24 * GiB), "b": _gpu_node("b", 40 * GiB), "c": _gpu_node("c", 80 * GiB, healthy=False)}
    assert admission(spec, inv) == (["b"], "")
    nodes, why = admission(spec, {"a": inv["a"], "c": inv["c"]})
    assert not nodes and str(24 * GiB) in why and "1 more" in why
    nodes, why = admission(FunctionSpec(name="u", entry="m:C", handler="", memory_bytes=GiB), inv)
    assert not nodes and "emulation" in why


def test_operator_profile_is_used_as_given_within_the_specs_bounds():
    spec = FunctionSpec(name="f", max_batch=4, profile=Profile(function="other", request_quota=0.3,
                                                                limit_quota=0.2, batch_size=8, trials=7))
    p = given_profile(spec)
    assert (p.function, p.request_quota, p.limit_quota, p.batch_size, p.trials, p.backend) == (
        "f", 0.3, 0.3, 4, 0, "operator")
    with pytest.raises(ValueError):
        given_profile(FunctionSpec(name="g"))
    c = cpu_profile(FunctionSpec(name="f", max_batch=2))
    assert (c.request_quota, c.limit_quota, c.batch_size) == (CPU_SHARE, CPU_SHARE, min(2, CPU_BATCH))


def _deployed(params: FunctionParams, **cfg) -> HorizontalPolicy:
    p = HorizontalPolicy(HorizontalConfig(stable_window_s=6.0, panic_window_s=1.0, **cfg))
    p.add_function("f", params)
    p.deployed("f", 0.0)
    return p


def test_a_functions_own_initial_scale_and_keep_alive_override_the_scalers():
    p = _deployed(FunctionParams(initial_scale=3, keep_alive_s=5.0, max_instances=8), initial_scale=1, keep_alive_s=600)
    p.record("f", 0.5, 0, 0)
    assert p.decide("f", 0.5).desired == 3, "the function's initial scale"
    for k in range(3):
        p.instance_ready("f", f"i{k}", 1.0)
    p.record("f", 4.0, 0, 0)
    assert p.decide("f", 4.0).desired >= 1, "still within its 5 s keep-alive"
    p.record("f", 6.0, 0, 0)
    assert p.decide("f", 6.0).desired == 0, "its own 5 s keep-alive, not the scaler's 600 s"
    q = _deployed(FunctionParams(max_instances=8), initial_scale=2, keep_alive_s=600)
    q.record("f", 0.5, 0, 0)
    assert q.decide("f", 0.5).desired == 2, "-1: the scaler's initial scale"
    q.remove_function("f")
    assert q.functions() == []
