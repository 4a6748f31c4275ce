"""The vertical scaler service: one per node, a thin asyncio shell around :class:`VerticalPolicy`.

Subscribes ``dilu.v1.telemetry.gpu.<node>.*`` (GpuTelemetry),
``dilu.v1.event.kernel_cycle_stretch.<node>.*`` (KernelCycleStretch) and
``dilu.v1.instance.retired.<node>`` (InstanceRetired: the retired instance's share goes back at
once) and ``dilu.v1.instance.parked.<node>`` (InstanceParked: likewise; a resumed instance is
learnt again from telemetry), feeds the policy with the monotonic clock in ms, and publishes each resulting
:class:`TokenGrant` on
``dilu.v1.grant.issued.<node>.<gpu>`` with:

- ``epoch``: increasing per grant from this process, seeded from the wall clock in ms at start so
  a restarted scaler keeps increasing;
- ``cause_ns``: the triggering event's ``detected_ns`` (stretch) or ``ts_ns`` (telemetry), so a
  node agent or a benchmark can measure reaction time (event detected -> grant received).

Decreases go out before increases (the policy orders them). A malformed event is rejected,
logged and counted by the bus (``dilu_malformed_messages`` / ``dilu_handler_errors``); the service
carries on. ``dilu_vertical_grants{node,reason}`` counts the grants sent.

``--mode`` (what ``dilu demo --policy`` selects): ``dilu`` for the dilu policy; ``static``
(grants pinned at the request quota) for horizontal-only; ``static-limit`` (pinned at the limit:
MPS width without pacing) or ``static`` for static-mps; ``off`` (no grants: instances keep their
launch quota) or ``static`` for exclusive; ``published`` (:class:`PublishedVertical`, Dilu as its
paper describes it) for dilu-published.
"""
from __future__ import annotations

import gc
import logging
import time

from prometheus_client import Counter

from dilu.contracts import subjects
from dilu.contracts.events import GpuTelemetry, InstanceParked, InstanceRetired, KernelCycleStretch, TokenGrant
from dilu.services.common.bus import Bus

from .policy import Grant, VerticalConfig, vertical_policy

GRANTS = Counter("dilu_vertical_grants", "TokenGrants sent by the vertical scaler", ["node", "reason"])


def _reason_kind(reason: str) -> str:
    """Low-cardinality label for a grant reason ("pressure: stretch x2.0" -> "pressure")."""
    return reason.split(":", 1)[0].split(" ", 1)[0] or "other"


class VerticalScaler:
    """Service object for :func:`dilu.services.common.runner.serve` (``name``, start/stop/ready)."""

    name = "vertical_scaler"

    def __init__(self, node: str, config: VerticalConfig | None = None) -> None:
        if not node:
            raise ValueError("the vertical scaler needs a node name")
        self.node = node
        self.policy = vertical_policy(config)
        self.bus: Bus | None = None
        self.epoch = time.time_ns() // 1_000_000
        self.grants_sent = 0
        self._ready = False

    async def start(self, bus: Bus) -> None:
        self.bus = bus
        node = subjects.token(self.node)
        await bus.subscribe(f"{subjects.PREFIX}.event.kernel_cycle_stretch.{node}.*", KernelCycleStretch, self._on_stretch)
        await bus.subscribe(f"{subjects.PREFIX}.telemetry.gpu.{node}.*", GpuTelemetry, self._on_telemetry)
        await bus.subscribe(subjects.instance_state("retired", self.node), InstanceRetired, self._on_retired)
        await bus.subscribe(subjects.instance_state("parked", self.node), InstanceParked, self._on_retired)
        bus.log.info("vertical policy", mode=self.policy.config.mode, policy=type(self.policy).__name__)
        # Start-up objects (modules, config) never become garbage: keep the cyclic collector from
        # rescanning them on every collection, which shortens the pauses a grant can wait behind.
        gc.freeze()
        self._ready = True

    async def stop(self) -> None:
        self._ready = False

    def ready(self) -> bool:
        return self._ready

    @staticmethod
    def _now_ms() -> float:
        return time.monotonic_ns() / 1e6

    def _check_node(self, node: str) -> None:
        if subjects.token(node) != subjects.token(self.node):
            raise ValueError(f"event for node {node!r} on node {self.node!r}'s subject")

    async def _on_stretch(self, event: KernelCycleStretch, _msg) -> None:
        self._check_node(event.node)
        grants = self.policy.on_stretch(event.gpu, self._now_ms(), event.instance_id, event.ratio)
        await self._publish(event.gpu, grants, event.detected_ns or event.ts_ns)
        if self._debug():  # after the grants: the reaction does not wait for the log
            self.bus.log.debug("stretch", gpu=event.gpu, instance=event.instance_id, ratio=round(event.ratio, 2),
                               grants=[(g.instance_id, round(g.quota, 3), g.reason) for g in grants])

    async def _on_telemetry(self, event: GpuTelemetry, _msg) -> None:
        self._check_node(event.node)
        grants = self.policy.on_telemetry(event.gpu, self._now_ms(), event.instances)
        await self._publish(event.gpu, grants, event.ts_ns)
        if self._debug():  # what each window said and what it was answered: the policy's inputs and outputs
            self.bus.log.debug("window", gpu=event.gpu, rows=[
                (t.instance_id, round(t.quota, 3), round(t.busy_share, 3), t.wait_us, t.queue_depth,
                 round(t.latency_ms_recent, 1)) for t in event.instances],
                grants=[(g.instance_id, round(g.quota, 3), g.reason) for g in grants])

    def _debug(self) -> bool:
        """Whether debug lines are logged (DILU_LOG_LEVEL=debug): their rows are built only then,
        off the path of every window and stretch at other levels."""
        assert self.bus is not None
        return self.bus.log.is_enabled_for(logging.DEBUG)

    async def _on_retired(self, event: InstanceRetired | InstanceParked, _msg) -> None:
        """Retired or parked: either way the instance holds no share now; its neighbours get it."""
        self._check_node(event.node)
        grants = self.policy.on_retired(event.gpu, self._now_ms(), event.instance_id)
        await self._publish(event.gpu, grants, event.ts_ns)

    async def _publish(self, gpu: int, grants: list[Grant], cause_ns: int) -> None:
        assert self.bus is not None
        subject = subjects.grant_issued(self.node, gpu)
        for g in grants:
            self.epoch += 1
            await self.bus.publish(subject, TokenGrant(node=self.node, gpu=gpu, instance_id=g.instance_id,
                                                       quota=g.quota, epoch=self.epoch, reason=g.reason,
                                                       cause_ns=cause_ns))
            GRANTS.labels(self.node, _reason_kind(g.reason)).inc()
            self.grants_sent += 1
