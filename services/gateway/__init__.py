"""The HTTP gateway: invoke Dilu functions over plain HTTP (and server-sent events for ``llm``
streams) for callers that do not speak NATS. A Starlette app under uvicorn, in the same asyncio
loop as its NATS connection; the NATS side is :mod:`dilu.client`."""
