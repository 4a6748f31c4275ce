"""A text encoder function: a BERT-base-sized encoder with random weights from a fixed seed.

Input: UTF-8 text (invalid bytes are replaced, so any payload is accepted). There is no
tokenizer download: the text is lower-cased and split on whitespace, and each word becomes one
token id by a hash (64-bit BLAKE2b of the word, modulo the vocabulary, above BERT's special ids),
so equal words get equal ids on every node. The ids are framed ``[CLS] words... [SEP]``, padded
with ``[PAD]`` to the model's 128 positions (words past 126 are dropped): every request has the
same shape, so its answer does not depend on the batch it ran in.

Output: JSON ``{"embedding_dim": 768, "embedding": [8 floats], "label": <int, 0 or 1>}``:
the sentence embedding is the tanh pooler over the mean final token state (768 values; the first
8 are returned, rounded to 4 decimals), the label is the 2-way classifier's argmax.

The network is the platform's plain-torch BERT-base-sized encoder
(``dilu.services.node_agent.handlers.torch_models``: 12 post-LN layers, d=768, 12 heads,
vocabulary 30522). ``ctx.config["size"] = "tiny"`` (or ``DILU_TORCH_TINY=1``) builds the tiny one
(2 layers, d=64, 16 positions, vocabulary 1024) for tests on a small CPU. ``ctx.device``: ``cuda``
runs in fp16, ``cpu`` in fp32.
"""
from __future__ import annotations

import hashlib
import json

import torch

from dilu.client.functions import FunctionContext
from dilu.services.node_agent.handlers import torch_models as tm

PAD_ID, CLS_ID, SEP_ID = 0, 101, 102  # BERT's special tokens
FIRST_WORD_ID = 103                   # word ids start above the special ones
EMBEDDING_VALUES = 8                  # how many embedding values an answer carries


def model_sizes(ctx: FunctionContext) -> tm.Sizes:
    """The model's dimensions from ``ctx.config["size"]`` (``tiny`` or ``full``; unset: full
    unless ``DILU_TORCH_TINY=1``). Raises ValueError for any other value."""
    return tm.sizes_from_config(ctx.config)


def word_id(word: str, vocab: int) -> int:
    """The token id of one word: its BLAKE2b-64 hash into ``FIRST_WORD_ID..vocab-1``."""
    h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
    return FIRST_WORD_ID + h % (vocab - FIRST_WORD_ID)


def tokenize(payload: bytes, vocab: int, length: int) -> list[int]:
    """``length`` token ids: [CLS], the hashed words of the payload (UTF-8, lower-cased, split on
    whitespace; at most ``length - 2``), [SEP], then [PAD]s."""
    words = bytes(payload).decode("utf-8", errors="replace").lower().split()[:length - 2]
    ids = [CLS_ID] + [word_id(w, vocab) for w in words] + [SEP_ID]
    return ids + [PAD_ID] * (length - len(ids))


class TextEncoder(tm.ParksNet):  # park()/resume(): weights to host memory and back
    """The function class (spec ``entry = "text_encoder:TextEncoder"``, kind inference).

    ``embedding_dim``: the width of the sentence embedding (768; 64 tiny). Raises ValueError for
    an unknown ``size`` or device, RuntimeError for ``cuda`` without a GPU.
    """

    def __init__(self, ctx: FunctionContext) -> None:
        self.sizes = model_sizes(ctx)
        model = tm.build("bert_base", ctx.device, ctx.batch_size, self.sizes)  # seeded, eval, fp16 on cuda
        self.net, self.device = model.net, model.device
        self.batch_size = model.batch_size
        self.embedding_dim = self.sizes.d_model
        self.predict([b"warm-up"])
        self.predict([b"warm-up %d" % i for i in range(self.batch_size)])
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def predict(self, batch: list[bytes]) -> list[bytes]:
        """One JSON answer per payload, in order (see the module docstring); runs chunks of at
        most ``ctx.batch_size``."""
        s = self.sizes
        out: list[bytes] = []
        for i in range(0, len(batch), self.batch_size):
            chunk = batch[i:i + self.batch_size]
            ids = torch.tensor([tokenize(p, s.bert_vocab, s.bert_seq) for p in chunk], device=self.device)
            with torch.inference_mode():
                emb = self.net.features(ids)
                labels = self.net.head(emb).argmax(dim=-1).tolist()
                heads = emb[:, :EMBEDDING_VALUES].float().tolist()
            out += [json.dumps({"embedding_dim": self.embedding_dim, "embedding": [round(v, 4) for v in head],
                                "label": label}).encode()
                    for head, label in zip(heads, labels)]
        return out
