"""Beam search on shared blocks vs the same beams without sharing: KV blocks held and tok/s.

    python -m benchmarks.bench_beam [--model smollm2-135m|PATH] [--prompts 4] [--width 4]
                                    [--prompt-tokens 256] [--new 64] [--no-write]

Workload: `--prompts` English prompts of `--prompt-tokens` tokens each (seeded
text), all submitted at once. Three ways to get `--width` continuations of each:

- beam search, paged: one request per prompt, `--width` beams sharing the
  prompt's blocks (forked copy-on-write, pruned beams freed at once);
- beam search, contiguous: the same search, each beam in a region of its own
  (a fork copies the whole parent region): the memory a cache that cannot share
  blocks pays for the same beams;
- `--width` independent greedy sequences per prompt (separate requests, prefix
  caching off): what the overview's "without sharing" column holds, at the
  step cost of as many rows as the beams.

Each configuration runs once untimed (every shape compiles) and once timed on
a fresh engine. Reported: peak KV blocks in use, the blocks the prompts alone
need, tokens generated per second of wall time (all rows of every step: beams
count each), and wall time.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import RESULTS, append_results, fmt, machine_info, render_table

HEADING = "## Beam search (issue 25)"
TEXT = (
    "The river wound through the valley, past the mill and the old stone bridge, where "
    "children gathered every evening to watch the boats come home. The miller's daughter "
    "kept a notebook of every boat, its colour, its cargo and the name painted on its bow, "
    "and by the end of the summer she had filled three books with careful lists. "
)


def prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each with its own opening."""
    out = []
    for i in range(count):
        ids = tokenizer.encode(f"Chapter {i + 1}. " + TEXT * (1 + 2 * length // len(TEXT)))
        out.append(list(ids[:length]))
    return out


def run(model: Any, batch: list[list[int]], how: str, width: int, new: int, block: int) -> dict:
    from jpaged import LLM, BeamSearchParams, SamplingParams

    longest = max(len(p) for p in batch) + new
    options: dict[str, Any] = dict(
        dtype="float32",
        block_size=block,
        max_seq_len=longest + block,
        max_batch_size=len(batch) * width,
        warmup=False,
        backend="contiguous" if how == "beam search, contiguous" else "paged",
        enable_prefix_caching=how != f"{width} greedy sequences",
    )
    beams = BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True)
    greedy = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

    def once(llm: Any) -> int:
        if how.startswith("beam"):
            out = llm.beam_search(batch, beams, use_tqdm=False)
            return sum(len(s.token_ids) for o in out for s in o.sequences)
        done = llm.generate([p for p in batch for _ in range(width)], greedy, use_tqdm=False)
        return sum(len(c.token_ids) for c in done)

    once(LLM(model, **options))  # compiles every shape the timed run needs
    llm = LLM(model, **options)
    start = time.perf_counter()
    tokens = once(llm)
    wall = time.perf_counter() - start
    s = llm.stats()
    return {
        "how": how,
        "peak_blocks": int(s["kv_blocks_used_peak"]),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": s["tokens_generated"] / wall,
        "steps": int(s["steps"]),
        "block_bytes": int(s["kv_block_bytes"]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a demo model's name or a path")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    from jpaged import models

    model = models.load(args.model, dtype="float32")
    info = machine_info()
    batch = prompts(model.tokenizer, args.prompts, args.prompt_tokens)
    w = args.width
    results = [
        run(model, batch, how, w, args.new, args.block_size)
        for how in ("beam search, paged", "beam search, contiguous", f"{w} greedy sequences")
    ]
    bs = args.block_size
    prompt_blocks = args.prompts * -(-args.prompt_tokens // bs)
    bound = prompt_blocks + args.prompts * w * (-(-args.new // bs) + 1)
    header = [
        "continuations of each prompt",
        "peak KV blocks",
        "blocks x prompt-only",
        "tokens",
        "wall s",
        "tok/s",
    ]
    rows = [
        [
            r["how"],
            fmt(r["peak_blocks"]),
            fmt(r["peak_blocks"] / prompt_blocks, ".2f"),
            fmt(r["tokens"]),
            fmt(r["wall_s"], ".2f"),
            fmt(r["tok_s"]),
        ]
        for r in results
    ]
    table = render_table(header, rows)
    paged, contiguous, independent = results
    notes = (
        f"{args.prompts} prompts x {args.prompt_tokens} tokens ({prompt_blocks} blocks of {bs} "
        f"alone), width {w}, {args.new} new tokens each. Paged beam search peaked at "
        f"{paged['peak_blocks']} blocks (the bound: prompts' blocks + {args.prompts} x {w} x "
        f"(generated blocks + 1) = {bound}: {'met' if paged['peak_blocks'] <= bound else 'MISSED'}"
        f"); {independent['peak_blocks'] / paged['peak_blocks']:.2f}x fewer than {w} "
        f"independent sequences, {contiguous['peak_blocks'] / paged['peak_blocks']:.2f}x fewer "
        f"than the contiguous regions. Beam search runs at "
        f"{paged['tok_s'] / independent['tok_s']:.2f}x the tok/s of {w} greedy sequences."
    )
    print(table)
    print(notes)
    if args.no_write:
        return
    c = model.config
    run_text = "\n".join(
        [
            f"### {info['date']}: {args.prompts} prompts x {args.prompt_tokens} tokens, width {w}, "
            f"{args.new} new tokens",
            "",
            f"- command: `{info['command']}`",
            f"- machine: {info['nproc']} x {info['cpu']}, JAX {info['jax']} ({info['backend']})",
            f"- model: {args.model} ({c.num_layers} layers, hidden {c.hidden_size}, vocab "
            f"{c.vocab_size}), float32, block_size {bs}",
            "",
            table,
            "",
            notes,
            "",
        ]
    )
    append_results(HEADING, run_text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
