"""Ports for tests that restart a server on the port it had."""
import random
import socket
from pathlib import Path


def ports_outside_ephemeral_range(n: int) -> list[int]:
    """``n`` free loopback ports below Linux's ephemeral range (``ip_local_port_range``, 32768 and
    up by default). A port a test reuses after a stop must not come from that range: between the
    stop and the restart, any outgoing connection (a service's NATS client) may be given it as
    its local port, or another test's server (``free_port`` draws from that range) may bind it
    and take the restarted server's clients."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randrange(10_000, low)))
                socks.append(s)
            except OSError:  # taken: try another
                s.close()
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
