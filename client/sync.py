"""The blocking client, for plain scripts:

    from dilu.client import Client

    with Client("nats://127.0.0.1:4222") as c:
        print(c.invoke("image-classifier", b"...").payload)
        for chunk in c.stream("chat", b"hello"):
            print(chunk.decode(), end="", flush=True)

Each :class:`Client` runs its own event loop in a background (daemon) thread and hands every
call to the :class:`~dilu.client.aio.AsyncClient` running there, so it works the same inside
and outside other event loops. Methods, arguments and errors are those of the async client.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from dilu.contracts.events import FunctionSpec

from .aio import DEFAULT_TIMEOUT_S, AsyncClient, Reply, Stream

T = TypeVar("T")


class SyncStream:
    """The chunks of one streamed invocation (an iterator of bytes); :attr:`reply` once it
    ended. Errors are raised from the iteration (see :class:`~dilu.client.aio.Stream`);
    :meth:`close` (or ``with``) gives up early."""

    def __init__(self, client: "Client", stream: Stream) -> None:
        self._client, self._stream = client, stream

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return self._client._run(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    @property
    def reply(self) -> Reply | None:
        return self._stream.reply

    def close(self) -> None:
        self._client._run(self._stream.aclose())

    def __enter__(self) -> "SyncStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Client:
    """Blocking twin of :class:`~dilu.client.aio.AsyncClient`; connects at construction.

    ``nats_url`` and the keyword options are those of :meth:`AsyncClient.connect`. Raises
    :class:`~dilu.client.errors.Unreachable` when NATS cannot be reached.
    """

    def __init__(self, nats_url: str | None = None, **connect_options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dilu-client", daemon=True)
        self._thread.start()
        try:
            self._aio: AsyncClient = self._run(AsyncClient.connect(nats_url, **connect_options))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's loop and wait for it (its exception propagates)."""
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def invoke(self, function: str, payload: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Reply:
        """See :meth:`AsyncClient.invoke`."""
        return self._run(self._aio.invoke(function, payload, timeout_s=timeout_s))

    def stream(self, function: str, payload: bytes, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> SyncStream:
        """``for chunk in c.stream(...)``; see :meth:`AsyncClient.stream`."""

        async def make() -> Stream:  # the stream's queue belongs to the client's loop
            return self._aio.stream(function, payload, timeout_s=timeout_s)

        return SyncStream(self, self._run(make()))

    def functions(self) -> dict[str, FunctionSpec]:
        """See :meth:`AsyncClient.functions`."""
        return self._run(self._aio.functions())

    def function(self, name: str) -> FunctionSpec:
        """See :meth:`AsyncClient.function`."""
        return self._run(self._aio.function(name))

    @property
    def aio(self) -> AsyncClient:
        """The async client this one drives (use it only from coroutines run by this client)."""
        return self._aio

    def close(self) -> None:
        """Close the connection and stop the background loop; idempotent."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._aio.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
