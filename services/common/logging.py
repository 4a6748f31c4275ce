"""structlog set-up: one JSON object per line on stderr, with the service's name bound."""
from __future__ import annotations

import logging
import sys

import structlog


def configure(service: str, level: str = "info", stream=None) -> structlog.stdlib.BoundLogger:
    """Configure structlog for JSON lines on ``stream`` (default stderr) and return a logger
    bound to ``service``."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.WriteLoggerFactory(file=stream or sys.stderr),
        # loggers bound before configure() (e.g. in a service's constructor) must follow it
        cache_logger_on_first_use=False,
    )
    return structlog.get_logger().bind(service=service)


configure("dilu")  # JSON from the first line on, even for loggers made before a service configures


def get(service: str = "", **values) -> structlog.stdlib.BoundLogger:
    """A logger for ``service`` with ``values`` bound that follows the configuration in force
    when it logs (a logger made at import or in a constructor still honours a later
    :func:`configure`'s level and stream). Bind through here, not with ``.bind()`` on it: that
    makes a logger of the configuration in force now, its level included."""
    if service:
        values["service"] = service
    return structlog.get_logger(**values)
