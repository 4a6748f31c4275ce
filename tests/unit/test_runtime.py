"""The instance runtime without NATS: what runs where (choose), the three adapters, llm streaming
step by step, the training loop, the emulated llm/training replay (on a recording stand-in for
the driver), the stats period, and the node agent's per-function metrics."""
from __future__ import annotations

import asyncio
import random
import sys
import textwrap

import pytest
from prometheus_client import REGISTRY

from dilu.contracts import events as ev
from dilu.services.common import models
from dilu.services.common.functions import LLM_REFERENCE_TOKENS
from dilu.services.node_agent import function_metrics as fm
from dilu.services.node_agent import runtime
from dilu.services.node_agent.handlers import FunctionContext, HandlerContext, emulated

EMU = runtime.EMULATED_HANDLER


def spec(**kw) -> ev.FunctionSpec:
    kw.setdefault("name", "f")
    return ev.FunctionSpec(**kw)


# ----------------------------------------------------------------------------------- choose


def test_without_a_spec_the_command_line_decides():
    plan = runtime.choose(None, function="f", device="emulated", model="bert_base", handler=EMU)
    assert (plan.source, plan.target, plan.model, plan.kind) == ("emulated", EMU, "bert_base", "inference")
    plan = runtime.choose(None, function="f", device="cpu", model="none", handler="pkg.handler")
    assert (plan.source, plan.target, plan.model) == ("handler", "pkg.handler", "")


def test_an_emulated_gpu_runs_the_emulated_handler_even_for_a_class():
    s = spec(entry="app:Model", code="sha256-x", model="llama2", kind="llm", max_batch=4, cold_start_ms=5.0)
    plan = runtime.choose(s, function="f", device="emulated")
    assert (plan.source, plan.target, plan.model, plan.kind) == ("emulated", EMU, "llama2", "llm")
    assert plan.cold_start_ms == 5.0 and plan.code == ""


def test_an_emulated_gpu_refuses_a_function_without_a_catalogue_model():
    with pytest.raises(runtime.LoadError, match=r"'f' cannot load: .*\[emulation\] model"):
        runtime.choose(spec(entry="app:Model"), function="f", device="emulated")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_real_device_runs_the_users_class_from_its_bundle(device):
    s = spec(entry="app:Model", code="sha256-abc", kind="training", config={"lr": "0.1"})
    plan = runtime.choose(s, function="f", device=device)
    assert (plan.source, plan.target, plan.code, plan.kind) == ("class", "app:Model", "sha256-abc", "training")
    assert plan.config == {"lr": "0.1"}


def test_a_real_device_runs_a_handler_module_and_refuses_the_emulated_one():
    assert runtime.choose(spec(handler="pkg.h"), function="f", device="cpu").source == "handler"
    with pytest.raises(runtime.LoadError, match="no code to run"):
        runtime.choose(spec(), function="f", device="cpu")  # default handler: the emulated one


@pytest.mark.parametrize("entry", ["app", "app:", ":Model", "app:Mo-del", "a:b:c"])
def test_a_malformed_entry_is_a_load_error(entry):
    with pytest.raises(runtime.LoadError, match="module:Class"):
        runtime.choose(spec(entry=entry), function="f", device="cpu")


def test_context_carries_kind_config_and_the_training_batch():
    plan = runtime.choose(spec(entry="app:M", kind="training", max_batch=16, config={"a": "b"}), function="f", device="cpu")
    ctx = runtime.context_for(plan, instance_id="i1", batch_size=2, width=0.5, device="cpu")
    assert ctx == FunctionContext(instance_id="i1", function="f", model="", batch_size=16, width=0.5,
                                  device="cpu", kind="training", config={"a": "b"})
    inf = runtime.choose(spec(entry="app:M", max_batch=16), function="f", device="cpu")
    assert runtime.context_for(inf, instance_id="i1", batch_size=2, width=1.0, device="cpu").batch_size == 2
    assert HandlerContext is FunctionContext  # handlers written against the old name keep working


# ----------------------------------------------------------------------------------- adapters


@pytest.fixture
def code_dir(tmp_path, monkeypatch):
    """A folder for a user's modules; modules imported from it are forgotten afterwards."""
    before = set(sys.modules)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("userfn_"):
            del sys.modules[name]


def write(folder, name, source):
    (folder / f"{name}.py").write_text(textwrap.dedent(source))


USER_CLASS = """
    class Echo:
        def __init__(self, ctx):
            self.prefix = ctx.config.get("prefix", "").encode()
            self.ctx = ctx
            self.closed = False

        def predict(self, batch):
            return [self.prefix + b for b in batch]

        def close(self):
            self.closed = True
"""


def ctx_for(plan, batch_size=4):
    return runtime.context_for(plan, instance_id="i1", batch_size=batch_size, width=1.0, device="cpu")


def test_a_users_class_loads_from_its_folder_and_predicts(code_dir):
    write(code_dir, "userfn_echo", USER_CLASS)
    plan = runtime.choose(spec(entry="userfn_echo:Echo", config={"prefix": ">"}), function="f", device="cpu")
    rt = runtime.build(plan, ctx_for(plan), code_dir)
    assert isinstance(rt, runtime.ClassRuntime)
    assert rt.predict([b"a", b"bc"]) == [b">a", b">bc"]
    assert rt.obj.ctx.kind == "inference" and rt.obj.ctx.function == "f"
    with pytest.raises(runtime.WrongKind, match="no train_step"):
        rt.train_step()
    rt.close()
    assert rt.obj.closed


def test_a_class_missing_its_kinds_method_is_a_load_error(code_dir):
    write(code_dir, "userfn_nogen", USER_CLASS)
    plan = runtime.choose(spec(entry="userfn_nogen:Echo", kind="llm"), function="f", device="cpu")
    with pytest.raises(runtime.LoadError, match=r"'f' cannot load: class 'userfn_nogen:Echo' has no generate method \(kind llm\)"):
        runtime.build(plan, ctx_for(plan), code_dir)


@pytest.mark.parametrize("source,entry,reason", [
    ("x = (", "userfn_bad:Echo", "importing 'userfn_bad' failed: SyntaxError"),
    (USER_CLASS, "userfn_bad:Missing", "has no 'Missing'"),
    ("Echo = 3\n", "userfn_bad:Echo", "is not a class"),
    ("class Echo:\n    def __init__(self, ctx):\n        raise OSError('weights\\nmissing')\n    def predict(self, b):\n        return b\n",
     "userfn_bad:Echo", "loading userfn_bad:Echo failed: OSError: weights missing"),
])
def test_a_class_that_cannot_load_is_one_clear_line(code_dir, source, entry, reason):
    write(code_dir, "userfn_bad", source)
    plan = runtime.choose(spec(entry=entry), function="f", device="cpu")
    with pytest.raises(runtime.LoadError) as err:
        runtime.build(plan, ctx_for(plan), code_dir)
    assert reason in str(err.value) and "'f'" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_module_that_is_not_there_is_a_load_error(code_dir):
    plan = runtime.choose(spec(entry="userfn_absent:Echo"), function="f", device="cpu")
    with pytest.raises(runtime.LoadError, match="ModuleNotFoundError"):
        runtime.build(plan, ctx_for(plan), code_dir)


def test_a_handler_module_loads_and_predicts(code_dir):
    write(code_dir, "userfn_handler", """
        def load(ctx):
            return {"n": ctx.batch_size}

        def predict(state, batch):
            return [b"%d" % state["n"] for _ in batch]
    """)
    sys.path.insert(0, str(code_dir))
    plan = runtime.choose(spec(handler="userfn_handler"), function="f", device="cpu")
    rt = runtime.build(plan, ctx_for(plan, batch_size=3))
    assert isinstance(rt, runtime.HandlerRuntime)
    assert rt.predict([b"x", b"y"]) == [b"3", b"3"]
    plan = runtime.choose(spec(handler="userfn_handler", kind="training"), function="f", device="cpu")
    with pytest.raises(runtime.LoadError, match="has no train_step function"):
        runtime.build(plan, ctx_for(plan))


# ----------------------------------------------------------------------------- llm, training


class Steps(runtime.FunctionRuntime):
    """A generate of fixed steps (then optionally an error)."""

    def __init__(self, steps, error=None):
        self.steps, self.error = steps, error

    def generate(self, batch):
        yield from self.steps
        if self.error:
            raise self.error


async def collect(rt, n):
    sent = []

    async def on_chunk(i, chunk):
        sent.append((i, chunk))

    return await runtime.run_generate(rt, [b""] * n, on_chunk), sent


async def test_generate_streams_each_chunk_in_order_and_joins_the_reply():
    rt = Steps([[b"a", b"x"], [b"b", None], [None, None], [b"c", None]])
    out, sent = await collect(rt, 2)
    assert out == [b"abc", b"x"]
    assert sent == [(0, b"a"), (1, b"x"), (0, b"b"), (0, b"c")]


async def test_a_bad_chunk_fails_its_request_alone():
    out, sent = await collect(Steps([[b"a", "text"], [b"b", b"late"]]), 2)
    assert out[0] == b"ab"
    assert isinstance(out[1], TypeError) and "str chunk" in str(out[1])
    assert (1, b"late") not in sent


async def test_an_error_mid_stream_fails_the_requests_after_their_chunks():
    out, sent = await collect(Steps([[b"a", b"b"]], error=RuntimeError("boom")), 2)
    assert sent == [(0, b"a"), (1, b"b")]
    assert all(isinstance(o, RuntimeError) for o in out)
    out, _ = await collect(Steps([[b"a"]]), 2)  # a step of the wrong length
    assert all(isinstance(o, ValueError) for o in out)


async def test_generation_stops_once_every_caller_withdrew_and_frees_what_it_held():
    class Endless(runtime.FunctionRuntime):
        made = 0
        closed = False

        def generate(self, batch):
            try:
                while True:
                    self.made += 1
                    yield [b"t"] * len(batch)
            finally:  # the function's clean-up runs: its KV cache, say, is freed
                self.closed = True

    rt, sent = Endless(), []

    async def on_chunk(i, chunk):
        sent.append(i)

    out = await runtime.run_generate(rt, [b"", b""], on_chunk, stop=lambda: len(sent) >= 6)
    assert rt.made == 3 and rt.closed and len(sent) == 6  # no step after stop() said so
    assert all(isinstance(o, runtime.Withdrawn) for o in out)


async def test_training_loop_stops_on_stop_after_the_step_in_progress():
    stop = asyncio.Event()

    class Trainer(runtime.FunctionRuntime):
        steps = 0

        def train_step(self):
            self.steps += 1
            if self.steps == 3:
                stop.set()  # set while a step runs: that step still counts

    trainer, seen = Trainer(), []
    assert await runtime.train_loop(trainer, stop, lambda: seen.append(1)) == 3
    assert trainer.steps == 3 and len(seen) == 3
    assert await runtime.train_loop(trainer, stop) == 0  # stopped before it began: no step


# ------------------------------------------------------------------------------ emulated model


class RecordingDriver:
    def __init__(self):
        self.launched_us: list[float] = []
        self.grids: list[int] = []
        self.syncs = 0

    def launch(self, fn, duration_us, stream=None, grid=1):
        self.launched_us.append(duration_us)
        self.grids.append(grid)

    def synchronize(self):
        self.syncs += 1


def emulated_model(name, width=1.0, batch_size=1):
    spec_ = models.spec(name)
    return emulated.EmulatedModel(driver=RecordingDriver(), spec=spec_, width=width,
                                  kernels=list(range(spec_.kernels_per_step)), batch_size=batch_size)


@pytest.mark.parametrize("payload,expected", [
    (b'{"prompt_tokens": 64, "max_new_tokens": 3}', (64, 3)),
    (b'{"max_new_tokens": 5}', (128, 5)),
    (b"{}", (128, LLM_REFERENCE_TOKENS)),
    (b"not json", (128, 32)),
    (b"\xff\xfe", (128, 32)),
    (b"[1, 2]", (128, 32)),
    (b'{"prompt_tokens": "64", "max_new_tokens": 2.5}', (128, 32)),
    (b'{"prompt_tokens": true, "max_new_tokens": false}', (128, 32)),
    (b'{"prompt_tokens": 100000, "max_new_tokens": 5000}', (32768, 1024)),
    (b'{"prompt_tokens": 0, "max_new_tokens": -4}', (1, 1)),
])
def test_llm_payload_parsing(payload, expected):
    assert emulated.parse_llm_payload(payload) == expected


def test_emulated_generate_prefills_then_decodes_each_request_to_its_length():
    m = emulated_model("llama2", width=0.5)
    batch = [b'{"prompt_tokens": 100, "max_new_tokens": 2}', b'{"prompt_tokens": 28, "max_new_tokens": 4}']
    steps = list(emulated.generate(m, batch))
    assert len(steps) == 1 + 4  # the prefill, then the longest request's decode steps
    assert steps[0] == [None, None]
    assert steps[1:] == [[b"tok0 ", b"tok0 "], [b"tok1 ", b"tok1 "], [None, b"tok2 "], [None, b"tok3 "]]
    k = m.spec.kernels_per_step
    step_ms = [sum(m.driver.launched_us[i:i + k]) / 1000.0 for i in range(0, len(m.driver.launched_us), k)]
    assert len(step_ms) == 5 and m.driver.syncs == 5
    assert step_ms[0] == pytest.approx(emulated.prefill_ms("llama2", 128, 0.5))
    # prefill: 2 x 6.74e9 params x 128 tokens at 0.5 x 312 TFLOPS, on half the SMs
    assert step_ms[0] == pytest.approx(2 * 6.74e9 * 128 / 156e12 / 0.5 * 1000)
    # decode steps at the surface's per-token latency of the requests still generating
    assert step_ms[1:] == pytest.approx([models.step_latency_ms("llama2", b, 0.5) for b in (2, 2, 1, 1)])
    # each step's grid follows its work (the interceptor's cost key): 128 prompt tokens are one
    # tile, then the requests still generating
    assert m.driver.grids[::k] == [1, 2, 2, 1, 1]


def test_emulated_training_iteration_is_forward_plus_twice_backward():
    m = emulated_model("resnet152", width=0.4, batch_size=8)
    emulated.train_step(m)
    assert len(m.driver.launched_us) == 3 * m.spec.kernels_per_step
    assert sum(m.driver.launched_us) / 1000.0 == pytest.approx(3 * models.latency_ms("resnet152", 8, 0.4))
    assert set(m.driver.grids) == {8}


def test_an_emulated_batch_launches_over_a_grid_of_its_size():
    m = emulated_model("bert_base")
    for b in (1, 4, 2):
        emulated.run_batch(m, b)
    k = m.spec.kernels_per_step
    assert m.driver.grids == [1] * k + [4] * k + [2] * k


def test_emulated_runtime_adapts_the_handler():
    m = emulated_model("bert_base", batch_size=2)
    rt = runtime.EmulatedRuntime(emulated, m, "training")
    rt.train_step()
    assert rt.predict([b"abc"]) == [b"3"]
    assert len(list(rt.generate([b"{}"]))) == 1 + LLM_REFERENCE_TOKENS


# ------------------------------------------------------------------------------------ stats


def test_stats_window_counts_exactly_and_bounds_its_samples():
    w = runtime.StatsWindow("f", "i1", "n1", start_ns=0, max_values=10, rng=random.Random(1))
    assert w.take(10**9) is None  # nothing done: nothing to publish
    for i in range(25):
        w.request(ok=i % 5 != 0, latency_ms=float(i), cold_start=i < 3)
    w.request(ok=True, latency_ms=float("nan"))
    w.stream(ttft_ms=-1.0, tpot_ms=None)
    w.iteration(4)
    s = w.take(3 * 10**9)
    assert (s.ok, s.errors, s.cold_starts, s.iterations) == (21, 5, 3, 4)
    assert len(s.latency_ms) == 10 and set(s.latency_ms) <= set(map(float, range(25))) | {0.0}
    assert s.ttft_ms == [0.0] and s.tpot_ms == []
    assert s.period_ms == pytest.approx(2000.0)
    assert (s.function, s.instance_id, s.node) == ("f", "i1", "n1")
    assert w.take(4 * 10**9) is None  # a new, empty period


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_function_metrics_export_counts_and_histograms():
    metrics = fm.FunctionMetrics()
    before = (sample("dilu_function_requests_total", function="fm-a", status="ok"),
              sample("dilu_function_latency_seconds_count", function="fm-a"),
              sample("dilu_function_tpot_seconds_bucket", function="fm-a", le="0.05"))
    metrics.observe(ev.FunctionStats(function="fm-a", instance_id="i", ok=3, errors=1, cold_starts=2,
                                     latency_ms=[10.0, 20.0], ttft_ms=[100.0], tpot_ms=[40.0], iterations=7))
    assert sample("dilu_function_requests_total", function="fm-a", status="ok") - before[0] == 3
    assert sample("dilu_function_requests_total", function="fm-a", status="error") >= 1
    assert sample("dilu_function_latency_seconds_count", function="fm-a") - before[1] == 2
    assert sample("dilu_function_tpot_seconds_bucket", function="fm-a", le="0.05") - before[2] == 1
    assert sample("dilu_function_cold_starts_total", function="fm-a") >= 2
    assert sample("dilu_training_iterations_total", function="fm-a") >= 7


def test_function_labels_are_bounded():
    metrics = fm.FunctionMetrics(max_functions=2)
    assert [metrics.label(f) for f in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


@pytest.mark.parametrize("bad,why", [
    (dict(function=""), "must not be empty"),
    (dict(latency_ms=[1.0, -2.0]), "latency_ms"),
    (dict(tpot_ms=[float("inf")]), "tpot_ms"),
    (dict(period_ms=float("nan")), "period_ms"),
])
def test_nonsense_stats_are_refused(bad, why):
    fields = dict(function="f", instance_id="i") | bad
    assert why in fm.problem(ev.FunctionStats(**fields))
    assert fm.problem(ev.FunctionStats(function="f", instance_id="i", latency_ms=[0.0, 5.0])) is None
