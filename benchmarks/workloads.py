"""Seeded, reproducible serving workloads: prompts as token ids, output lengths, arrivals.

Prompts are random token ids (the model's weights are random too, so text would
add nothing but tokenizer round trips), drawn above the special ids so that
`prompt_len` is exact. Every request sets `ignore_eos`, so it produces exactly
`max_tokens` tokens whatever the model samples.

- `paged_attention`: the seed design's burst: 48 requests at t=0, prompts
  128-384 tokens, 128-256 new tokens each.
- `long_tail`: mostly short requests (prompts 16-256, 16-128 new tokens; less
  when `max_seq_len` < 1024) and every `tail_every`-th one near `max_seq_len`
  (prompt + output in 75-95% of it), all arriving at once.
- `poisson`: the `paged_attention` length distribution arriving as a Poisson
  process at `rate` requests/s.
- `repetitive`: real text for a real model (its tokenizer and chat template): each
  request asks to repeat a list of 10-16 random items, and may write as many tokens
  as the list has; what speculative decoding's n-gram drafts are for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

FIRST_ID = 16  # below this, ids may be special tokens


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float  # offset from the start of the run

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.max_tokens


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[WorkloadRequest, ...]
    description: str
    # another workload like this one from a seed (text workloads: random ids would not do)
    regenerate: Callable[[int], Workload] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def with_fresh_tokens(self, seed: int, vocab_size: int = 32000) -> Workload:
        """Same lengths and arrivals, different prompt token ids: a warm-up pass that
        compiles the same shapes but leaves nothing a prefix cache could reuse."""
        if self.regenerate is not None:
            return self.regenerate(seed)
        rng = np.random.default_rng([seed, 0x5EED])
        reqs = tuple(
            dataclasses.replace(r, prompt_ids=_prompt(rng, r.prompt_len, vocab_size))
            for r in self.requests
        )
        return dataclasses.replace(self, requests=reqs)

    def summary(self) -> dict[str, float | int | str]:
        lens = np.array([r.total_len for r in self.requests])
        return {
            "name": self.name,
            "description": self.description,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "total_len_mean": float(lens.mean()),
            "total_len_max": int(lens.max()),
            "last_arrival_s": max(r.arrival_s for r in self.requests),
        }


def _prompt(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.integers(FIRST_ID, vocab_size, n).tolist())


def paged_attention(
    num_requests: int = 48,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    prompt_range: tuple[int, int] = (128, 384),
    output_range: tuple[int, int] = (128, 256),
    **_: object,
) -> Workload:
    """The burst: every request at t=0; lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _i in range(num_requests):
        p = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        o = int(rng.integers(output_range[0], output_range[1] + 1))
        reqs.append(WorkloadRequest(_prompt(rng, p, vocab_size), o, 0.0))
    return Workload(
        "paged_attention",
        tuple(reqs),
        f"{num_requests} requests at once, prompts {prompt_range[0]}-{prompt_range[1]} tokens, "
        f"{output_range[0]}-{output_range[1]} new tokens, ignore_eos",
    )


def long_tail(
    num_requests: int = 48,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    max_seq_len: int = 4096,
    tail_every: int = 12,
    **_: object,
) -> Workload:
    """Mostly short requests, every `tail_every`-th near max_seq_len (at least one)."""
    rng = np.random.default_rng(seed)
    short_p, short_o = min(256, max_seq_len // 4), min(128, max_seq_len // 8)
    reqs = []
    for i in range(num_requests):
        if i % tail_every == tail_every // 2 or (num_requests < tail_every and i == 0):
            total = int(rng.integers(int(0.75 * max_seq_len), int(0.95 * max_seq_len) + 1))
            o = int(rng.integers(min(64, total // 4), min(128, total // 2) + 1))
            p = total - o
        else:
            p = int(rng.integers(min(16, short_p), short_p + 1))
            o = int(rng.integers(min(16, short_o), short_o + 1))
        reqs.append(WorkloadRequest(_prompt(rng, p, vocab_size), o, 0.0))
    return Workload(
        "long_tail",
        tuple(reqs),
        f"{num_requests} requests at once: prompts {min(16, short_p)}-{short_p} + "
        f"{min(16, short_o)}-{short_o} new tokens, and every "
        f"{tail_every}th prompt + output at 75-95% of max_seq_len={max_seq_len} "
        f"(64-128 new tokens), ignore_eos",
    )


def poisson(
    num_requests: int = 48,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    rate: float = 2.0,
    **_: object,
) -> Workload:
    """`paged_attention` lengths, exponential inter-arrival times of mean 1/rate s."""
    base = paged_attention(num_requests, seed=seed, vocab_size=vocab_size)
    rng = np.random.default_rng(seed + 1)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    arrivals -= arrivals[0]  # the first request opens the run
    reqs = tuple(
        dataclasses.replace(r, arrival_s=float(t))
        for r, t in zip(base.requests, arrivals, strict=True)
    )
    return Workload(
        "poisson",
        reqs,
        f"{num_requests} requests, Poisson arrivals at {rate:g} req/s, "
        f"paged_attention lengths, ignore_eos",
    )


def long_prompts(
    num_requests: int = 8,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    **_: object,
) -> Workload:
    """Long documents: prompts of 2k-6k tokens, 256 new tokens each, all at t=0 (where a
    sliding-window model's local layers need a fraction of the KV)."""
    base = paged_attention(
        num_requests,
        seed=seed,
        vocab_size=vocab_size,
        prompt_range=(2048, 6144),
        output_range=(256, 256),
    )
    return Workload(
        "long_prompts",
        base.requests,
        f"{num_requests} requests at once, prompts 2048-6144 tokens, 256 new tokens, ignore_eos",
    )


_ADJECTIVES = [
    "red",
    "green",
    "blue",
    "ripe",
    "fresh",
    "small",
    "large",
    "frozen",
    "dried",
    "sweet",
    "sour",
    "organic",
    "smoked",
    "roasted",
    "sliced",
    "whole",
]
_NOUNS = [
    "apples",
    "bananas",
    "cherries",
    "grapes",
    "lemons",
    "mangoes",
    "oranges",
    "peaches",
    "pears",
    "plums",
    "kiwis",
    "melons",
    "carrots",
    "onions",
    "potatoes",
    "tomatoes",
    "peppers",
    "beans",
    "lentils",
    "almonds",
    "walnuts",
    "cashews",
    "oats",
    "rice",
    "noodles",
    "bread",
    "cheese",
    "butter",
    "yogurt",
    "eggs",
]


def repetitive(
    num_requests: int = 8,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    **_: object,
) -> Workload:
    """Prompts the answer quotes: "Repeat this list exactly" over 10-16 random items, as a
    chat turn; each may generate as many tokens as its list has, all at t=0."""
    if tokenizer is None:
        raise ValueError(
            "the repetitive workload is text: it needs the model's tokenizer (in process)"
        )
    rng = np.random.default_rng(seed)
    reqs = []
    for _i in range(num_requests):
        items = [
            f"{k}. {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
            for k in range(1, int(rng.integers(10, 17)) + 1)
        ]
        listing = "\n".join(items)
        turn = [{"role": "user", "content": f"Repeat this list exactly:\n{listing}"}]
        text = (
            tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
            if getattr(tokenizer, "chat_template", None)
            else turn[0]["content"] + "\n\n"
        )
        prompt = tuple(int(t) for t in tokenizer.encode(text))
        reqs.append(WorkloadRequest(prompt, len(tokenizer.encode(listing)), 0.0))
    return Workload(
        "repetitive",
        tuple(reqs),
        f"{num_requests} requests at once, each: repeat a list of 10-16 items (as many new "
        "tokens as the list has), ignore_eos",
        lambda s: repetitive(num_requests, seed=s, tokenizer=tokenizer),
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "paged_attention": paged_attention,
    "long_tail": long_tail,
    "poisson": poisson,
    "long_prompts": long_prompts,
    "repetitive": repetitive,
}
DEFAULT_NUM_REQUESTS = {
    "paged_attention": 48,
    "long_tail": 48,
    "poisson": 48,
    "long_prompts": 8,
    "repetitive": 8,
}


def make(
    name: str,
    num_requests: int | None = None,
    *,
    seed: int = 0,
    vocab_size: int = 32000,
    max_seq_len: int = 4096,
    rate: float = 2.0,
    tokenizer: Any = None,
) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    n = num_requests if num_requests is not None else DEFAULT_NUM_REQUESTS[name]
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    return WORKLOADS[name](
        n, seed=seed, vocab_size=vocab_size, max_seq_len=max_seq_len, rate=rate, tokenizer=tokenizer
    )
