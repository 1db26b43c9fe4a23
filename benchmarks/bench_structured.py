"""Structured outputs: a burst with half the requests under a JSON schema vs none.

    python -m benchmarks.bench_structured --num-requests 32 --max-tokens 96
    python -m benchmarks.bench_structured --seed-burst      # the serving benchmark's burst

One engine (the demo model, SmolLM2), warmed up by an unmeasured pass of each
workload; then the two workloads take turns `--repeat` times (a shared machine's
drift hits both alike). Reports output tokens/s of each, their ratio, and the host
time spent filling grammar masks (`mask_s` in the engine's counters) per step.
`--seed-burst`: the requests of `bench_serving`'s seed burst (48 at once, prompts of
128-384 token ids, 128-256 new tokens) instead of `--num-requests` chat prompts.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks import workloads as workloads_mod
from jpaged.engine.llm import LLM
from jpaged.engine.sampling import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict[str, float]:
    before = llm.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    steps = after["steps"] - before["steps"]
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "steps": steps,
        "mask_ms_per_step": 1e3 * (after["mask_s"] - before["mask_s"]) / steps,
        "host_ms_per_step": 1e3 * (after["host_s"] - before["host_s"]) / steps,
        "step_ms": 1e3 * (after["step_s"] - before["step_s"]) / steps,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument(
        "--seed-burst",
        action="store_true",
        help="bench_serving's seed burst (48 requests) instead of chat prompts",
    )
    args = p.parse_args(argv)
    llm = LLM(
        args.model,
        max_batch_size=args.max_batch_size,
        max_seq_len=1024,
        warmup=False,
        async_scheduling=not args.no_async_scheduling,
    )
    prompts: list[Any]
    if args.seed_burst:
        burst = workloads_mod.make("paged_attention", vocab_size=llm.engine.model_config.vocab_size)
        prompts = [list(r.prompt_ids) for r in burst.requests]
        max_tokens = [r.max_tokens for r in burst.requests]
    else:
        prompts = [
            f"<|im_start|>user\nDescribe person {i} in JSON.<|im_end|>\n<|im_start|>assistant\n"
            for i in range(args.num_requests)
        ]
        max_tokens = [args.max_tokens] * len(prompts)
    # the same lengths either way: EOS ignored, so both workloads decode max_tokens a request
    free = [
        SamplingParams(max_tokens=n, temperature=0.7, seed=0, ignore_eos=True) for n in max_tokens
    ]
    spec = StructuredOutputsParams(json=SCHEMA)
    constrained = [
        SamplingParams(**{**vars(f), "ignore_eos": False, "structured": spec}) for f in free
    ]
    workloads = {
        "none": free,
        "half_json": [
            c if i % 2 else f for i, (f, c) in enumerate(zip(free, constrained, strict=True))
        ],
    }
    for params in workloads.values():  # warm-up: compiles what the workload uses
        llm.generate(prompts, params, use_tqdm=False)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in workloads}
    for _ in range(args.repeat):
        for name, params in workloads.items():
            results[name].append(run(llm, prompts, params))
    best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in results.items()}
    print("| workload | output tok/s | tokens | steps | step ms | host ms/step | mask ms/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in best.items():
        print(
            f"| {name} | {r['tok_s']:.1f} | {r['tokens']} | {r['steps']:.0f} | "
            f"{r['step_ms']:.1f} | {r['host_ms_per_step']:.2f} | {r['mask_ms_per_step']:.3f} |"
        )
    print(f"ratio half_json / none: {best['half_json']['tok_s'] / best['none']['tok_s']:.3f}")
    return {"results": results, "args": vars(args)}


if __name__ == "__main__":
    main()
