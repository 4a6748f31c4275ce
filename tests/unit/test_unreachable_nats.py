"""An unreachable NATS is a clear, fast error for the demo and never makes a service deaf to signals."""
import asyncio
import socket

import pytest

from dilu.cli.cluster import check_reachable
from dilu.client.errors import Unreachable
from dilu.services.common.runner import serve


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_check_reachable_names_the_url_and_the_reason():
    url = f"nats://127.0.0.1:{closed_port()}"
    with pytest.raises(Unreachable, match=f"cannot reach NATS at {url}: connection refused"):
        check_reachable(url)
    with pytest.raises(Unreachable, match=r"nats://nowhere.invalid:4222: no such host \("):  # not "[Errno -2] ..."
        check_reachable("nats://nowhere.invalid:4222")
    with pytest.raises(RuntimeError, match="bad NATS URL"):
        check_reachable("nats://host:notaport")
    with pytest.raises(RuntimeError, match="no host"):
        check_reachable("nats://:4222")


class Idle:
    name = "idle"
    started = False

    async def start(self, bus):
        self.started = True

    async def stop(self):
        pass

    def ready(self):
        return self.started


async def test_a_service_waiting_for_nats_stops_when_asked():
    shutdown = asyncio.Event()
    svc = Idle()
    task = asyncio.create_task(serve(svc, f"nats://127.0.0.1:{closed_port()}", shutdown=shutdown,
                                     install_signals=False))
    await asyncio.sleep(1.0)  # nats-py keeps retrying the refused connection
    assert not task.done()
    shutdown.set()
    await asyncio.wait_for(task, 5)
    assert not svc.started
