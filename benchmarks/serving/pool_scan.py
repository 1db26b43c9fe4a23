"""`--pool-scan B1,B2,...`: the same requests on a paged pool of each size; a pool that is
copied each step instead of updated in place makes the step time grow with it."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from benchmarks.common import build_engine, fmt, machine_info, machine_line, render_table
from benchmarks.serving import RESULTS_DIR
from benchmarks.serving.measure import per_step_ms


def pool_scan(
    model: Any,
    pool_sizes: list[int],
    *,
    dtype: str,
    num_requests: int = 32,
    prompt_len: int = 100,
    max_tokens: int = 64,
    block_size: int = 16,
    max_seq_len: int = 4096,
    max_num_batched_tokens: int = 512,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The same requests on a paged pool of each size (usable blocks): all rows decode
    together, greedy, EOS ignored, prefix caching off (a warm pass would fill it); a warm
    pass compiles, the timed pass is reported from the engine's own step counters."""
    from jpaged.cache.kv_pool import block_bytes
    from jpaged.config import EngineConfig
    from jpaged.engine.interface import PromptRequest
    from jpaged.engine.sampling import SamplingParams

    c = model.config
    rng = np.random.default_rng(seed)
    # ids of ordinary tokens: low ids are often specials, and big vocabularies are sparse there
    prompts = rng.integers(3, min(c.vocab_size, 3000), (num_requests, prompt_len)).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def serve_all(engine: Any) -> int:
        for prompt in prompts:
            engine.add(engine.prepare(PromptRequest(prompt, params)))
        tokens = 0
        while engine.has_unfinished():
            tokens += sum(len(out.token_ids) for out in engine.step())
        return tokens

    runs = []
    for blocks in pool_sizes:
        config = EngineConfig(
            backend="paged",
            max_batch_size=num_requests,
            max_seq_len=max_seq_len,
            block_size=block_size,
            num_blocks=blocks,
            dtype=dtype,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=False,
            max_waiting_requests=max(num_requests, 1),
        )
        engine = build_engine(model, config)
        serve_all(engine)  # warm pass: compiles the buckets the timed pass uses
        before, t = engine.stats(), time.perf_counter()
        tokens = serve_all(engine)
        wall_s, after = time.perf_counter() - t, engine.stats()
        d = {
            k: after[k] - before[k]
            for k in ("steps", "step_s", "device_s", "host_s", "compilations", "preemptions")
        }
        kv_bytes = (blocks + 1) * block_bytes(
            c.num_layers, c.num_kv_heads, block_size, c.head_dim, dtype
        )
        runs.append(
            {
                "num_blocks": blocks,
                "kv_bytes": kv_bytes,
                "steps": int(d["steps"]),
                "generated_tokens": tokens,
                "wall_s": wall_s,
                "output_tok_s": tokens / wall_s,
                "wall_ms_per_step": 1e3 * wall_s / max(d["steps"], 1),
                **per_step_ms(d["steps"], d["step_s"], d["device_s"], d["host_s"]),
                "compilations_in_run": int(d["compilations"]),
                "preemptions": int(d["preemptions"]),
            }
        )
        r = runs[-1]
        print(
            f"pool {blocks} blocks ({kv_bytes / 2**20:.0f} MiB): {r['steps']} steps, "
            f"{r['step_ms_mean']:.2f} ms/step (device {r['device_ms_per_step']:.2f}, "
            f"host {r['host_ms_per_step']:.2f})",
            flush=True,
        )
        del engine  # its pool goes before the next one is made
    return runs


SCAN_ROWS: list[tuple[str, str, str]] = [
    ("KV pool MiB", "kv_mib", ".0f"),
    ("steps (timed pass)", "steps", ""),
    ("engine ms/step", "step_ms_mean", ".2f"),
    ("device ms/step", "device_ms_per_step", ".2f"),
    ("host ms/step", "host_ms_per_step", ".2f"),
    ("wall ms/step", "wall_ms_per_step", ".2f"),
    ("output tok/s", "output_tok_s", ".0f"),
    ("compilations in timed pass", "compilations_in_run", ""),
    ("preemptions", "preemptions", ""),
]


def pool_scan_main(args: argparse.Namespace) -> dict[str, Any]:
    """`--pool-scan B1,B2,...`: print the scan's table and ratios; write its JSON."""
    from benchmarks import bench_model
    from jpaged import models

    if args.through_server:
        raise SystemExit("--pool-scan runs in process; leave out --through-server")
    sizes = sorted({int(b) for b in args.pool_scan.split(",") if b})
    model_path = bench_model.resolve(args.model)
    info = machine_info()
    print(machine_line(info))
    print(
        f"model: {model_path} ({args.dtype}); pool scan over {sizes} blocks of "
        f"{args.block_size}: {args.scan_requests} prompts x {args.scan_prompt_len} tokens, "
        f"{args.scan_max_tokens} new tokens each, greedy, prefix caching off"
    )
    model = models.load(model_path, dtype=args.dtype)
    runs = pool_scan(
        model,
        sizes,
        dtype=args.dtype,
        num_requests=args.scan_requests,
        prompt_len=args.scan_prompt_len,
        max_tokens=args.scan_max_tokens,
        block_size=args.block_size,
        max_seq_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    small, large = runs[0], runs[-1]
    ratio = {
        k: large[k] / small[k] if small[k] else float("nan")
        for k in ("step_ms_mean", "device_ms_per_step", "wall_ms_per_step")
    }
    report = {
        "machine": info,
        "model": str(model_path),
        "mode": "pool-scan",
        "dtype": args.dtype,
        "block_size": args.block_size,
        "requests": {
            "num_requests": args.scan_requests,
            "prompt_len": args.scan_prompt_len,
            "max_tokens": args.scan_max_tokens,
        },
        "runs": runs,
        "ratio_largest_to_smallest": ratio,
    }
    out = args.out or RESULTS_DIR / "pool_scan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    rows = [
        [
            name,
            *(fmt(r["kv_bytes"] / 2**20 if key == "kv_mib" else r[key], spec or "") for r in runs),
        ]
        for name, key, spec in SCAN_ROWS
    ]
    print(f"\n## pool scan ({args.dtype}, block {args.block_size})")
    print(render_table(["metric", *(f"{r['num_blocks']} blocks" for r in runs)], rows))
    x, dev, wall = (ratio[k] for k in ("step_ms_mean", "device_ms_per_step", "wall_ms_per_step"))
    print(
        f"\n{large['num_blocks']} / {small['num_blocks']} blocks: engine ms/step x{x:.2f} "
        f"(target <= 1.1: {'PASS' if x <= 1.1 else 'FAIL'}), device ms/step x{dev:.2f}, "
        f"wall ms/step x{wall:.2f}"
    )
    print(f"raw numbers: {out}")
    return report
