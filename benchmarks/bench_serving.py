"""Serving benchmark: paged vs contiguous KV cache at the same KV memory.

    python -m benchmarks.bench_serving --model bench --backend both
    python -m benchmarks.bench_serving --model bench --backend both --workload poisson --rate 2
    python -m benchmarks.bench_serving --model bench --backend both --through-server
    python -m benchmarks.bench_serving --replot benchmarks/results/serving_paged_attention.json
    python -m benchmarks.bench_serving --decode-profile     # the decode step alone
    python -m benchmarks.bench_serving --model PATH --pool-scan 1024,16384   # step time vs pool
    python -m benchmarks.bench_serving --model gemma-3-270m --backend paged \
        --workload long_prompts --hybrid-kv-cache both --max-seq-len 8192   # KV groups
    python -m benchmarks.bench_serving --model smollm2-135m --backend paged \
        --workload repetitive --paged-batch-sizes 1,4 --speculative-ngram 4   # on vs off
    python -m benchmarks.bench_serving --model smollm2-135m --backend paged \
        --lora-adapters 4 --lora-rank 16   # requests over 4 adapters vs the base model

The matched-memory protocol (issue 5): the contiguous backend reserves
`--contiguous-batch-size` (8) slots of `--max-seq-len` (4096) tokens; each paged
configuration gets exactly the same KV bytes (`num_blocks = 8*4096/block_size`)
and a larger `max_batch_size` (`--paged-batch-sizes`, default 24 and 48). Every
configuration prints the KV bytes it allocated.

In process (default), each configuration gets a fresh Engine that is warmed up
before the clock starts, then serves the workload `--repeat` times (default 1),
measured, the configurations taking turns so that a shared machine's load drifts
hit them alike (later rounds use fresh prompt ids; the median-throughput pass is
reported). Requests are added at their arrival times and the engine is stepped
until all finish; after every step `engine.stats()` is sampled (running sequences, KV blocks,
utilization), and that sampling cost is measured and reported. With
`--through-server`, each configuration is a real `python -m server` subprocess
on 127.0.0.1 driven by concurrent httpx SSE clients, and `/metrics` is polled
for the timeline.

Warm-up (`--warmup`), always off the clock:
- `workload` (default): one unmeasured pass of the same workload with fresh
  prompt ids (so the paged prefix cache has nothing to reuse), which compiles the
  shape buckets it uses; the measured pass must compile nothing (checked, reported
  as "compilations after warm-up"; over HTTP or with Poisson arrivals, timing can
  form a batch the warm-up pass did not, and it shows there).
- `engine`: `EngineConfig.warmup`, which compiles and runs every token bucket the
  runner lists (12 step programs at the default 512-token budget, plus the sampler
  variants). Each XLA:CPU step program holds ~140 memory mappings, and Linux's
  vm.max_map_count (65530) caps a process's; `build_engine` refuses up front what
  would not fit. Natural with `--through-server` (a process each).

Prints one markdown table, writes the raw numbers as JSON and a PNG plot
(running sequences and KV blocks used over time, throughput bars). The table and
JSON carry the engine's own split of a step over the measured pass: ms per step in
all, on the device (dispatch, compute, results back) and on the host (the rest).
A step time breakdown follows, from the growth of the engine's counters over the
pass (`engine.stats()`, or `/metrics` through the server): scheduling, host batch
building, device, the rest; rows per decode-only call, real / padded tokens of the
buckets the calls ran in, and (in process) the commonest decode-only buckets.

The parts live in `benchmarks/serving/` (configs, the two drivers, the shared
per-pass result, the report, the pool scan and the decode profile).

On a GPU: `--model` takes a Hugging Face checkpoint directory (or, in process, a
`.gguf`) and `--dtype` defaults to auto (bfloat16 there, float32 on a CPU). With
`--backend paged` the contiguous batch size only sizes the pool; 256 rows on the seed
burst as issue 10 measured them (a 256 x 1024-token pool, one workload warm-up pass):
    python -m benchmarks.bench_serving --model PATH --dtype bfloat16 --backend paged \
        --paged-batch-sizes 256 --contiguous-batch-size 256 --max-seq-len 1024 \
        --num-requests 256 --max-num-batched-tokens 2048
The vm.max_map_count guard of `--warmup engine` applies to XLA:CPU only.

`--pool-scan 1024,16384` instead times the same requests (`--scan-requests` 32 prompts
of `--scan-prompt-len` 100 random ids, `--scan-max-tokens` 64 new tokens each, greedy,
EOS ignored, prefix caching off, all decoding together) on a paged pool of each size: a
warm pass, then a timed pass whose ms/step (every step of it, the few prefill steps
included) is printed per size with the ratio largest / smallest; a pool that is copied
each step instead of updated in place makes the step time grow with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import workloads
from benchmarks.common import machine_info, machine_line
from benchmarks.serving import BENCH_DIR, RESULTS_DIR
from benchmarks.serving.configs import (
    kv_variants,
    lora_variants,
    matched_configs,
    model_shape,
    speculative_variants,
)
from benchmarks.serving.decode_profile import decode_profile
from benchmarks.serving.in_process import InProcessTarget
from benchmarks.serving.measure import Target, run_interleaved
from benchmarks.serving.over_http import ServerTarget
from benchmarks.serving.pool_scan import pool_scan_main
from benchmarks.serving.report import ratios, show
from jpaged.config import ACTIVATIONS
from jpaged.dtypes import DTYPE_NAMES, KV_CACHE_DTYPES, concrete_dtype
from jpaged.engine.speculative import from_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="bench",
        help="Hugging Face checkpoint directory (in process also a .gguf file), or 'bench' "
        "for the cached ~57M random Llama",
    )
    p.add_argument("--backend", choices=("paged", "contiguous", "both"), default="both")
    p.add_argument("--workload", choices=sorted(workloads.WORKLOADS), default="paged_attention")
    p.add_argument("--num-requests", type=int, help="default: 48 for every workload")
    p.add_argument("--rate", type=float, default=2.0, help="poisson: requests per second")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--through-server",
        action="store_true",
        help="drive a real `python -m server` over HTTP/SSE instead of the engine",
    )
    p.add_argument("--contiguous-batch-size", type=int, default=8)
    p.add_argument(
        "--paged-batch-sizes",
        default="24,48",
        help="comma-separated max_batch_size values for the paged runs",
    )
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="auto",
        help="weights and KV cache; auto = bfloat16 on a GPU, float32 elsewhere (bfloat16 "
        "matmuls are slow on XLA's CPU backend)",
    )
    p.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default="float",
        help="what quantized weights multiply (models.load's: int8 = llama.cpp's numerics)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (vLLM's default)")
    p.add_argument(
        "--warmup",
        choices=("workload", "engine"),
        default="workload",
        help="workload: an unmeasured pass of the workload (compiles the buckets it uses); "
        "engine: the engine's own warm-up (compiles and runs every bucket)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="JSON of raw numbers (default benchmarks/results/serving_<workload>.json)",
    )
    p.add_argument(
        "--plot", type=Path, help="PNG (default benchmarks/serving_<workload>.png); 'none' to skip"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measured passes per configuration, interleaved across them; the "
        "median-throughput pass is reported, every pass is kept in the JSON",
    )
    p.add_argument(
        "--pool-scan",
        metavar="BLOCKS",
        help="comma-separated paged pool sizes (usable blocks, e.g. 1024,16384): time the same "
        "requests at each instead of comparing backends",
    )
    p.add_argument("--scan-requests", type=int, default=32, help="pool scan: requests (= rows)")
    p.add_argument("--scan-prompt-len", type=int, default=100, help="pool scan: prompt tokens")
    p.add_argument("--scan-max-tokens", type=int, default=64, help="pool scan: new tokens")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="split the model over the first N devices (on a CPU, fake ones: "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        help="N replicas of the model behind a router, replica i on devices [i * tp, (i + 1) "
        "* tp); each configuration's pool sizes each replica's",
    )
    p.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma-separated: each paged configuration also runs with these 1-byte KV caches "
        "(int8, fp8_e4m3, fp8_e5m2), its pool the same bytes as the model-dtype one's",
    )
    p.add_argument(
        "--hybrid-kv-cache",
        choices=("on", "off", "both"),
        default="on",
        help="sliding-window layers (Gemma 3) keep only their window (on), every layer the "
        "whole context (off), or each paged configuration both ways, same bytes",
    )
    p.add_argument(
        "--speculative-ngram",
        metavar="K",
        type=int,
        help="each configuration also runs with n-gram speculative decoding of up "
        "to K draft tokens (label ngramK), interleaved with it off",
    )
    p.add_argument(
        "--prompt-lookup-min",
        metavar="N",
        type=int,
        help="--speculative-ngram: shortest n-gram (vLLM's default: 5)",
    )
    p.add_argument(
        "--prompt-lookup-max",
        metavar="N",
        type=int,
        help="--speculative-ngram: longest n-gram (vLLM's default: 5)",
    )
    p.add_argument(
        "--lora-adapters",
        metavar="N",
        type=int,
        default=0,
        help="in process: each configuration also runs with N random LoRA adapters resident "
        "(every projection), requests spread over them round-robin (label loraNxrR)",
    )
    p.add_argument("--lora-rank", metavar="R", type=int, default=16, help="--lora-adapters' rank")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    from benchmarks import bench_model

    args.dtype = concrete_dtype(args.dtype)  # once: configs, servers and the report agree
    if args.pool_scan:
        return pool_scan_main(args)
    paged_batches = tuple(int(b) for b in args.paged_batch_sizes.split(",") if b)
    configs = matched_configs(
        args.backend,
        contiguous_batch=args.contiguous_batch_size,
        paged_batches=paged_batches,
        max_seq_len=args.max_seq_len,
        block_size=args.block_size,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel=args.tensor_parallel,
        data_parallel=args.data_parallel,
    )
    model_path = bench_model.resolve(args.model)
    model: Any = None
    if args.through_server:
        if not (model_path / "config.json").is_file():  # sizes the pool and the vocab
            parser.error(f"--through-server needs a checkpoint directory: {model_path}")
        vocab = json.loads((model_path / "config.json").read_text()).get("vocab_size", 32000)
    else:
        from jpaged import models

        # a directory or a .gguf, straight into its shards
        model = models.load(
            model_path,
            dtype=args.dtype,
            tensor_parallel=args.tensor_parallel,
            activations=args.activations,
        )
        vocab = model.config.vocab_size
    kv_dtypes = tuple(k for k in args.kv_cache_dtypes.split(",") if k)
    if set(kv_dtypes) - set(KV_CACHE_DTYPES):
        parser.error(f"--kv-cache-dtypes: each of {list(KV_CACHE_DTYPES)}")
    hybrid = {"on": (True,), "off": (False,), "both": (True, False)}[args.hybrid_kv_cache]
    c = model.config if model is not None else None
    shape = model_shape(model_path) if c is None else (c.num_layers, c.num_kv_heads, c.head_dim)
    configs = kv_variants(configs, kv_dtypes, shape, hybrid)
    try:
        spec = from_flags(args.speculative_ngram, args.prompt_lookup_min, args.prompt_lookup_max)
        configs = speculative_variants(configs, spec)
        if args.lora_adapters and args.through_server:
            raise ValueError("--lora-adapters: in process only (not with --through-server)")
        configs = lora_variants(configs, args.lora_adapters, args.lora_rank)
        for cfg in configs:
            cfg.engine_config()  # a bad flag fails now, not after a warm-up
        workload = workloads.make(
            args.workload,
            args.num_requests,
            seed=args.seed,
            vocab_size=vocab,
            max_seq_len=args.max_seq_len,
            rate=args.rate,
            tokenizer=None if model is None else model.tokenizer,
        )
    except ValueError as exc:
        parser.error(str(exc))
    info = machine_info()
    print(machine_line(info))
    print(f"model: {model_path} ({args.dtype}); workload: {workload.description}")
    progress = not args.no_progress
    targets: list[Target]
    if args.through_server:
        targets = [
            ServerTarget(
                model_path, cfg, warmup=args.warmup, temperature=args.temperature, progress=progress
            )
            for cfg in configs
        ]
    else:
        targets = [
            InProcessTarget(
                model, cfg, warmup=args.warmup, temperature=args.temperature, progress=progress
            )
            for cfg in configs
        ]
    runs = run_interleaved(targets, workload, args.repeat, vocab_size=vocab)
    mode = "server" if args.through_server else "in-process"
    report = {
        "machine": info,
        "model": str(model_path),
        "workload": workload.summary(),
        "mode": mode,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "repeat": args.repeat,
        "runs": runs,
        "ratios": ratios(runs),
    }
    suffix = f"{args.workload}{'_server' if args.through_server else ''}"
    out = args.out or RESULTS_DIR / f"serving_{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in runs:  # 4 decimals are plenty for a plot, and halve the file
        r["timeline"] = {k: [round(float(v), 4) for v in vs] for k, vs in r["timeline"].items()}
    out.write_text(json.dumps(report, indent=1, default=float))
    png = args.plot or BENCH_DIR / f"serving_{suffix}.png"
    if str(png).lower() == "none":
        png = None
    show(report, png)
    print(f"raw numbers: {out}")
    return report


def replot(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.bench_serving --replot JSON [PNG]`: table and plot again."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving --replot")
    p.add_argument("json", type=Path)
    p.add_argument("png", type=Path, nargs="?")
    args = p.parse_args(argv)
    show(json.loads(args.json.read_text()), args.png or BENCH_DIR / f"{args.json.stem}.png")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--replot"]:
        replot(sys.argv[2:])
    elif sys.argv[1:2] == ["--decode-profile"]:
        decode_profile(sys.argv[2:])
    else:
        main()
