"""Real torch models with random weights: ResNet-50, a BERT-base-sized encoder, a GPT-2-small-sized
decoder. The compute of real models on a real GPU (or a CPU node), with no downloads.

Every network is defined here in plain torch (torchvision and transformers are not needed); the
weights are drawn from a fixed seed on the CPU, so every instance of a model holds the same weights
and equal payloads give equal outputs. The classifiers' biases are centred on a few seeded inputs
(:func:`_center_head`), so that the class depends on the input as in a trained network.

Models (``ctx.model``, keys of :data:`MODELS`):

- ``resnet50``: the ResNet-50 (v1.5) layout: a 7x7/2 stem and max-pool, bottleneck blocks 3-4-6-3
  of widths 64/128/256/512 expanded 4x (stride on the 3x3 conv), global average pool, 1000
  classes. Input: one 3x224x224 image per payload. Output: the class index, ASCII (``b"417"``).
- ``bert_base``: a BERT-base-sized encoder: token and position embeddings, 12 post-LN layers,
  d=768, 12 heads, FFN 3072 with GELU, vocabulary 30522, 128 tokens per payload, a tanh pooler
  over the mean token state and a 2-label classifier. Output: the label index, ASCII (``b"1"``).
- ``gpt2``: a GPT-2-small-sized decoder: 12 pre-LN layers, d=768, 12 heads, FFN 3072 with GELU,
  vocabulary 50257, 1024 positions, LM head tied to the token embedding; a 32-token prompt per
  payload, then N tokens generated greedily with a KV cache. Output: the N generated token ids,
  ASCII decimal, separated by single spaces (``b"318 262 ..."``).

Inputs are derived deterministically from each payload (opaque bytes, any length, empty
included): a 64-bit BLAKE2b hash of the payload seeds a CPU generator that draws the image (a
3x7x7 normal field, bilinearly upsampled to the image size) or the token ids. For ``gpt2`` a
payload that is a JSON object with an integer ``max_new_tokens`` sets N (clamped to
1..``max_new_tokens_cap``); any other payload gets N = 16. A batch is generated to its largest N
and each output cut to its own N.

Device and precision: ``ctx.device == "cuda"`` runs on ``torch.device("cuda")`` (the process's
current GPU: the node agent gives an instance one GPU through ``CUDA_VISIBLE_DEVICES``) in fp16;
``"cpu"`` runs in fp32; any other device raises ValueError.

Environment: ``DILU_TORCH_TINY=1`` (read by :func:`load`) shrinks every model so tests on a small
CPU take seconds: 2 layers (ResNet: one bottleneck per stage, widths 8/16/32/64), d=64, 4 heads,
FFN 256, vocabularies of 1024, 10 classes, 32x32 images, 16 encoder tokens, 8 prompt tokens,
128 positions.

:func:`load` builds the model and warms it up with a batch of 1 and one of ``ctx.batch_size``
(the instance's cold start); :func:`predict` runs a batch of any length, in chunks of at most
``ctx.batch_size``. :func:`park` moves the weights to host memory and gives their GPU memory back
(an idle instance parked live); :func:`resume` moves them back to the model's device.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:  # only a type: this module also loads by file path (scripts/gpu_check)
    from . import HandlerContext

TINY_ENV = "DILU_TORCH_TINY"
WEIGHT_SEED = 0
DEFAULT_NEW_TOKENS = 16
MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class Sizes:
    """The dimensions of all three models. Image sizes in pixels (square), sequence lengths and
    vocabularies in tokens, widths in channels / features."""

    image: int = 224
    stem: int = 64                      # ResNet: channels of the stem and width of the first stage
    res_blocks: tuple[int, ...] = (3, 4, 6, 3)
    classes: int = 1000
    layers: int = 12                    # BERT and GPT-2
    d_model: int = 768
    heads: int = 12
    d_ff: int = 3072
    bert_vocab: int = 30522
    bert_seq: int = 128
    bert_labels: int = 2
    gpt_vocab: int = 50257
    gpt_positions: int = 1024
    prompt: int = 32

    @property
    def max_new_tokens_cap(self) -> int:
        """The most tokens one request may generate: positions left after the prompt, at most 256."""
        return max(1, min(MAX_NEW_TOKENS, self.gpt_positions - self.prompt))


FULL = Sizes()
TINY = replace(FULL, image=32, stem=8, res_blocks=(1, 1, 1, 1), classes=10, layers=2, d_model=64, heads=4,
               d_ff=256, bert_vocab=1024, bert_seq=16, gpt_vocab=1024, gpt_positions=128, prompt=8)


def sizes_from_env() -> Sizes:
    """:data:`TINY` when ``DILU_TORCH_TINY`` is 1 (or true/yes/on), else :data:`FULL`."""
    return TINY if os.environ.get(TINY_ENV, "").strip().lower() in ("1", "true", "yes", "on") else FULL


def sizes_from_config(config: dict[str, str]) -> Sizes:
    """The sizes a function's ``[config] size`` asks for: ``tiny`` or ``full``; unset:
    :func:`sizes_from_env`. Raises ValueError for any other value."""
    size = config.get("size", "")
    if size not in ("", "tiny", "full"):
        raise ValueError(f"config size must be 'tiny' or 'full', not {size!r}")
    if size == "tiny":
        return TINY
    return FULL if size == "full" else sizes_from_env()


# ---------------------------------------------------------------------------------------- ResNet-50


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 convolutions with batch norm, plus the (projected) identity.
    (B, cin, H, W) -> (B, 4*width, H/stride, W/stride)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        return torch.relu(self.body(x) + identity)


class ResNet50(nn.Module):
    """Images (B, 3, S, S), any float dtype of the weights -> class logits (B, classes).
    ``features``: images -> pooled features (B, 8 x stem); ``head``: the classifier."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, s.stem, 7, 2, 3, bias=False), nn.BatchNorm2d(s.stem),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = s.stem
        for stage, blocks in enumerate(s.res_blocks):
            width = s.stem * 2**stage
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, 2 if stage > 0 and i == 0 else 1))
                cin = 4 * width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, s.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _center_head(net: nn.Module, calibration: torch.Tensor) -> None:
    """Sets the classifier's bias to -W·mu, mu the mean feature of a few calibration inputs.

    The features of a random network share a large common part (post-ReLU features are all
    positive), which would give every input the same class; removing it lets the class depend on
    the input, as in a trained network. Deterministic: the calibration inputs are seeded."""
    with torch.inference_mode():
        mu = net.features(calibration).mean(dim=0)
        net.head.bias.copy_(-(net.head.weight @ mu))


# ------------------------------------------------------------------------------ transformer parts


def _attention(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Splits (B, T, 3d) projections into q, k, v of shape (B, heads, T, d/heads)."""
    b, t, three_d = qkv.shape
    q, k, v = qkv.view(b, t, 3, heads, three_d // (3 * heads)).permute(2, 0, 3, 1, 4)
    return q, k, v


def _merge(y: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, hd) -> (B, T, heads*hd)."""
    b, h, t, hd = y.shape
    return y.transpose(1, 2).reshape(b, t, h * hd)


class EncoderLayer(nn.Module):
    """A BERT (post-LN) layer: x = LN(x + Attn(x)); x = LN(x + FFN(x)). (B, T, d) -> (B, T, d)."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.heads = s.heads
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model)
        self.out = nn.Linear(s.d_model, s.d_model)
        self.ln1 = nn.LayerNorm(s.d_model)
        self.ff1 = nn.Linear(s.d_model, s.d_ff)
        self.ff2 = nn.Linear(s.d_ff, s.d_model)
        self.ln2 = nn.LayerNorm(s.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _attention(self.qkv(x), self.heads)
        x = self.ln1(x + self.out(_merge(F.scaled_dot_product_attention(q, k, v))))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class BertEncoder(nn.Module):
    """Token ids (B, T <= bert_seq), int64 -> label logits (B, bert_labels), from the mean of the
    final token states through a tanh pooler. ``features``: ids -> pooled (B, d); ``head``: the
    classifier."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.bert_vocab, s.d_model)
        self.pos = nn.Embedding(s.bert_seq, s.d_model)
        self.ln = nn.LayerNorm(s.d_model)
        self.layers = nn.ModuleList(EncoderLayer(s) for _ in range(s.layers))
        self.pool = nn.Linear(s.d_model, s.d_model)
        self.head = nn.Linear(s.d_model, s.bert_labels)

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.ln(self.tok(ids) + self.pos(positions))
        for layer in self.layers:
            x = layer(x)
        return torch.tanh(self.pool(x.mean(dim=1)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(ids))


class DecoderBlock(nn.Module):
    """A GPT-2 (pre-LN) block with a KV cache. (B, T, d) and the cache of the positions before
    (k, v each (B, heads, T_past, d/heads), or None) -> (B, T, d) and the cache extended by T."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.d_model)
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model)
        self.proj = nn.Linear(s.d_model, s.d_model)
        self.ln2 = nn.LayerNorm(s.d_model)
        self.ff1 = nn.Linear(s.d_model, s.d_ff)
        self.ff2 = nn.Linear(s.d_ff, s.d_model)

    def forward(self, x: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        q, k, v = _attention(self.qkv(self.ln1(x)), self.heads)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        # without a cache the block sees the whole prefix: causal; a decode step (T = 1) sees all
        y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        x = x + self.proj(_merge(y))
        x = x + self.ff2(F.gelu(self.ff1(self.ln2(x)), approximate="tanh"))
        return x, (k, v)


class Gpt2Decoder(nn.Module):
    """GPT-2-small-sized decoder with a tied LM head (see the module docstring)."""

    def __init__(self, s: Sizes) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.gpt_vocab, s.d_model)
        self.wpe = nn.Embedding(s.gpt_positions, s.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.d_model)

    def step(self, ids: torch.Tensor, past: list | None, start: int) -> tuple[torch.Tensor, list]:
        """Token ids (B, T) at positions start..start+T-1 -> logits of the last position (B, vocab)
        and the per-block caches."""
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)
        presents = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i])
            presents.append(kv)
        return self.ln_f(x[:, -1]) @ self.wte.weight.t(), presents

    def forward(self, prompt: torch.Tensor, new_tokens: int = DEFAULT_NEW_TOKENS) -> torch.Tensor:
        """Greedy generation. Prompt ids (B, P), int64 -> the generated ids (B, new_tokens), int64."""
        logits, past = self.step(prompt, None, 0)
        out = [logits.argmax(dim=-1)]
        for i in range(1, new_tokens):
            logits, past = self.step(out[-1][:, None], past, prompt.shape[1] + i - 1)
            out.append(logits.argmax(dim=-1))
        return torch.stack(out, dim=1)


def _init_transformer(net: nn.Module, layers: int) -> None:
    """BERT / GPT-2 initialisation: weights N(0, 0.02) (output projections of residual branches
    scaled by 1/sqrt(2 x layers), as GPT-2 does), biases 0, layer norms 1/0."""
    for name, p in net.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight", "ff2.weight")) else 0.02
            nn.init.normal_(p, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


CALIBRATION_INPUTS = 8


def build_resnet50(s: Sizes) -> nn.Module:
    """ResNet50 with its head centred on 8 seeded images at up to 112x112 pixels (eval mode)."""
    net = ResNet50(s).eval()
    g = torch.Generator().manual_seed(WEIGHT_SEED + 1)
    size = min(s.image, 112)  # the features' mean barely depends on the size; a quarter of the cost
    images = F.interpolate(torch.randn(CALIBRATION_INPUTS, 3, 7, 7, generator=g), size=(size, size),
                           mode="bilinear", align_corners=False)
    _center_head(net, images)
    return net


def build_bert_base(s: Sizes) -> nn.Module:
    """BertEncoder with BERT's initialisation, its head centred on 8 seeded inputs of up to 32 tokens."""
    net = BertEncoder(s).eval()
    _init_transformer(net, s.layers)
    g = torch.Generator().manual_seed(WEIGHT_SEED + 1)
    _center_head(net, torch.randint(0, s.bert_vocab, (CALIBRATION_INPUTS, min(s.bert_seq, 32)), generator=g))
    return net


def build_gpt2(s: Sizes) -> nn.Module:
    net = Gpt2Decoder(s)
    _init_transformer(net, s.layers)
    return net


MODELS: dict[str, Callable[[Sizes], nn.Module]] = {
    "resnet50": build_resnet50,
    "bert_base": build_bert_base,
    "gpt2": build_gpt2,
}


# ----------------------------------------------------------------------------------- payloads


def payload_seed(payload: bytes) -> int:
    """A 63-bit seed from the payload's BLAKE2b-64 hash (equal payloads, equal seeds)."""
    return int.from_bytes(hashlib.blake2b(bytes(payload), digest_size=8).digest(), "little") >> 1


def new_tokens_of(payload: bytes, cap: int) -> int:
    """N for ``gpt2``: ``max_new_tokens`` of a JSON-object payload, clamped to 1..cap; else 16
    (also clamped). Never raises."""
    n = DEFAULT_NEW_TOKENS
    if bytes(payload[:1]) == b"{":
        try:
            obj = json.loads(bytes(payload))
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        value = obj.get("max_new_tokens") if isinstance(obj, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
    return max(1, min(cap, n))


@dataclass
class TorchModel:
    """A loaded model. ``name``: a key of :data:`MODELS`; ``net``: the module on ``device`` in
    ``dtype`` (eval mode); ``batch_size``: the largest batch run at once."""

    name: str
    net: nn.Module
    sizes: Sizes
    device: torch.device
    dtype: torch.dtype
    batch_size: int

    def inputs(self, payloads: list[bytes]) -> torch.Tensor:
        """The network's input for a batch of payloads, on the model's device:
        resnet50 -> images (B, 3, S, S) in the model's dtype; bert_base -> ids (B, bert_seq)
        int64; gpt2 -> prompt ids (B, prompt) int64."""
        s = self.sizes
        gens = [torch.Generator().manual_seed(payload_seed(p)) for p in payloads]
        if self.name == "resnet50":
            small = torch.stack([torch.randn(3, 7, 7, generator=g) for g in gens])
            x = F.interpolate(small.to(self.device), size=(s.image, s.image), mode="bilinear", align_corners=False)
            return x.to(self.dtype)
        if self.name == "bert_base":
            ids = torch.stack([torch.randint(0, s.bert_vocab, (s.bert_seq,), generator=g) for g in gens])
            ids[:, 0] = 101 % s.bert_vocab  # BERT inputs start with [CLS] (id 101)
            return ids.to(self.device)
        return torch.stack([torch.randint(0, s.gpt_vocab, (s.prompt,), generator=g) for g in gens]).to(self.device)

    def run(self, payloads: list[bytes]) -> list[bytes]:
        """One forward pass (or one generation) over up to ``batch_size`` payloads; one output
        per payload, in order (see the module docstring)."""
        if not payloads:
            return []
        x = self.inputs(payloads)
        with torch.inference_mode():
            if self.name == "gpt2":
                wanted = [new_tokens_of(p, self.sizes.max_new_tokens_cap) for p in payloads]
                ids = self.net(x, max(wanted)).tolist()
                return [" ".join(map(str, row[:n])).encode() for row, n in zip(ids, wanted)]
            classes = self.net(x).argmax(dim=-1).tolist()
        return [str(c).encode() for c in classes]


def resolve_device(name: str) -> torch.device:
    """``cuda`` -> torch.device("cuda") (RuntimeError when torch sees no GPU); ``cpu`` -> CPU;
    anything else -> ValueError."""
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("ctx.device is 'cuda' but torch sees no CUDA GPU")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"torch_models runs on 'cuda' or 'cpu', not {name!r}")


def build(name: str, device: str = "cpu", batch_size: int = 1, sizes: Sizes | None = None) -> TorchModel:
    """Builds model ``name`` with the fixed-seed weights (drawn on the CPU, then moved), in eval
    mode, fp16 on cuda and fp32 on cpu; no warm-up. ``sizes``: default from the environment
    (:func:`sizes_from_env`). Raises ValueError for an unknown model or device."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} for torch_models; choose from {', '.join(MODELS)}")
    dev = resolve_device(device)
    s = sizes or sizes_from_env()
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
        torch.manual_seed(WEIGHT_SEED)
        net = MODELS[name](s)
    net = net.to(device=dev, dtype=dtype).eval()
    net.requires_grad_(False)
    return TorchModel(name=name, net=net, sizes=s, device=dev, dtype=dtype, batch_size=max(1, int(batch_size)))


def load(ctx: "HandlerContext") -> TorchModel:
    """Builds ``ctx.model`` on ``ctx.device`` and warms it up (batches of 1 and ``ctx.batch_size``),
    so the first request pays no lazy initialisation. Raises ValueError for an unknown model or
    device, RuntimeError for ``cuda`` without a GPU."""
    model = build(ctx.model, ctx.device, ctx.batch_size)
    model.run([b"warm-up"])
    if model.batch_size > 1:
        model.run([b"warm-up %d" % i for i in range(model.batch_size)])
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return model


def predict(model: TorchModel, batch: list[bytes]) -> list[bytes]:
    """One output per payload, in order; runs chunks of at most ``model.batch_size``."""
    out: list[bytes] = []
    for i in range(0, len(batch), model.batch_size):
        out += model.run(batch[i:i + model.batch_size])
    return out


class ParksNet:
    """Parking for a function class that keeps its torch module as ``self.net`` on
    ``self.device``: ``park()`` moves the weights to host memory and frees their device memory,
    ``resume()`` moves them back (:func:`park`, :func:`resume`; the contract is in
    ``dilu.client.functions``). A class inheriting it can be parked."""

    net: nn.Module
    device: torch.device

    def park(self) -> None:
        park(self)

    def resume(self) -> None:
        resume(self)


def park(model: TorchModel) -> None:
    """Move the weights to host memory; on CUDA, also hand the freed blocks back to the driver
    (torch's caching allocator would keep them: the GPU would still count them against the
    instance). On the CPU a no-op. ``model``: a :class:`TorchModel`, or anything with its
    ``net`` and ``device`` (:class:`ParksNet`). Raises what torch raises."""
    model.net.to("cpu")
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def resume(model: TorchModel) -> None:
    """Move the weights back to ``model.device`` (a no-op on the CPU; ``model`` as in
    :func:`park`). Raises what torch raises
    (e.g. torch.cuda.OutOfMemoryError when the GPU no longer has the room)."""
    model.net.to(model.device)
    if model.device.type == "cuda":
        torch.cuda.synchronize()  # READY follows: the copy must be done, not queued
