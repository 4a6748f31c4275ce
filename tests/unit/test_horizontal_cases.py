"""Field failure cases 4 and 5 (issue 6) for the horizontal scaling policy, on a fake clock.

A small discrete-time simulation drives the pure policy: requests arrive open loop, wait in one
FIFO work queue, are served one at a time per ready instance for a fixed service time; instances
take a start time to become ready; a retired ready instance drains (finishes its request, takes
no new one); a cancelled starting instance disappears. Every request is tracked to its answer.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st


from dilu.services.horizontal_scaler.policy import FunctionParams, HorizontalConfig, HorizontalPolicy

FN = "f"


class Sim:
    """Integer-millisecond simulation of one function under ``policy``.

    ``arrivals(t_ms)`` gives the number of requests arriving at ``t_ms`` (multiples of
    ``step_ms``). The backlog reported each tick is the time average of (queued + in flight)
    over the tick, as Knative's queue proxy reports concurrency.
    """

    def __init__(self, policy: HorizontalPolicy, *, service_ms: int, start_ms: int, tick_ms: int,
                 step_ms: int, timeout_ms: int, warm: int = 0, t0_ms: int = 0) -> None:
        self.p, self.service, self.start, self.tick, self.step_ms = policy, service_ms, start_ms, tick_ms, step_ms
        self.timeout = timeout_ms
        self.t = t0_ms
        self.queue: deque[tuple[int, int]] = deque()
        self.inst: dict[str, dict] = {}
        self.next_id = 0
        self.arrived = 0
        self.latency: dict[int, int] = {}
        self.failed = 0
        self.cancelled: list[str] = []
        self.drained: list[str] = []
        self.decisions = []
        self.area = 0.0
        self.arrivals_in_tick = 0
        for _ in range(warm):
            iid = self._new(ready_at=self.t)
            self.inst[iid]["state"] = "ready"
            policy.instance_ready(FN, iid, self.t / 1000)

    def _new(self, ready_at: int) -> str:
        iid = f"i{self.next_id}"
        self.next_id += 1
        self.inst[iid] = dict(state="starting", ready_at=ready_at, busy_until=0, req=None)
        self.p.instance_starting(FN, iid, self.t / 1000)
        return iid

    def in_flight(self) -> int:
        return sum(1 for i in self.inst.values() if i["req"] is not None)

    def run_until(self, end_ms: int, arrivals: Callable[[int], int]) -> None:
        while self.t < end_ms:
            self._step(arrivals(self.t))

    def _step(self, arriving: int) -> None:
        t = self.t
        for iid, i in list(self.inst.items()):
            if i["req"] is not None and i["busy_until"] <= t:
                rid, arrived = i["req"]
                self.latency[rid] = t - arrived
                i["req"] = None
            if i["state"] == "draining" and i["req"] is None:
                del self.inst[iid]
                self.drained.append(iid)
                self.p.instance_retired(FN, iid)
            elif i["state"] == "starting" and i["ready_at"] <= t:
                i["state"] = "ready"
                self.p.instance_ready(FN, iid, t / 1000)
        for _ in range(arriving):
            self.queue.append((self.arrived, t))
            self.arrived += 1
        self.arrivals_in_tick += arriving
        for iid in sorted(self.inst, key=lambda k: int(k[1:])):
            i = self.inst[iid]
            while i["state"] == "ready" and i["req"] is None and self.queue:
                rid, arrived = self.queue.popleft()
                if t - arrived > self.timeout:
                    self.failed += 1  # waited too long: the caller gave up
                    continue
                i["req"], i["busy_until"] = (rid, arrived), t + self.service
        self.area += (len(self.queue) + self.in_flight()) * self.step_ms
        self.t += self.step_ms
        if self.t % self.tick == 0:
            self._tick()

    def _tick(self) -> None:
        now = self.t / 1000
        for iid, i in self.inst.items():
            self.p.set_busy(FN, iid, 1.0 if i["req"] is not None else 0.0)
        self.p.record(FN, now, self.area / self.tick, self.arrivals_in_tick)
        self.area, self.arrivals_in_tick = 0.0, 0
        d = self.p.decide(FN, now, headroom=0.0)
        self.decisions.append(d)
        if self.queue or self.in_flight():
            assert d.desired >= 1, d  # work waiting never leaves the function without an instance
        for _ in range(d.place):
            self._new(ready_at=self.t + self.start)
        for iid in d.retire:
            i = self.inst[iid]
            if i["state"] == "starting":
                del self.inst[iid]
                self.cancelled.append(iid)
                self.p.instance_retired(FN, iid)
            else:
                i["state"] = "draining"

    def live(self) -> int:
        return sum(1 for i in self.inst.values() if i["state"] != "draining")


def direction_changes(decisions) -> int:
    dirs = [+1 if d.place else -1 for d in decisions if d.place or d.retire]
    return sum(1 for a, b in zip(dirs, dirs[1:]) if a != b)


# ---------------------------------------------------------------------- case 4


def test_case4_panic_decision_is_never_below_the_stable_estimate():
    # Knative's issue in its own numbers: a target of 10 used whole (target utilisation 1)
    cfg = HorizontalConfig(mode="eager", stable_window_s=6.0, panic_window_s=5.0, target_utilization=1.0)
    p = HorizontalPolicy(cfg)
    p.add_function(FN, FunctionParams(target=10.0, max_instances=1000))
    p.instance_ready(FN, "i0", 0.0)
    for t, c in enumerate([1000, 0, 0, 0, 0, 1000]):  # per-second concurrency
        p.record(FN, float(t), c)
    d = p.decide(FN, 5.0)
    assert (d.panic_estimate, d.stable_estimate) == (20, 34)
    assert d.panic  # 20 instances needed on 1 ready one: far over the 200 % threshold
    assert d.desired == 34 and d.place == 33


def test_case4_leaving_panic_does_not_undo_the_scale_up():
    cfg = HorizontalConfig(mode="eager", stable_window_s=60.0, panic_window_s=6.0)
    p = HorizontalPolicy(cfg)
    p.add_function(FN, FunctionParams(target=1.0, max_instances=200))
    p.instance_ready(FN, "i0", -30.0)
    tick, cold_start, load_end = 0.5, 20.0, 150.0
    starting: dict[str, float] = {}
    desired, panics = [], []
    t = -10.0
    n = 1
    while t < load_end:
        t = round(t + tick, 3)
        for iid, ready_at in list(starting.items()):
            if ready_at <= t:
                p.instance_ready(FN, iid, t)
                del starting[iid]
        p.record(FN, t, 50.0 if t > 0 else 0.0)
        d = p.decide(FN, t)
        for _ in range(d.place):
            starting[f"i{n}"] = t + cold_start
            p.instance_starting(FN, f"i{n}", t)
            n += 1
        assert not d.retire or t < 0
        desired.append((t, d.desired))
        panics.append((t, d.panic))
    after6 = [v for ts, v in desired if 6.0 <= ts < load_end]
    assert min(after6) >= 50
    # panic mode did end while the load went on, and the count did not dip when it did
    ended = [ts for (ts, a), (_, b) in zip(panics, panics[1:]) if a and not b]
    assert ended and 6.0 < ended[0] < load_end
    assert all(v >= 50 for ts, v in desired if ended[0] - 1 <= ts <= ended[0] + 10)


# ---------------------------------------------------------------------- case 5


def test_case5_steady_load_settles_at_littles_law_and_answers_everything():
    cfg = HorizontalConfig(mode="eager", stable_window_s=60.0, panic_window_pct=10.0, keep_alive_s=600.0)
    p = HorizontalPolicy(cfg)
    p.add_function(FN, FunctionParams(target=1.0, max_instances=50))
    sim = Sim(p, service_ms=1000, start_ms=5000, tick_ms=1000, step_ms=50, timeout_ms=60_000)
    sim.run_until(600_000, lambda t: 1 if t % 200 == 50 else 0)  # 5 requests/s for 10 minutes
    late = [d for d in sim.decisions if d.now_s > 120.0]
    counts = [d.current - len(d.retire) + d.place for d in late]
    # λ·S = 5 in flight, 1 per instance used at the 70 % target utilisation: ceil(5 / 0.7) = 8 ± 1
    assert min(counts) >= 7 and max(counts) <= 9
    assert 7.5 <= sum(counts) / len(counts) <= 8.5
    assert direction_changes(late) <= 2
    sim.run_until(700_000, lambda t: 0)  # no more arrivals: everything queued gets answered
    assert sim.arrived == 3000
    assert sim.failed == 0 and len(sim.latency) == sim.arrived


def test_case5_scale_in_cancels_starting_instances_and_keeps_the_warm_ones():
    cfg = HorizontalConfig(mode="eager", stable_window_s=4.0, panic_window_s=1.0, keep_alive_s=600.0)
    p = HorizontalPolicy(cfg)
    p.add_function(FN, FunctionParams(target=1.0, max_instances=6))
    sim = Sim(p, service_ms=100, start_ms=10_000, tick_ms=500, step_ms=10, timeout_ms=5000, warm=2, t0_ms=-10_000)
    baseline = lambda t: 1 if t % 80 == 0 else 0  # 12.5 requests/s: 1.25 in flight, 2 instances
    sim.run_until(0, baseline)
    assert sim.live() == 2 and sim.next_id == 2  # steady at 2 before the burst
    burst = lambda t: baseline(t) + (12 if t == 0 else 0)  # a burst at t = 0 that is served by ~2 s
    sim.run_until(9_000, burst)
    peak = max(d.current + d.place for d in sim.decisions)
    assert peak == 6  # scaled 2 -> 6
    assert sorted(sim.cancelled) == ["i2", "i3", "i4", "i5"]  # the 4 starting ones, cancelled ...
    assert sim.drained == [] and {"i0", "i1"} <= set(sim.inst)  # ... and both warm ones survive
    sim.run_until(20_000, baseline)
    assert sim.failed == 0
    sim.run_until(25_000, lambda t: 0)
    assert len(sim.latency) == sim.arrived


# ---------------------------------------------------------------------- no request lost, any load

@settings(max_examples=25, deadline=None)
@given(rates=st.lists(st.integers(0, 12), min_size=3, max_size=12), start_ms=st.sampled_from([0, 1000, 4000]),
       mode=st.sampled_from(["lazy", "eager"]), keep_alive=st.sampled_from([1.0, 5.0]))
def test_any_load_every_request_is_answered_and_bounds_hold(rates, start_ms, mode, keep_alive):
    """Per-5-s arrival rates (requests/s, 0 = idle gaps that allow scale to zero): every request
    is answered, instances stay within bounds, and (checked each tick by the simulation) work
    waiting never leaves the function without an instance."""
    cfg = HorizontalConfig(mode=mode, stable_window_s=6.0, panic_window_s=1.0, keep_alive_s=keep_alive)
    p = HorizontalPolicy(cfg)
    p.add_function(FN, FunctionParams(target=1.0, max_instances=10))
    sim = Sim(p, service_ms=500, start_ms=start_ms, tick_ms=500, step_ms=50, timeout_ms=10**9)

    def arrivals(t):  # one request every period (rounded to the 50 ms step): about r per second
        r = rates[min(len(rates) - 1, t // 5000)]
        return 1 if r and t % max(50, (1000 // r) // 50 * 50) == 0 else 0

    sim.run_until(5000 * len(rates), arrivals)
    sim.run_until(5000 * len(rates) + 60_000, lambda t: 0)
    assert len(sim.latency) == sim.arrived and sim.failed == 0
    assert all(0 <= d.desired <= 10 and d.current + d.place <= 10 for d in sim.decisions)
