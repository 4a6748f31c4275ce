"""A real torch handler: a small CNN with random weights, for nodes started with ``--gpus cpu``.

Input: each request's payload is ignored beyond its length (a seed for the input image), so the
load generator can send anything; output: the predicted class index as ASCII. Shows that a
user's torch function runs through the same NATS path as the emulated models.
"""
from __future__ import annotations

import torch
from torch import nn

from . import HandlerContext


def load(ctx: HandlerContext) -> nn.Module:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, 10),
    ).eval()
    with torch.inference_mode():
        net(torch.zeros(1, 3, 32, 32))  # warm-up
    return net


def predict(net: nn.Module, batch: list[bytes]) -> list[bytes]:
    gen = torch.Generator().manual_seed(sum(len(b) for b in batch))
    x = torch.randn(len(batch), 3, 32, 32, generator=gen)
    with torch.inference_mode():
        classes = net(x).argmax(dim=1).tolist()
    return [str(c).encode() for c in classes]


def park(net: nn.Module) -> None:
    """Nothing to move: the net lives on the CPU. Defined so that an idle instance can still be
    parked (it gives its share back and pulls nothing)."""


def resume(net: nn.Module) -> None:
    """Nothing to move back (see :func:`park`)."""
