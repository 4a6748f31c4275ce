"""Function handlers: the older module form of a function, ``load(ctx)`` and ``predict(model, batch)``.

The contract of a handler module (the class form, ``entry = "module:Name"``, is described in
:mod:`dilu.client.functions`; :mod:`dilu.services.node_agent.runtime` hosts both):

- ``load(ctx: FunctionContext) -> model``: load weights, warm up. Called once per instance; its
  duration is part of the instance's cold start.
- ``predict(model, batch: list[bytes]) -> list[bytes]``: one output per input, same order.
  Raising fails the whole batch (each request is answered with an error, none is lost).
- optional, by the function's kind: ``generate(model, batch) -> Iterator[list[bytes | None]]``
  (``llm``: one chunk per request per step), ``train_step(model) -> None`` (``training``: one
  iteration), and ``close(model)`` (called when the instance stops).
- optional, both or neither: ``park(model)`` (move the weights to host memory and free their
  device memory) and ``resume(model)`` (move them back). With them an idle ``inference`` or
  ``llm`` instance can be parked and come back in a weight copy instead of a cold start.

Every function runs in a worker thread, so it may block (GPU synchronisation, torch).
"""
from __future__ import annotations

import importlib
from types import ModuleType

from dilu.client.functions import FunctionContext

# The older name of the context (handlers written before the class form import it).
HandlerContext = FunctionContext

# The function each kind needs from a handler module (besides ``load``) or a class.
KIND_METHODS = {"inference": "predict", "llm": "generate", "training": "train_step"}

__all__ = ["FunctionContext", "HandlerContext", "KIND_METHODS", "load_module"]


def load_module(path: str, kind: str = "inference") -> ModuleType:
    """Import a handler module by dotted path.

    Raises ValueError when it lacks ``load`` or the function its ``kind`` needs (``predict`` for
    inference, ``generate`` for llm, ``train_step`` for training); ImportError (and whatever the
    module raises at import) when it cannot be imported.
    """
    module = importlib.import_module(path)
    needed = ("load", KIND_METHODS.get(kind, "predict"))
    missing = [name for name in needed if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(f"handler {path!r} has no {', '.join(missing)} function (kind {kind})")
    return module
