"""Function handlers: a user's module with ``load(ctx)`` and ``predict(model, batch)``.

The contract (what a user writes to deploy a function):

- ``load(ctx: HandlerContext) -> model``: load weights, warm up. Called once per instance; its
  duration is part of the instance's cold start.
- ``predict(model, batch: list[bytes]) -> list[bytes]``: one output per input, same order.
  Raising fails the whole batch (each request is answered with an error, none is lost).

``predict`` runs in a worker thread, so it may block (GPU synchronisation, torch).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class HandlerContext:
    """What an instance tells its handler. ``width`` is the SM fraction 0..1 of its GPU
    (1.0 without MPS); ``device`` is ``emulated`` (fake driver), ``cpu`` or ``cuda``."""

    instance_id: str
    function: str
    model: str
    batch_size: int
    width: float = 1.0
    device: str = "emulated"


def load_module(path: str) -> ModuleType:
    """Import a handler module by dotted path; ValueError when it lacks ``load``/``predict``."""
    module = importlib.import_module(path)
    missing = [name for name in ("load", "predict") if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(f"handler {path!r} has no {', '.join(missing)} function")
    return module
