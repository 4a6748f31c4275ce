"""``settle``: when it returns, the server has read every command sent before it (a SUB above
all). Checked on the wire, against a minimal NATS server that records, for each PING it answers,
whether the SUB had arrived before that PING: nats-py's own ``flush()`` writes its PING straight
to the socket, ahead of a SUB still queued for its flusher task, so after a bare flush the PING
that released the caller was read before the SUB, and a message published right away by
another connection found no subscriber (seen as "no responders" about once in a hundred on a
busy host)."""
from __future__ import annotations

import asyncio
import json

import nats

from dilu.services.common.bus import settle


class WireLog:
    """A NATS server that speaks just enough (INFO; CONNECT, PING, SUB read) and keeps,
    for each PONG it sent, whether a SUB had been read before the PING it answers."""

    def __init__(self) -> None:
        self.sub_before_ping: list[bool] = []
        self._subs = 0
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "WireLog":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "wirelog", "version": "2.10.0", "proto": 1, "headers": True, "max_payload": 1 << 20}
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        while line := await reader.readline():
            verb = line.split(b" ", 1)[0].strip().upper()
            if verb == b"PING":
                self.sub_before_ping.append(self._subs > 0)
                writer.write(b"PONG\r\n")
            elif verb == b"SUB":
                self._subs += 1
        writer.close()


async def test_settle_returns_only_once_the_server_has_read_the_sub():
    async with WireLog() as server:
        nc = await nats.connect(f"nats://127.0.0.1:{server.port}", allow_reconnect=False)
        try:
            pongs = len(server.sub_before_ping)  # the connect handshake's
            await nc.subscribe("dilu.v1.test")
            await settle(nc)  # with nc.flush() here (nats-py 2.16) the list ends in False
            answered = server.sub_before_ping[pongs:]
            # the last PONG before the caller went on answered a PING read after the SUB
            assert answered and answered[-1], answered
        finally:
            await nc.close()
