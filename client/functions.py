"""What a function's code implements: the contract between a user's class and the instance
runtime that hosts it (``dilu.services.node_agent.runtime``).

A function is a class named by the spec's ``entry`` (``module:Name``). The instance builds it
once, ``Name(ctx)`` with a :class:`FunctionContext`; that constructor is the load step (weights
onto the device, warm-up) and its duration is part of the instance's cold start. Then, by kind:

- ``inference``: ``predict(self, batch: list[bytes]) -> list[bytes]``: one output per input, in
  order. Raising fails the whole batch: each of its requests is answered with the error.
- ``llm``: ``generate(self, batch: list[bytes]) -> Iterator[list[bytes | None]]``: each item is
  one decoding step, one chunk per request of the batch (``None``: that request produced nothing
  this step, e.g. it has finished). Each chunk reaches its caller as it is produced; the final
  reply carries the request's whole output (its chunks joined). Raising fails every request of
  the batch (each gets an error reply after the chunks it already received).
- ``training``: ``train_step(self) -> None``: one iteration; the runtime calls it in a loop
  until the instance is retired and reports iterations/s. No requests reach a training job.

Methods run in a worker thread, so they may block (GPU synchronisation, torch). Payloads and
outputs are opaque bytes. A class may also define ``close(self)``, called when the instance
stops.

Parking (``inference`` and ``llm``): a class that defines both ``park(self)`` and
``resume(self)`` lets the platform park an idle instance live instead of retiring it. ``park``
moves the weights to host memory and frees their device memory (torch: ``self.model.to("cpu")``
then ``torch.cuda.empty_cache()``, or the caching allocator keeps the memory); ``resume`` moves
them back (``self.model.to(device)``) and returns once they are there. No request runs between
the two. The next request then waits for a weight copy (milliseconds) rather than a cold start.
A class keeping its torch module as ``self.net`` on ``self.device`` may inherit both from
``dilu.services.node_agent.handlers.torch_models.ParksNet`` (the examples do).
If ``park`` raises, the instance keeps serving as it was; if ``resume`` raises, the instance
fails (a new one is started: a cold start). Without both methods an instance cannot be parked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEVICES = ("cuda", "cpu", "emulated")


@dataclass(frozen=True)
class FunctionContext:
    """What an instance tells the function's code.

    ``device``: ``cuda`` (a real GPU: the process sees exactly its one GPU), ``cpu`` (a CPU
    node) or ``emulated`` (the fake driver; the platform's emulated handler stands in for user
    code there); ``width``: the SM fraction 0..1 the instance may occupy (1.0 without MPS);
    ``batch_size``: the largest batch the instance is given; ``model``: the spec's emulation
    model (may be empty); ``kind``: ``inference``, ``llm`` or ``training``; ``config``: the
    spec's ``[config]`` table, strings.
    """

    instance_id: str
    function: str
    model: str = ""
    batch_size: int = 1
    width: float = 1.0
    device: str = "emulated"
    kind: str = "inference"
    config: dict[str, str] = field(default_factory=dict)
