"""The Dilu client library: deploy functions and call them over NATS.

- :class:`Client` (blocking) and :class:`AsyncClient` (asyncio): ``invoke``, ``stream``,
  ``functions``, ``function``;
- :mod:`dilu.client.admin`: ``deploy``, ``undeploy``, ``status`` (used by the CLI and the gateway);
- :mod:`dilu.client.spec`: ``load_spec`` for ``function.toml`` files;
- :mod:`dilu.client.functions`: the contract a function's class implements;
- :mod:`dilu.client.errors`: every error is a :class:`DiluError`.

Submodules load on first use, so ``from dilu.client.functions import FunctionContext`` (inside
an instance) does not import NATS.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AsyncClient": "aio",
    "Reply": "aio",
    "Stream": "aio",
    "Client": "sync",
    "SyncStream": "sync",
    "LoadedSpec": "spec",
    "SpecError": "spec",
    "load_spec": "spec",
    "parse_spec": "spec",
    "DiluError": "errors",
    "NotDeployed": "errors",
    "FunctionError": "errors",
    "InvocationTimeout": "errors",
    "NoCapacity": "errors",
    "DeployError": "errors",
    "NotAdmitted": "errors",
    "BadRequest": "errors",
    "Unreachable": "errors",
    "NotPermitted": "errors",
    "deploy": "admin",
    "undeploy": "admin",
    "status": "admin",
    "DeployResult": "admin",
    "UndeployResult": "admin",
    "Status": "admin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dilu.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
