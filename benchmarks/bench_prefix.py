"""Automatic prefix caching: many requests sharing one long system prompt, caching on vs off.

    python -m benchmarks.bench_prefix [--model small|bench|PATH] [--requests 100] [--no-write]

Workload (seeded token ids, greedy, `ignore_eos`): `--requests` requests made of
one shared `--system`-token system prompt followed by a distinct `--user`-token
user part each, `--new` new tokens each, all submitted at once through
`LLM.generate`. The same workload runs on two engines that differ only in
`enable_prefix_caching`; each first runs it once untimed (so every shape it
needs is compiled), then once timed. Reported per engine: KV blocks in use at
the peak, wall time of the timed run, time to first token p50/p90 (from
submission), prompt tokens actually prefilled, and the outputs' equality.

Targets (issue 6): peak blocks with caching <= 1.2 x the system prompt's blocks
+ the distinct blocks (each request's user part and generated tokens, all
requests being in flight at once here), and TTFT p50 improving >= 3x.

`--model small` (the default) is a 4-layer, hidden-256 Llama (8 heads / 2 KV
heads, head_dim 32, vocab 32000, ~19M parameters, random weights) written next
to the bench model with its tokenizer; `bench` is the 57M bench model
(`benchmarks/bench_model.py`), slower on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import bench_model
from benchmarks.common import RESULTS, append_results

HEADING = "## Prefix caching (issue 6)"
SMALL_CONFIG = {
    **bench_model.CONFIG,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
FIRST_ID = 16  # below this, ids may be special tokens


def small_model_path() -> Path:
    """The small bench Llama: random weights, the bench model's tokenizer (written once)."""
    path = bench_model.cache_root() / f"bench-prefix-small-v{bench_model.VERSION}"
    if (path / "model.safetensors").exists():
        return path
    from safetensors.numpy import save_file

    source = bench_model.ensure()

    def write(tmp: Path) -> None:
        save_file(
            bench_model.random_weights(SMALL_CONFIG),
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(SMALL_CONFIG, indent=2))
        for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, tmp / name)

    return bench_model.publish(path, write)


def workload(
    num_requests: int, system: int, user: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(FIRST_ID, vocab, system).tolist()
    return [shared + rng.integers(FIRST_ID, vocab, user).tolist() for _ in range(num_requests)]


def run(model: Any, prompts: list[list[int]], new: int, caching: bool, block: int) -> dict:
    from jpaged import LLM, SamplingParams

    longest = max(len(p) for p in prompts) + new
    # Room for every request at once without sharing, so both engines run the same
    # schedule and caching changes only what is computed and stored.
    blocks = len(prompts) * -(-longest // block)
    options: dict[str, Any] = dict(
        dtype="float32",
        block_size=block,
        max_seq_len=longest,
        max_batch_size=max(len(prompts), 1),
        num_blocks=int(blocks / 0.75) + 1,  # admission keeps 20% in reserve
        enable_prefix_caching=caching,
        warmup=False,
    )
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm = LLM(model, **options)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)  # compiles every shape it needs
    warm_s = time.perf_counter() - start
    del llm
    # A fresh engine for the timed run: same shapes, so its programs come from the jit cache.
    llm = LLM(model, **options)
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    total_s = time.perf_counter() - start
    s = llm.stats()
    ttft = sorted(c.ttft_s for c in out if c.ttft_s is not None)
    return {
        "caching": caching,
        "warm_s": warm_s,
        "total_s": total_s,
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "peak_blocks": int(s["kv_blocks_used_peak"]),
        "prefilled": int(s["kv_prefix_cache_queries"] - s["kv_prefix_cache_hits"])
        if caching
        else sum(len(p) for p in prompts),
        "hit_rate": s["kv_prefix_cache_hit_rate"],
        "new_compilations": int(s["compilations"]),
        "device_s": s["device_s"],
        "tokens": [c.token_ids for c in out],
    }


def machine() -> dict[str, str]:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "cpu": f"{os.cpu_count()} x {cpu}",
        "jax": f"{jax.__version__} ({jax.default_backend()})",
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "date": datetime.date.today().isoformat(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="small | bench | a checkpoint dir")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--system", type=int, default=1024, help="shared prompt tokens")
    parser.add_argument("--user", type=int, default=64, help="distinct prompt tokens each")
    parser.add_argument("--new", type=int, default=64, help="new tokens each")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    from jpaged import models

    path = small_model_path() if args.model == "small" else bench_model.resolve(args.model)
    model = models.load(str(path), dtype="float32")
    info = machine()
    print(f"# {info['cpu']} | JAX {info['jax']} | load {info['load']} | model {path.name}")
    prompts = workload(args.requests, args.system, args.user, model.config.vocab_size)
    results = [run(model, prompts, args.new, c, args.block_size) for c in (False, True)]
    off, on = results
    bs = args.block_size
    system_blocks = args.system // bs
    per_request = -(-(args.user + args.new - 1) // bs)  # user part + computed new tokens
    target = 1.2 * system_blocks + args.requests * per_request
    rows = [
        "| prefix caching | peak KV blocks | total s | TTFT p50 s | TTFT p90 s "
        "| prompt tokens prefilled | hit rate |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        rows.append(
            f"| {'on' if r['caching'] else 'off'} | {r['peak_blocks']} | {r['total_s']:.1f} | "
            f"{r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {r['prefilled']} | "
            f"{r['hit_rate']:.1%} |"
        )
    same = on["tokens"] == off["tokens"]
    notes = (
        f"Peak blocks with caching: {on['peak_blocks']} vs the target 1.2 x {system_blocks} "
        f"(system prompt) + {args.requests} x {per_request} (user part + generated tokens) = "
        f"{target:.0f}: {'met' if on['peak_blocks'] <= target else 'MISSED'}; without "
        f"caching {off['peak_blocks']} ({off['peak_blocks'] / on['peak_blocks']:.1f}x). "
        f"TTFT p50 improves {off['ttft_p50'] / on['ttft_p50']:.1f}x (target >= 3x), total "
        f"time {off['total_s'] / on['total_s']:.1f}x. Greedy outputs with caching on == off: "
        f"{same}. Compilations during the timed runs: {off['new_compilations']} / "
        f"{on['new_compilations']} (each engine ran the workload once untimed first)."
    )
    print("\n".join(rows))
    print(notes)
    if not args.no_write:
        write_results(rows, notes, info, args, path.name, model.config)
        print(f"wrote {RESULTS}")


def write_results(
    rows: list[str], notes: str, info: dict, args: argparse.Namespace, name: str, config: Any
) -> None:
    """Append this run under the section's heading (a new section at the end if none)."""
    c = config
    run_text = "\n".join(
        [
            f"### {info['date']}: {args.requests} requests, {args.system}-token shared "
            f"prompt + {args.user} distinct, {args.new} new",
            "",
            f"- command: `python -m benchmarks.bench_prefix --model {args.model}`",
            f"- machine: {info['cpu']}, JAX {info['jax']}, load average at start {info['load']}",
            f"- model: `{name}` (Llama, {c.num_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_heads} heads / {c.num_kv_heads} KV, vocab {c.vocab_size}), float32, "
            f"block_size {args.block_size}, max_batch_size {args.requests}, greedy, "
            "max_num_batched_tokens 512 (default)",
            "",
            *rows,
            "",
            notes,
            "",
        ]
    )
    append_results(HEADING, run_text)


if __name__ == "__main__":
    main()
