"""Prometheus metrics and the health endpoints every service serves.

``/metrics`` (Prometheus text), ``/healthz`` (200 while the process runs) and ``/readyz`` (200 only
while the service says it is ready: NATS connected and subscriptions live). Each answer carries
the serving process's id in ``Dilu-Pid``, so a supervisor that chose the port can tell its own
process from another that took the port first (:data:`PID_HEADER`). Served by the
prometheus-client WSGI app under the standard library's WSGI server in a daemon thread, so a
busy event loop never delays a scrape.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, make_wsgi_app

PID_HEADER = "Dilu-Pid"  # the id of the process that answered, on every health and metrics answer

MALFORMED = Counter(
    "dilu_malformed_messages", "Messages rejected because they failed to decode", ["service", "subject"]
)
HANDLER_ERRORS = Counter(
    "dilu_handler_errors", "Messages whose handler raised (message rejected, service kept running)",
    ["service", "subject"],
)
MESSAGES = Counter("dilu_messages", "Messages decoded and handled", ["service", "subject"])
SKIPPED = Counter(
    "dilu_skipped_items",
    "Items skipped while decoding a newer version's message: list elements (reason unknown-enum) or whole "
    "events (reason unknown-enum-event) holding an enum member this version does not know",
    ["service", "subject", "reason"],
)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass


class HealthServer:
    """Serves /metrics, /healthz, /readyz on ``host:port`` (port 0 picks a free one)."""

    def __init__(self, ready: Callable[[], bool], host: str = "127.0.0.1", port: int = 0) -> None:
        metrics_app = make_wsgi_app()
        pid = (PID_HEADER, str(os.getpid()))

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                start_response("200 OK", [("Content-Type", "text/plain"), pid])
                return [b"ok\n"]
            if path == "/readyz":
                ok = ready()
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain"), pid])
                return [b"ready\n" if ok else b"not ready\n"]
            return metrics_app(environ, lambda status, headers, *exc: start_response(status, [*headers, pid], *exc))

        self._server: WSGIServer = make_server(host, port, app, handler_class=_Quiet)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
