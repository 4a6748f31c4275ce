"""A training job (kind ``training``): a small CNN learning a synthetic image task with SGD.

The data are drawn from a seeded generator, so no data set is downloaded and every run is the
same: each image is a smooth random field (a 3x7x7 normal draw upsampled bilinearly to 32x32)
whose label is the argmax of a fixed random linear "teacher" over the 3x7x7 draw (10 classes),
so there is something to learn and the loss falls. ``train_step`` runs one iteration on a fresh
minibatch: forward, cross-entropy, backward, SGD with momentum. No requests reach the job; the
platform calls ``train_step`` in a loop and reports iterations/s.

``ctx.config``: ``batch`` (images per step, default 128), ``lr`` (SGD learning rate, default
0.05), ``size`` (``tiny``: 8-channel network, 16x16 images, batch 16 by default, for tests; or
``DILU_TORCH_TINY=1``). ``ctx.device``: ``cuda`` trains with fp16 autocast and a gradient
scaler (mixed precision: fp32 weights), ``cpu`` in fp32.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from dilu.client.functions import FunctionContext
from dilu.services.node_agent.handlers import torch_models as tm

CLASSES = 10
FIELD = 7      # side of the random field an image is upsampled from
SEED = 0


def _positive(ctx: FunctionContext, key: str, default: str, cast: type) -> int | float:
    """``ctx.config[key]`` (or ``default``) as a positive ``cast``; ValueError names the key."""
    raw = ctx.config.get(key, default)
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"config {key} must be a positive {cast.__name__}, got {raw!r}")
    return value


def small_cnn(width: int) -> nn.Module:
    """Images (B, 3, S, S) -> logits (B, 10): three conv-BN-ReLU blocks of ``width``, 2x and 4x
    ``width`` channels, the last two strided, global average pool, linear."""
    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*block(3, width, 1), *block(width, 2 * width, 2), *block(2 * width, 4 * width, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, CLASSES))


class Trainer:
    """The function class (spec ``entry = "trainer:Trainer"``, kind training).

    ``steps``: iterations run; ``last_loss``: the cross-entropy of the last step (nan before
    the first). Raises ValueError for a bad ``batch``, ``lr`` or ``size`` or an unknown device,
    RuntimeError for ``cuda`` without a GPU.
    """

    def __init__(self, ctx: FunctionContext) -> None:
        size = ctx.config.get("size", "")
        if size not in ("", "tiny", "full"):
            raise ValueError(f"config size must be 'tiny' or 'full', not {size!r}")
        tiny = size == "tiny" or (size == "" and tm.sizes_from_env() == tm.TINY)
        self.device = tm.resolve_device(ctx.device)
        self.image_size = 16 if tiny else 32
        self.batch = int(_positive(ctx, "batch", "16" if tiny else "128", int))
        lr = float(_positive(ctx, "lr", "0.05", float))
        with torch.random.fork_rng(devices=[]):  # seeded weights; the caller's RNG state is kept
            torch.manual_seed(SEED)
            self.net = small_cnn(8 if tiny else 32).to(self.device).train()
            self.teacher = torch.randn(3 * FIELD * FIELD, CLASSES)
        self.data = torch.Generator().manual_seed(SEED + 1)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        cuda = self.device.type == "cuda"
        self.autocast = torch.autocast("cuda", dtype=torch.float16, enabled=cuda)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cuda)
        self.steps = 0
        self.last_loss = math.nan

    def minibatch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next synthetic minibatch: images (batch, 3, S, S) float32 and labels (batch,) int64,
        on the job's device."""
        field = torch.randn(self.batch, 3, FIELD, FIELD, generator=self.data)
        labels = (field.flatten(1) @ self.teacher).argmax(dim=-1)
        images = F.interpolate(field, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return images.to(self.device), labels.to(self.device)

    def train_step(self) -> None:
        """One SGD iteration on a fresh minibatch; sets ``last_loss`` and counts ``steps``."""
        images, labels = self.minibatch()
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            loss = F.cross_entropy(self.net(images), labels)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.steps += 1
        self.last_loss = loss.item()  # also waits for the step, so iterations/s counts finished work
