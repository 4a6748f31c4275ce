"""An image classifier function: ResNet-50 with random weights from a fixed seed.

Input: one image per request (PNG, JPEG, any format Pillow reads), resized to 224x224 and
normalised with the ImageNet mean and standard deviation. Payloads that are not an image (or all
payloads when Pillow is not installed) still get an answer: a deterministic image is derived from
the bytes (a 64-bit BLAKE2b hash seeds a smooth random 3x7x7 field, upsampled to 224x224), so
equal payloads get equal answers.

Output: JSON ``{"class": <int, 0..999>, "score": <float, softmax probability 0..1, 6 decimals>}``.

The network is torchvision's ``resnet50(weights=None)`` when torchvision is importable, else the
platform's plain-torch ResNet-50 of the same layout
(``dilu.services.node_agent.handlers.torch_models``). Either way the weights are drawn from a
fixed seed, so every instance holds the same weights, and the classifier's bias is centred on a
few seeded images so that the class depends on the input, as in a trained network.

``ctx.config["size"] = "tiny"`` (or the environment ``DILU_TORCH_TINY=1``) builds the platform's
tiny ResNet (one bottleneck a stage, 10 classes, 32x32 images): for tests on a small CPU.
``ctx.device``: ``cuda`` runs in fp16 on the instance's GPU, ``cpu`` in fp32.
"""
from __future__ import annotations

import io
import json

import torch
from torch import nn
from torch.nn import functional as F

from dilu.client.functions import FunctionContext
from dilu.services.node_agent.handlers import torch_models as tm

try:  # optional: without Pillow every payload takes the derived-image path
    from PIL import Image
except ImportError:
    Image = None

try:  # optional: torchvision has no CPU wheel for every torch build
    import torchvision
except ImportError:
    torchvision = None

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CALIBRATION_IMAGES = 8


def model_sizes(ctx: FunctionContext) -> tm.Sizes:
    """The model's dimensions from ``ctx.config["size"]`` (``tiny`` or ``full``; unset: full
    unless ``DILU_TORCH_TINY=1``). Raises ValueError for any other value."""
    return tm.sizes_from_config(ctx.config)


class _Split(nn.Module):
    """A classifier as ``features`` (images -> pooled features) and ``head`` (features -> logits)."""

    def __init__(self, features: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.features, self.head = features, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _torchvision_resnet50() -> nn.Module:
    """torchvision's ResNet-50 with seeded random weights, its fc bias centred (fp32, CPU, eval)."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state as it was
        torch.manual_seed(tm.WEIGHT_SEED)
        net = torchvision.models.resnet50(weights=None).eval()
    split = _Split(nn.Sequential(*list(net.children())[:-1], nn.Flatten()), net.fc).eval()
    # a random network's post-ReLU features share a large common part that would give every
    # input the same class: centre the bias on seeded images (as torch_models does)
    g = torch.Generator().manual_seed(tm.WEIGHT_SEED + 1)
    images = F.interpolate(torch.randn(CALIBRATION_IMAGES, 3, 7, 7, generator=g), size=(112, 112),
                           mode="bilinear", align_corners=False)
    with torch.inference_mode():
        mu = split.features(images).mean(dim=0)
        split.head.bias.copy_(-(split.head.weight @ mu))
    return split


class ImageClassifier(tm.ParksNet):  # park()/resume(): weights to host memory and back
    """The function class (spec ``entry = "image_classifier:ImageClassifier"``, kind inference).

    ``backend``: ``torchvision`` or ``torch_models`` (which ResNet-50 runs); ``image_size``:
    the side of the network's input, pixels. Raises ValueError for an unknown ``size`` or
    device, RuntimeError for ``cuda`` without a GPU.
    """

    def __init__(self, ctx: FunctionContext) -> None:
        sizes = model_sizes(ctx)
        self.device = tm.resolve_device(ctx.device)
        self.dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        self.batch_size = max(1, ctx.batch_size)
        self.image_size = sizes.image
        if torchvision is not None and sizes == tm.FULL:
            self.backend = "torchvision"
            net = _torchvision_resnet50()
        else:
            self.backend = "torch_models"
            net = tm.build("resnet50", "cpu", sizes=sizes).net
        self.net = net.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
        # warm-up (part of the cold start): a batch of 1, then a full batch
        self.predict([b"warm-up"])
        self.predict([b"warm-up %d" % i for i in range(self.batch_size)])
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def image(self, payload: bytes) -> torch.Tensor:
        """The network's input for one payload: (3, S, S) float32 on the CPU, normalised."""
        if Image is not None:
            try:
                with Image.open(io.BytesIO(payload)) as img:
                    rgb = img.convert("RGB").resize((self.image_size, self.image_size), Image.BILINEAR)
                pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
                x = pixels.view(self.image_size, self.image_size, 3).permute(2, 0, 1).float() / 255.0
                return (x - self.mean) / self.std
            except Exception:  # noqa: BLE001 - Pillow raises many types for broken files; any -> derived
                pass
        g = torch.Generator().manual_seed(tm.payload_seed(payload))
        field = torch.randn(1, 3, 7, 7, generator=g)
        return F.interpolate(field, size=(self.image_size, self.image_size), mode="bilinear",
                             align_corners=False)[0]

    def predict(self, batch: list[bytes]) -> list[bytes]:
        """One JSON answer per payload, in order (see the module docstring); runs chunks of at
        most ``ctx.batch_size``."""
        out: list[bytes] = []
        for i in range(0, len(batch), self.batch_size):
            chunk = batch[i:i + self.batch_size]
            x = torch.stack([self.image(p) for p in chunk]).to(device=self.device, dtype=self.dtype)
            with torch.inference_mode():
                probs = self.net(x).float().softmax(dim=-1)
                scores, classes = probs.max(dim=-1)
            out += [json.dumps({"class": c, "score": round(s, 6)}).encode()
                    for c, s in zip(classes.tolist(), scores.tolist())]
        return out
