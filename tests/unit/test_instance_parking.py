"""Parking an idle instance live, the runtime's half: ``parkable``, ``park()`` and ``resume()`` of
each adapter (emulated model, user class, handler module, the built-in torch handlers), and the
instance's reaction to the park and resume signals, its state lines (Control)."""
from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import textwrap
import types
import uuid

import pytest

from dilu.interceptor.cuda import CUDA_ERROR_OUT_OF_MEMORY, CudaError
from dilu.services.common import logging as dlog
from dilu.services.common import models
from dilu.services.node_agent import instance, runtime
from dilu.services.node_agent.handlers import FunctionContext, emulated

# ------------------------------------------------------------------------------ emulated model


class MemoryDriver:
    """A driver that keeps count of device memory: ``used`` bytes, live pointers, and a budget
    past which an allocation is refused with CUDA_ERROR_OUT_OF_MEMORY."""

    def __init__(self, budget: int = 1 << 40):
        self.budget, self.used, self.live, self.next_ptr = budget, 0, {}, 0x1000
        self.frees: list[int] = []

    def function(self, name):
        return name

    def launch(self, fn, duration_us, stream=None, grid=1):
        pass

    def synchronize(self):
        pass

    def mem_alloc(self, nbytes):
        if self.used + nbytes > self.budget:
            raise CudaError("cuMemAlloc_v2", CUDA_ERROR_OUT_OF_MEMORY)
        ptr, self.next_ptr = self.next_ptr, self.next_ptr + nbytes
        self.live[ptr] = nbytes
        self.used += nbytes
        return ptr

    def mem_free(self, ptr):
        self.used -= self.live.pop(ptr)  # KeyError for a pointer never allocated or freed twice
        self.frees.append(ptr)


@pytest.fixture
def slept(monkeypatch):
    """The emulated handler's sleeps (s), recorded instead of slept."""
    got: list[float] = []
    monkeypatch.setattr(emulated.time, "sleep", got.append)
    return got


def loaded(monkeypatch, driver: MemoryDriver, model: str = "bert_base", cold_start_ms: float = 300.0):
    monkeypatch.setattr(emulated.Driver, "load", staticmethod(lambda *a: driver))
    ctx = FunctionContext(instance_id="i1", function="f", model=model, device="emulated")
    return runtime.EmulatedRuntime(emulated, emulated.load(ctx, cold_start_ms=cold_start_ms), "inference")


def test_emulated_park_frees_the_weights_and_resume_brings_them_back_in_resume_ms(monkeypatch, slept):
    driver = MemoryDriver()
    rt = loaded(monkeypatch, driver)
    weights = models.weight_bytes("bert_base")
    assert rt.parkable
    assert driver.used == weights and slept == [0.3]  # the load: its spec's cold start
    first = rt.state.weights

    rt.park()
    assert driver.used == 0 and driver.frees == [first] and rt.state.weights is None
    assert slept == [0.3]  # a park delays nobody: no emulated copy time
    rt.park()  # parked already: nothing more to free
    assert driver.frees == [first]

    rt.resume()
    assert driver.used == weights and rt.state.weights is not None
    assert slept[1:] == [pytest.approx(models.resume_ms(300.0) / 1000.0)]
    assert models.resume_ms(300.0) == pytest.approx(100.0)  # 4 GB/s load, 12 GB/s from pinned memory
    rt.resume()  # resumed already: no second allocation
    assert driver.used == weights and len(slept) == 2
    assert rt.predict([b"abc"]) == [b"3"]


def test_emulated_resume_refused_by_the_device_raises_and_costs_no_wait(monkeypatch, slept):
    driver = MemoryDriver()
    rt = loaded(monkeypatch, driver)
    rt.park()
    driver.budget = 1 << 20  # a neighbour took the room meanwhile
    with pytest.raises(CudaError) as err:
        rt.resume()
    assert err.value.code == CUDA_ERROR_OUT_OF_MEMORY
    assert rt.state.weights is None and len(slept) == 1  # only the load slept


def test_emulated_resume_time_follows_the_models_own_load_time(monkeypatch, slept):
    rt = loaded(monkeypatch, MemoryDriver(), model="resnet152", cold_start_ms=0.0)  # no spec value
    rt.park()
    rt.resume()
    assert slept == [pytest.approx(models.cold_start_ms("resnet152") / 1000.0),
                     pytest.approx(models.resume_ms(models.cold_start_ms("resnet152")) / 1000.0)]


FAKE_DRIVER_CHECK = textwrap.dedent("""
    import json, time
    from dilu.interceptor.cuda import Driver
    from dilu.services.node_agent import runtime
    from dilu.services.node_agent.handlers import FunctionContext, emulated
    ctx = FunctionContext(instance_id="i1", function="f", model="bert_base", device="emulated")
    rt = runtime.EmulatedRuntime(emulated, emulated.load(ctx, cold_start_ms=300.0), "inference")
    out = {"loaded": rt.state.driver.mem_get_info()}
    rt.park()
    out["parked"] = Driver.load().mem_get_info()  # as another process on the GPU would read it
    t0 = time.perf_counter()
    rt.resume()
    out["resume_ms"] = (time.perf_counter() - t0) * 1000.0
    out["resumed"] = rt.state.driver.mem_get_info()
    out["outputs"] = [o.decode() for o in rt.predict([b"ab"])]
    print(json.dumps(out))
""")


@pytest.mark.native
def test_emulated_park_gives_the_memory_back_on_the_fake_driver():
    from dilu.interceptor import native, timeline

    native.build()
    gpu = f"test-park-{uuid.uuid4().hex[:8]}"
    total = 8 << 30
    env = native.emulated_gpu_env(dict(os.environ), gpu_name=gpu, memory_bytes=total)
    try:
        done = subprocess.run([sys.executable, "-c", FAKE_DRIVER_CHECK], env=env, capture_output=True,
                              text=True, timeout=60)
    finally:
        timeline.unlink_gpu(gpu)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    weights = models.weight_bytes("bert_base")
    assert out["loaded"] == [total - weights, total]
    assert out["parked"] == [total, total]
    assert out["resumed"] == [total - weights, total]
    assert out["resume_ms"] >= models.resume_ms(300.0) * 0.95  # the copy from host memory, 100 ms
    assert out["outputs"] == ["2"]


# ------------------------------------------------------------------------- class and handler


class Model:
    def __init__(self):
        self.calls: list[str] = []

    def predict(self, batch):
        return list(batch)


class ParkableModel(Model):
    def park(self):
        self.calls.append("park")

    def resume(self):
        self.calls.append("resume")


class HalfParkable(Model):
    def park(self):  # no resume: it could not come back
        self.calls.append("park")


class NotCallable(Model):
    park = resume = None


def test_a_class_with_park_and_resume_is_parkable_and_they_are_called():
    obj = ParkableModel()
    rt = runtime.ClassRuntime(obj, "inference", "app:ParkableModel")
    assert rt.parkable
    rt.park()
    rt.resume()
    assert obj.calls == ["park", "resume"]


@pytest.mark.parametrize("cls", [Model, HalfParkable, NotCallable])
def test_a_class_without_both_is_not_parkable_and_park_says_so(cls):
    obj = cls()
    rt = runtime.ClassRuntime(obj, "inference", f"app:{cls.__name__}")
    assert not rt.parkable
    with pytest.raises(runtime.NotParkable, match=f"class app:{cls.__name__} cannot park"):
        rt.park()
    with pytest.raises(runtime.NotParkable, match="cannot resume"):
        rt.resume()
    assert obj.calls == []  # HalfParkable's park is not run: it could not be undone


def test_a_class_raising_in_park_raises_through():
    class Broken(ParkableModel):
        def park(self):
            raise MemoryError("no host memory")

    with pytest.raises(MemoryError, match="no host memory"):
        runtime.ClassRuntime(Broken(), "inference", "app:Broken").park()


def handler_module(**fns) -> types.ModuleType:
    module = types.ModuleType("parking_handler")
    module.load = lambda ctx: {}
    module.predict = lambda state, batch: list(batch)
    for name, fn in fns.items():
        setattr(module, name, fn)
    return module


def test_a_handler_module_with_park_and_resume_gets_its_state():
    state: dict = {}
    module = handler_module(park=lambda s: s.setdefault("log", []).append("park"),
                            resume=lambda s: s["log"].append("resume"))
    rt = runtime.HandlerRuntime(module, state, "inference")
    assert rt.parkable
    rt.park()
    rt.resume()
    assert state == {"log": ["park", "resume"]}


@pytest.mark.parametrize("fns", [{}, {"park": lambda s: None}, {"resume": lambda s: None}])
def test_a_handler_module_without_both_is_not_parkable(fns):
    rt = runtime.HandlerRuntime(handler_module(**fns), {}, "inference")
    assert not rt.parkable
    with pytest.raises(runtime.NotParkable, match="handler parking_handler cannot park"):
        rt.park()


def test_the_emulated_handler_module_is_parkable_as_a_handler_too():
    assert runtime.HandlerRuntime(emulated, None, "inference").parkable


# ------------------------------------------------------------------------------ torch handlers


@pytest.mark.parametrize("model", ["resnet50", "gpt2"])
def test_torch_models_park_and_resume_on_the_cpu_keep_the_answers(monkeypatch, model):
    pytest.importorskip("torch")
    from dilu.services.node_agent.handlers import load_module

    monkeypatch.setenv("DILU_TORCH_TINY", "1")
    module = load_module("dilu.services.node_agent.handlers.torch_models")
    ctx = FunctionContext(instance_id="i1", function=model, model=model, batch_size=2, device="cpu")
    rt = runtime.HandlerRuntime(module, module.load(ctx), "inference")
    assert rt.parkable
    before = rt.predict([b"cat", b"dog"])
    rt.park()
    assert all(p.device.type == "cpu" for p in rt.state.net.parameters())
    rt.resume()
    assert all(p.device == rt.state.device for p in rt.state.net.parameters())
    assert rt.predict([b"cat", b"dog"]) == before


def test_the_torch_cnn_handler_is_parkable():
    pytest.importorskip("torch")
    from dilu.services.node_agent.handlers import load_module

    module = load_module("dilu.services.node_agent.handlers.torch_cnn")
    rt = runtime.HandlerRuntime(module, module.load(FunctionContext(instance_id="i1", function="cnn")), "inference")
    before = rt.predict([b"x"])
    rt.park()
    rt.resume()
    assert rt.parkable and rt.predict([b"x"]) == before


# ------------------------------------------------------------------------- the instance's lines


class FakeRuntime(runtime.FunctionRuntime):
    description = "fake"

    def __init__(self, parkable=True, park_error=None, resume_error=None):
        self._parkable, self.park_error, self.resume_error = parkable, park_error, resume_error
        self.calls: list[str] = []

    @property
    def parkable(self):
        return self._parkable

    def park(self):
        self.calls.append("park")
        if self.park_error:
            raise self.park_error

    def resume(self):
        self.calls.append("resume")
        if self.resume_error:
            raise self.resume_error


def an_instance(rt: runtime.FunctionRuntime, kind: str = "inference") -> tuple[instance.Instance, io.StringIO]:
    out = io.StringIO()
    log = dlog.get("test")
    inst = instance.Instance(None, None, rt, instance_id="i1", function="f", node="n1", batch_size=1,
                             cb_path=None, log=log, ready_out=out, control=instance.Control(out, log))
    ctl = inst.control
    ctl.kind, ctl.parkable = kind, kind in instance.PARKABLE_KINDS and rt.parkable
    inst._now_serving()
    return inst, out


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


async def test_the_ready_line_says_parkable_only_when_the_code_can_park():
    assert lines(an_instance(FakeRuntime())[1]) == ["READY parkable"]
    assert lines(an_instance(FakeRuntime(parkable=False))[1]) == ["READY"]
    assert lines(an_instance(FakeRuntime(), kind="training")[1]) == ["READY"]  # nothing to park


async def test_park_then_resume_say_their_lines_and_flip_the_ready_flag():
    rt = FakeRuntime()
    inst, out = an_instance(rt)
    assert inst.cb.ready
    inst.control.on_park(True)
    await inst.park()
    assert (inst.control.state, inst.cb.ready) == ("parked", False)
    inst.control.on_park(False)
    await inst.resume()
    assert (inst.control.state, inst.cb.ready) == ("serving", True)
    assert rt.calls == ["park", "resume"]
    assert lines(out) == ["READY parkable", "PARKED", "READY parkable"]


async def test_a_signal_for_the_state_it_is_in_repeats_that_states_line():
    inst, out = an_instance(FakeRuntime())
    inst.control.on_park(False)  # serving: resume is a no-op
    inst.control.on_park(True)
    await inst.park()
    inst.control.on_park(True)  # parked: park is a no-op
    assert lines(out) == ["READY parkable", "READY parkable", "PARKED", "PARKED"]
    assert inst.rt.calls == ["park"]


async def test_a_park_that_cannot_happen_is_one_line_and_serving_goes_on():
    for rt, reason in ((FakeRuntime(parkable=False), "NotParkable: fake cannot park: it has no park and resume"),
                       (FakeRuntime(park_error=RuntimeError("copy\nfailed")), "RuntimeError: copy failed")):
        inst, out = an_instance(rt)
        inst.control.on_park(True)
        await inst.park()
        assert lines(out) == [lines(out)[0], f"PARK-FAILED {reason}"]
        assert (inst.control.state, inst.control.wanted, inst.cb.ready) == ("serving", False, True)


async def test_a_resume_that_raises_raises_and_says_nothing():
    inst, out = an_instance(FakeRuntime(resume_error=MemoryError("no room")))
    inst.control.on_park(True)
    await inst.park()
    with pytest.raises(MemoryError):  # serve_instance turns it into FAILED and exit 1
        await inst.resume()
    assert lines(out) == ["READY parkable", "PARKED"]


async def test_the_pause_event_follows_park_and_stop_wishes():
    ctl = instance.Control(io.StringIO(), dlog.get("test"))
    ctl.state = "serving"
    pause = ctl.pause()
    assert not pause.is_set()
    ctl.on_park(False)
    assert not pause.is_set()  # resuming what serves: nothing to stop
    ctl.on_park(True)
    assert pause.is_set() and ctl.changed.is_set()
    ctl.wanted = False
    assert not ctl.pause().is_set()
    ctl.stop.set()
    assert ctl.pause().is_set()  # stopped: a new period ends at once


async def test_signals_while_loading_are_remembered_silently():
    out = io.StringIO()
    ctl = instance.Control(out, dlog.get("test"))
    ctl.on_park(True)
    ctl.on_park(False)
    ctl.on_park(True)
    assert ctl.wanted and out.getvalue() == ""  # applied once READY is out


async def test_a_training_instance_ignores_park_and_resume():
    inst, out = an_instance(FakeRuntime(), kind="training")
    inst.control.on_park(True)
    inst.control.on_park(False)
    assert not inst.control.wanted and lines(out) == ["READY"]


async def test_a_parked_instance_waits_for_a_signal_and_exits_on_stop():
    inst, out = an_instance(FakeRuntime())
    ctl = inst.control
    ctl.on_park(True)
    await inst.park()
    serving = asyncio.create_task(inst.serve_requests(process=None))  # parked: never pulls
    await asyncio.sleep(0)
    assert not serving.done() and inst.rt.calls == ["park"]
    ctl.on_park(True)  # a repeat: still parked
    await asyncio.sleep(0)
    assert not serving.done()
    ctl.stop.set()
    ctl.changed.set()
    await asyncio.wait_for(serving, 1)
    assert lines(out) == ["READY parkable", "PARKED", "PARKED"]
