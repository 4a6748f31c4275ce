"""The open-loop load generator.

Each invocation is fired at its scheduled time whether or not earlier ones have been answered
(open loop: the offered load never adapts to the system under test). If the generator itself
falls behind (a stalled event loop, a slow hook), it sends late, counts the send as late when it
is more than ``late_threshold_ms`` behind, and still measures latency from the *scheduled* time
(DESIGN.md section 8), so a stall shows up as latency instead of hiding as coordinated omission.

Transport-free: the caller passes ``invoke(inv) -> Outcome`` (e.g. a NATS request through the
JetStream work queue). Time is read only through a :class:`~dilu.loadgen.clock.Clock`, so the
generator runs unchanged in virtual time.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Literal

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .arrivals import Invocation
from .clock import Clock, MonotonicClock

Status = Literal["ok", "error", "timeout", "dropped"]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]  # checked where a line is decoded (the request log)
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "dropped")
DEFAULT_LATE_THRESHOLD_MS = 10.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """What the platform says about how it served one answered request (its reply headers):
    the ``instance`` that answered, and Unix epoch ns at which JetStream stored the request
    (``enqueued_ns``), the instance began the batch holding it (``started_ns``) and published
    the reply (``replied_ns``); ``batch``: the requests in that batch. 0 (or "") where the reply
    did not say. With the caller's times they split a latency into the way in (scheduled ->
    stored), the queue (stored -> started), the service (started -> replied) and the way back
    (replied -> answered): what ``dilu calibrate`` measures."""

    instance: str = ""
    enqueued_ns: NonNegative = 0
    started_ns: NonNegative = 0
    replied_ns: NonNegative = 0
    batch: NonNegative = 0


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """What ``invoke`` reports for one request.

    ``status``: ``ok`` (answered), ``error`` (the function or platform failed it), ``timeout``
    (no answer in time), ``dropped`` (refused, e.g. by admission control); ``cold_start``: its
    service waited for an instance launch; ``done_ns``: when it was answered, in the generator
    clock's time base (``clock.now_ns()``), or 0 to let the generator stamp the moment ``invoke``
    returns (the usual choice); ``detail``: error text, free form.

    Streamed replies (``llm`` functions; see :func:`token_times_ms`): ``ttft_ms`` time to first
    token, ms from the *scheduled* send to the first chunk's arrival; ``tpot_ms`` time per output
    token, ms, ``(last chunk - first chunk) / (chunks - 1)``; ``output_tokens`` chunks received.
    None, None and 0 when the reply was not streamed (TPOT also None for a single chunk).
    ``timings``: the platform's own times of the request (None: not known, e.g. no reply).
    """

    status: Status = "ok"
    cold_start: bool = False
    done_ns: int = 0
    detail: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    output_tokens: int = 0
    timings: Timings | None = None


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """One offered request. Times are ns offsets from the start of the replay:
    ``scheduled_ns`` intended send, ``sent_ns`` actual send (when ``invoke`` was called),
    ``done_ns`` answer (or the moment it was given up). Latency is ``done_ns - scheduled_ns``;
    lateness ``sent_ns - scheduled_ns``.
    ``ttft_ms``, ``tpot_ms`` and ``output_tokens`` are the :class:`Outcome`'s (None, None, 0 when
    the reply was not streamed); ``timings`` too (Unix epoch ns, unlike the offsets above)."""

    id: str
    function: str
    scheduled_ns: int
    sent_ns: int
    done_ns: int
    status: Status
    cold_start: bool = False
    detail: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    output_tokens: int = 0
    timings: Timings | None = None

    @property
    def latency_ns(self) -> int:
        return self.done_ns - self.scheduled_ns

    @property
    def late_ns(self) -> int:
        return self.sent_ns - self.scheduled_ns


class RunResult(msgspec.Struct, kw_only=True):
    """The generator's account of a run.

    ``records``: one per offered (sent) request, sorted by (scheduled_ns, id); ``wall_s``: wall
    seconds from the start of the replay until its planned duration was over and every offered
    request was answered or given up;
    ``started_unix_ns``: Unix time of the replay start; ``late_sends``: sends more than
    ``late_threshold_ms`` behind schedule; ``max_late_ms``: the worst lateness; ``not_sent``:
    planned invocations never sent because the run was stopped early; ``stopped``: ``stop()``
    was called.
    """

    records: list[Record]
    wall_s: float
    started_unix_ns: int
    late_sends: int
    late_threshold_ms: float
    max_late_ms: float
    not_sent: int = 0
    stopped: bool = False


def token_times_ms(
    scheduled_ns: int, chunks: int, first_chunk_ns: int, last_chunk_ns: int
) -> tuple[float | None, float | None]:
    """``(ttft_ms, tpot_ms)`` of a streamed reply, for an :class:`Outcome`.

    All times in one time base, ns (e.g. Unix ns: ``gen.started_unix_ns + inv.scheduled_ns`` and
    the client's chunk arrival stamps). TTFT = ``first_chunk_ns - scheduled_ns``; TPOT =
    ``(last_chunk_ns - first_chunk_ns) / (chunks - 1)``. No chunk: ``(None, None)``; one chunk:
    ``(ttft, None)`` (no gap between tokens was seen).
    """
    if chunks <= 0:
        return None, None
    ttft = (first_chunk_ns - scheduled_ns) / 1e6
    tpot = (last_chunk_ns - first_chunk_ns) / 1e6 / (chunks - 1) if chunks > 1 else None
    return ttft, tpot


Invoke = Callable[[Invocation], Awaitable[Outcome]]
Hook = Callable[[Invocation], Awaitable[None]]


class OpenLoopGenerator:
    """Fires invocations at their scheduled times through ``invoke``.

    ``clock``: time source (default :class:`MonotonicClock`); ``late_threshold_ms``: lateness
    above which a send counts as late; ``request_timeout_s``: optional bound per request from
    its send, after which it counts as ``timeout`` (None: ``invoke`` bounds itself);
    ``drain_timeout_s``: after the last send (or ``stop()``), how long to wait for answers
    before the rest count as ``timeout``; ``progress``: show a rich progress bar on ``console``;
    ``before_send``: awaited just before each send, after its scheduled time has come (a hook
    for instrumentation and for injecting stalls in tests).

    While running, ``started_unix_ns`` is set, so ``invoke`` can stamp the absolute scheduled
    time of a request as ``gen.started_unix_ns + inv.scheduled_ns``.
    """

    def __init__(
        self,
        invoke: Invoke,
        *,
        clock: Clock | None = None,
        late_threshold_ms: float = DEFAULT_LATE_THRESHOLD_MS,
        request_timeout_s: float | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        progress: bool = False,
        console: Console | None = None,
        before_send: Hook | None = None,
    ) -> None:
        self._invoke = invoke
        self._clock: Clock = clock or MonotonicClock()
        self._late_ns = round(late_threshold_ms * 1e6)
        self._late_threshold_ms = late_threshold_ms
        self._request_timeout_s = request_timeout_s
        self._drain_timeout_s = drain_timeout_s
        self._progress_on = progress
        self._console = console
        self._before_send = before_send
        self._records: list[Record] = []
        self._inflight: set[asyncio.Task] = set()
        self._sender: asyncio.Task | None = None
        self._stopped = False
        self._start_ns = 0
        self._sent = 0
        self._late = 0
        self._max_late_ns = 0
        self.started_unix_ns: int | None = None

    def stop(self) -> None:
        """Stop sending (e.g. on Ctrl-C): invocations not yet sent are not offered; those in
        flight are drained as usual. Safe to call from a signal handler on the loop thread."""
        self._stopped = True
        if self._sender is not None:
            self._sender.cancel()

    async def run(self, invocations: Sequence[Invocation], *, duration_s: float | None = None) -> RunResult:
        """Replay ``invocations`` (any order; sent in scheduled order) and return the records.

        ``duration_s``: the replay's planned length; after the last send the generator stays
        until then (an idle tail of the trace is real idle time), then drains. Cancelling
        ``run`` itself cancels every request in flight and re-raises.
        """
        plan = sorted(invocations, key=lambda i: (i.scheduled_ns, i.id))
        self._start_ns = self._clock.now_ns()
        self.started_unix_ns = time.time_ns()
        until_ns = None if duration_s is None else self._start_ns + round(duration_s * 1e9)
        with self._progress_bar(len(plan)) as bar:
            self._sender = asyncio.create_task(self._send_all(plan, bar, until_ns))
            try:
                await asyncio.wait({self._sender})
                await self._drain()
            except asyncio.CancelledError:
                for task in (self._sender, *self._inflight):
                    task.cancel()
                raise
        end_ns = self._clock.now_ns()
        records = sorted(self._records, key=lambda r: (r.scheduled_ns, r.id))
        return RunResult(
            records=records, wall_s=(end_ns - self._start_ns) / 1e9, started_unix_ns=self.started_unix_ns,
            late_sends=self._late, late_threshold_ms=self._late_threshold_ms,
            max_late_ms=self._max_late_ns / 1e6, not_sent=len(plan) - self._sent, stopped=self._stopped,
        )

    # ------------------------------------------------------------------------------- internals

    async def _send_all(self, plan: list[Invocation], bar: _Bar, until_ns: int | None) -> None:
        for inv in plan:
            if self._stopped:
                return
            await self._clock.sleep_until(self._start_ns + inv.scheduled_ns)
            if self._before_send is not None:
                await self._before_send(inv)
            self._sent += 1
            task = asyncio.create_task(self._one(inv, bar))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        if until_ns is not None and not self._stopped:
            await self._clock.sleep_until(until_ns)

    async def _one(self, inv: Invocation, bar: _Bar) -> None:
        # The send time is stamped here, when the task runs and ``invoke`` starts sending, not
        # when the task was queued: a burst of due requests queued in one pass leaves one by one.
        sent = self._clock.now_ns() - self._start_ns
        late = sent - inv.scheduled_ns
        self._max_late_ns = max(self._max_late_ns, late)
        self._late += late > self._late_ns
        bar.sent(self._late)
        try:
            call = self._invoke(inv)
            if self._request_timeout_s is not None:
                call = asyncio.wait_for(call, self._request_timeout_s)
            outcome = await call
        except asyncio.TimeoutError:
            outcome = Outcome(status="timeout", detail=f"no answer within {self._request_timeout_s} s")
        except asyncio.CancelledError:
            # Given up at drain time (or the run was cancelled): still offered, so still counted.
            self._record(inv, sent, Outcome(status="timeout", detail="not answered before the run ended"))
            bar.answered()
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of invoke is a failed request, counted
            outcome = Outcome(status="error", detail=f"{type(exc).__name__}: {exc}")
        if not isinstance(outcome, Outcome):
            outcome = Outcome(status="error", detail=f"invoke returned {type(outcome).__name__}, not an Outcome")
        self._record(inv, sent, outcome)
        bar.answered()

    def _record(self, inv: Invocation, sent: int, outcome: Outcome) -> None:
        done_abs = outcome.done_ns or self._clock.now_ns()
        status = outcome.status if outcome.status in STATUSES else "error"
        self._records.append(Record(
            id=inv.id, function=inv.function, scheduled_ns=inv.scheduled_ns, sent_ns=sent,
            done_ns=done_abs - self._start_ns, status=status, cold_start=outcome.cold_start,
            detail=outcome.detail, ttft_ms=outcome.ttft_ms, tpot_ms=outcome.tpot_ms,
            output_tokens=outcome.output_tokens, timings=outcome.timings,
        ))

    async def _drain(self) -> None:
        if not self._inflight:
            return
        _, pending = await asyncio.wait(set(self._inflight), timeout=self._drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    def _progress_bar(self, total: int) -> _Bar:
        return _Bar(total, self._console) if self._progress_on else _NoBar()


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def sent(self, late: int) -> None:
        pass

    def answered(self) -> None:
        pass


class _Bar(_NoBar):
    """Two rich progress lines: requests sent (with the late count) and requests answered."""

    def __init__(self, total: int, console: Console | None) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=console, transient=False,
        )
        self._sent = self._progress.add_task("replay: sent", total=total, note="")
        self._done = self._progress.add_task("answered    ", total=total, note="")

    def __enter__(self) -> _Bar:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def sent(self, late: int) -> None:
        self._progress.update(self._sent, advance=1, note=f"late {late}")

    def answered(self) -> None:
        self._progress.advance(self._done)
