"""What a quantized KV cache costs in accuracy: perplexity and greedy agreement.

    python -m benchmarks.kv_accuracy                       # both demo models, every kv dtype
    python -m benchmarks.kv_accuracy --models smollm2-135m --kv-cache-dtypes int8

The text is `benchmarks/data/stdlib_docstrings.txt`: the prose lines (no code, no
doctests) of the docstrings of 30 standard-library modules and their public classes
and functions, as Python 3.11.7 has them, fixed in the repository so every run
reads the same tokens. Perplexity comes from the engine's own prompt logprobs
(`SamplingParams.prompt_logprobs=0`) over consecutive windows of `--window` tokens,
each window a prompt; the reference is the same model with a float32 KV cache.
Greedy agreement: `--prompts` prompts of 32 tokens taken evenly from the text, 64
new tokens each; per prompt, the tokens that agree with the reference before the
first divergence.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, machine_line, render_table

TEXT = Path(__file__).resolve().parent / "data" / "stdlib_docstrings.txt"
KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")


def windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids) - 1, size) if len(ids[i : i + size]) > 1]


def perplexity(llm: Any, chunks: list[list[int]]) -> float:
    from jpaged import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    logprobs = [lp for c in llm.generate(chunks, params) for lp in c.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from jpaged import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [c.token_ids for c in llm.generate(prompts, params)]


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first divergence."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def measure(
    model: Any, kv_dtypes: list[str], *, window: int, prompts: int, tokens: int
) -> list[dict[str, Any]]:
    from jpaged import LLM

    ids = model.tokenizer.encode(TEXT.read_text())
    chunks = windows(ids, window)
    step = (len(ids) - 32) // prompts
    starts = [ids[i * step : i * step + 32] for i in range(prompts)]
    rows = []
    reference: dict[str, Any] = {}
    for kv in ["auto", *kv_dtypes]:
        llm = LLM(
            model,
            dtype="float32",
            kv_cache_dtype=kv,
            warmup=False,
            max_seq_len=window + tokens + 32,
            max_batch_size=16,
            enable_prefix_caching=False,
        )
        ppl = perplexity(llm, chunks)
        outs = greedy(llm, starts, tokens)
        if kv == "auto":
            reference = {"ppl": ppl, "outs": outs}
        agree = [agreement(o, r) for o, r in zip(outs, reference["outs"], strict=True)]
        rows.append(
            {
                "kv_cache_dtype": "float32" if kv == "auto" else kv,
                "ppl": ppl,
                "ratio": ppl / reference["ppl"],
                "agree": agree,
                "scored": sum(len(c) - 1 for c in chunks),
                "block_bytes": llm.stats()["kv_block_bytes"],
            }
        )
    return rows


def table(name: str, rows: list[dict[str, Any]], tokens: int) -> str:
    body = [
        [
            r["kv_cache_dtype"],
            f"{r['ppl']:.4f}",
            f"{r['ratio']:.4f}",
            f"{sum(a == tokens for a in r['agree'])}/{len(r['agree'])}",
            f"{sum(r['agree']) / len(r['agree']):.1f}",
            f"{min(r['agree'])}",
            f"{int(r['block_bytes']):,}",
        ]
        for r in rows
    ]
    header = [
        "KV cache",
        "perplexity",
        "ratio to float32",
        f"prompts agreeing all {tokens}",
        "mean tokens before divergence",
        "min",
        "bytes per block",
    ]
    return f"{name} ({rows[0]['scored']} tokens scored)\n" + render_table(header, body)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    p.add_argument("--kv-cache-dtypes", default=",".join(KV_DTYPES))
    p.add_argument("--window", type=int, default=512, help="tokens per scored prompt")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    args = p.parse_args(argv)
    from jpaged import models

    print(machine_line(machine_info()))
    for name in args.models.split(","):
        model = models.load(name, dtype="float32")
        rows = measure(
            model,
            args.kv_cache_dtypes.split(","),
            window=args.window,
            prompts=args.prompts,
            tokens=args.tokens,
        )
        print(table(name, rows, args.tokens), flush=True)


if __name__ == "__main__":
    main()
