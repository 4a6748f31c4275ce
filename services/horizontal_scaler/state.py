"""The horizontal scaler's per-function state in KV ``dilu-function-state`` (FunctionState JSON),
which ``dilu status`` and the gateway read: instance counts, the last target, whether the
scheduler takes the function's instances (and why not), and the last scale decisions.

Written only when something a reader sees changed (not every tick), one key per function.
"""
from __future__ import annotations

import time
from collections import deque

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import KeyNotFoundError, NotFoundError

from dilu.contracts import subjects
from dilu.contracts.events import STATE_DECISIONS, FunctionState, ScaleDecision

from ..common.jsresources import ensure_kv

STATE_KV_CONFIG = KeyValueConfig(bucket=subjects.FUNCTION_STATE_BUCKET, history=1,
                                 description="Dilu: the horizontal scaler's view of each function")


class FunctionStateStore:
    """Keeps each function's :class:`FunctionState` and writes it when it changes.

    Call :meth:`open` once; then :meth:`decided` for each decision carried out,
    :meth:`placeable` after each placement attempt, :meth:`observe` once per tick, :meth:`forget`
    when the function is undeployed. KV errors are left to the caller's logging.
    """

    def __init__(self) -> None:
        self.kv = None
        self._decisions: dict[str, deque[ScaleDecision]] = {}
        self._placeable: dict[str, tuple[bool, str]] = {}
        self._written: dict[str, bytes] = {}

    async def open(self, js: JetStreamContext, *, replicas: int | None = None, log=None) -> None:
        """Bind to (or create, with ``replicas``; None: one) the ``dilu-function-state`` bucket; an
        existing one is used as it is, each differing setting warned about on ``log``."""
        self.kv, _found = await ensure_kv(js, STATE_KV_CONFIG, replicas=replicas, log=log)

    def decided(self, decision: ScaleDecision) -> None:
        q = self._decisions.setdefault(decision.function, deque(maxlen=STATE_DECISIONS))
        q.append(decision)

    def placeable(self, fn: str, ok: bool, reason: str = "") -> None:
        self._placeable[fn] = (ok, "" if ok else reason)

    async def observe(self, fn: str, *, instances: dict[str, str], desired: int, backlog: int | None) -> None:
        """Write ``fn``'s state if it differs from the last one written. ``instances``: id ->
        state (starting, ready, draining); ``backlog``: None when unknown."""
        if self.kv is None:
            return
        ok, reason = self._placeable.get(fn, (True, ""))
        state = FunctionState(
            function=fn, instances=sum(1 for s in instances.values() if s != "draining"),
            ready=sum(1 for s in instances.values() if s == "ready"), desired=desired,
            backlog=-1 if backlog is None else int(backlog), placeable=ok, reason=reason,
            decisions=list(self._decisions.get(fn, ())))
        seen = msgspec.json.encode(state)
        if self._written.get(fn) == seen:
            return
        self._written[fn] = seen
        await self.kv.put(subjects.token(fn), msgspec.json.encode(msgspec.structs.replace(state, updated_ns=time.time_ns())))

    async def forget(self, fn: str) -> None:
        for known in (self._decisions, self._placeable, self._written):
            known.pop(fn, None)
        if self.kv is None:
            return
        try:
            await self.kv.delete(subjects.token(fn))
        except (KeyNotFoundError, NotFoundError):
            pass
