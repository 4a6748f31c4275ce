"""A text generator function (kind ``llm``): a GPT-2-small-sized decoder with random weights
from a fixed seed that streams its output token by token.

Input: JSON ``{"prompt": "...", "max_new_tokens": 16}``, or plain UTF-8 text (the prompt, 16 new
tokens). ``max_new_tokens`` is clamped to 1..256 (to the positions left after the prompt on a
tiny model); a missing or non-integer value means 16, a JSON object without a string ``prompt``
an empty prompt, and bytes that are not UTF-8 are replaced: one odd request never fails the
batch it runs in.

There is no tokenizer download, so tokens are words: the prompt is split on whitespace and each
word becomes one id by a hash (64-bit BLAKE2b, modulo the vocabulary); the last 32 words are kept
and left-padded with the end-of-text id, so every prompt has the same shape and a request's
output does not depend on the batch it ran in. Each generated id is shown as a word of the fixed
list :data:`WORDS` (id modulo its length), joined by single spaces.

Output: streamed chunks, one per generated token (UTF-8 text: the word, with a leading space
after the first); the final reply is the chunks joined, e.g. ``"time river time ..."``.

Decoding is greedy with a KV cache (the prompt in one step, then one token a step for the whole
batch), never choosing one of the request's last 8 tokens (prompt included; a random network
would otherwise repeat one word); a request that has its tokens gets ``None`` for the remaining
steps. The network is the
platform's plain-torch GPT-2-small-sized decoder (``dilu.services.node_agent.handlers.torch_models``:
12 layers, d=768, vocabulary 50257, 1024 positions). ``ctx.config["size"] = "tiny"`` (or
``DILU_TORCH_TINY=1``) builds the tiny one (2 layers, d=64, 128 positions, 8-word prompts) for
tests on a small CPU. ``ctx.device``: ``cuda`` runs in fp16, ``cpu`` in fp32.
"""
from __future__ import annotations

import hashlib
import json
from typing import Iterator

import torch

from dilu.client.functions import FunctionContext
from dilu.services.node_agent.handlers import torch_models as tm

DEFAULT_NEW_TOKENS = tm.DEFAULT_NEW_TOKENS
# a random-weight decoder with a tied LM head mostly predicts the token it was just given; greedy
# decoding then repeats one word. The next token is the best one not among the last few.
NO_REPEAT_WINDOW = 8

# the words generated ids are shown as (id modulo the list's length): a stand-in for a tokenizer
WORDS = tuple("""
the of and to in is was for on that with as by at from it an be this which or are had not but
have one were all their there been has more when will who would can no out so what up into time
only some could them other new than then first any these two may like over such our most after
made also did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men work long
here get both between life being under never day same another know while last might us great
old year off come since against go came right used take three himself few house use during
without again place around however home small found thought went say part once general high
upon school every does got united left number course war until always away something fact water
though less public put think almost hand enough far took head yet government system better set
told nothing night end why called eyes find going look asked later knew point next city give
group toward young light river sea green stone window garden morning road music paper story
""".split())


def model_sizes(ctx: FunctionContext) -> tm.Sizes:
    """The model's dimensions from ``ctx.config["size"]`` (``tiny`` or ``full``; unset: full
    unless ``DILU_TORCH_TINY=1``). Raises ValueError for any other value."""
    return tm.sizes_from_config(ctx.config)


def parse_request(payload: bytes, cap: int) -> tuple[str, int]:
    """(prompt, new tokens 1..cap) of one payload, as the module docstring says; never raises."""
    text = bytes(payload).decode("utf-8", errors="replace")
    n = DEFAULT_NEW_TOKENS
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            obj = None  # not JSON after all: the whole text is the prompt
        if isinstance(obj, dict):
            prompt = obj.get("prompt")
            text = prompt if isinstance(prompt, str) else ""
            value = obj.get("max_new_tokens")
            if isinstance(value, int) and not isinstance(value, bool):
                n = value
    return text, max(1, min(cap, n))


def prompt_ids(prompt: str, vocab: int, length: int) -> list[int]:
    """``length`` ids: the hashed words of ``prompt`` (the last ``length``), left-padded with the
    end-of-text id (``vocab - 1``, GPT-2's last id)."""
    ids = [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % (vocab - 1)
           for w in prompt.split()][-length:]
    return [vocab - 1] * (length - len(ids)) + ids


def token_text(token: int, first: bool) -> bytes:
    """The chunk of one generated id: its word, after a space unless it is the first."""
    word = WORDS[token % len(WORDS)]
    return (word if first else " " + word).encode()


def pick(logits: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
    """Greedy choice: logits (B, vocab) and each request's recent ids (B, k) int64 -> the best id
    of each row that is not among its recent ones (B,) int64."""
    return logits.scatter(1, recent, float("-inf")).argmax(dim=-1)


class TextGenerator:
    """The function class (spec ``entry = "text_generator:TextGenerator"``, kind llm). Raises
    ValueError for an unknown ``size`` or device, RuntimeError for ``cuda`` without a GPU."""

    def __init__(self, ctx: FunctionContext) -> None:
        self.sizes = model_sizes(ctx)
        model = tm.build("gpt2", ctx.device, ctx.batch_size, self.sizes)  # seeded, eval, fp16 on cuda
        self.net, self.device = model.net, model.device
        self.batch_size = model.batch_size
        # warm-up (part of the cold start): a request of 1, then a full batch, 2 tokens each
        for batch in ([b"warm-up"], [b'{"prompt": "warm-up", "max_new_tokens": 2}'] * self.batch_size):
            for _ in self.generate(batch):
                pass
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def generate(self, batch: list[bytes]) -> Iterator[list[bytes | None]]:
        """Yields one list per decoding step: for each request its token's text, or None once
        it has all its tokens; as many steps as the batch's largest ``max_new_tokens``."""
        if not batch:
            return
        s = self.sizes
        requests = [parse_request(p, s.max_new_tokens_cap) for p in batch]
        wanted = [n for _, n in requests]
        ids = torch.tensor([prompt_ids(prompt, s.gpt_vocab, s.prompt) for prompt, _ in requests], device=self.device)
        # inference mode per step, never across a yield: it is thread state the caller would inherit
        recent = ids[:, -NO_REPEAT_WINDOW:]
        with torch.inference_mode():
            logits, past = self.net.step(ids, None, 0)
            tokens = pick(logits, recent)
        for step in range(max(wanted)):
            if step > 0:
                recent = torch.cat((recent[:, 1:], tokens[:, None]), dim=1)
                with torch.inference_mode():
                    logits, past = self.net.step(tokens[:, None], past, s.prompt + step - 1)
                    tokens = pick(logits, recent)
            yield [token_text(t, step == 0) if step < n else None for t, n in zip(tokens.tolist(), wanted)]
