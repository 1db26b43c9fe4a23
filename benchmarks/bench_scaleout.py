"""Past one host: data-parallel replicas vs one engine, and what a model split over
processes exchanges per step.

    python -m benchmarks.bench_scaleout dp          # DP 2 vs 1, bench_serving's seed burst
    python -m benchmarks.bench_scaleout processes   # TP over 3 processes: bytes and host cost

`dp`: one process with 2 CPU devices (`--xla_force_host_platform_device_count=2`, set
here before JAX starts); an engine on device 0 with `--max-batch-size` sequences, and two
replicas (devices 0 and 1) of the demo model with half as many each, each warmed up by an
unmeasured pass; then they take turns `--repeat` times (a shared machine's drift hits
both alike). Output tokens/s of each and their ratio.

`processes`: SmolLM2-135M (9 heads, 3 KV heads) split 3 ways over 3 processes of one
device each (gloo), decoding `--requests` greedy requests. From process 0: the step
program's collectives (XLA's compiled text: what each device sends per step, by op and
shape, at a decode bucket and the prefill bucket), and the channel's broadcasts (count,
bytes and host time per step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "u16": 2, "s8": 1}


def run_burst(llm: Any, prompts: list, params: list) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def data_parallel(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    from benchmarks import workloads
    from jpaged import LLM, SamplingParams

    # the same sequences in flight in all: each of 2 replicas decodes half the batch
    llms = {
        dp: LLM(
            args.model,
            data_parallel=dp,
            max_batch_size=args.max_batch_size // dp,
            max_seq_len=1024,
            warmup=False,
        )
        for dp in (1, 2)
    }
    burst = workloads.make("paged_attention", vocab_size=llms[1].engine.model_config.vocab_size)
    reqs = burst.requests[: args.requests]
    prompts = [list(r.prompt_ids) for r in reqs]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in reqs]
    for llm in llms.values():  # warm-up: compiles what the burst uses
        llm.generate(prompts, params, use_tqdm=False)
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeat):
        for dp, llm in llms.items():
            rates[dp].append(run_burst(llm, prompts, params))
            print(f"data_parallel={dp}: {rates[dp][-1]:.1f} tok/s", flush=True)
    print(
        f"\n{len(reqs)} requests, {sum(r.max_tokens for r in reqs)} output tokens, "
        f"max_batch_size {args.max_batch_size} in all (split over the replicas)"
    )
    print("| data_parallel | output tok/s (best) | runs |")
    print("| --- | --- | --- |")
    for dp, r in rates.items():
        print(f"| {dp} | {max(r):.1f} | {', '.join(f'{x:.1f}' for x in r)} |")
    print(f"ratio DP 2 / DP 1: {max(rates[2]) / max(rates[1]):.3f}")


def collectives(text: str, layers: int) -> list[tuple[str, str, int, int]]:
    """(op, result shape, its bytes, times a step runs it) of each collective in XLA's
    text; those in a while loop's body (the layer loop) run `layers` times."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    out, current = [], ""
    pattern = re.compile(
        r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|reduce-scatter|"
        r"all-to-all|collective-permute)(?:-start)?\("
    )
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            current = head.group(1)
        m = pattern.search(line)
        if m:
            dtype, dims, op = m.groups()
            n = int(np.prod([int(d) for d in dims.split(",") if d]))
            out.append(
                (
                    op,
                    f"{dtype}[{dims}]",
                    n * BYTES.get(dtype, 4),
                    layers if current in bodies else 1,
                )
            )
    return out


def process_main(args: argparse.Namespace) -> None:
    """One of the `processes` benchmark's processes."""
    from jpaged.engine import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    from jpaged import LLM, EngineConfig, SamplingParams, models
    from jpaged.engine.programs import step_fn
    from jpaged.models import demo

    path, _ = demo.resolve(args.model)
    n = jax.device_count()
    opts: dict[str, Any] = dict(
        tensor_parallel=n,
        max_batch_size=args.max_batch_size,
        max_seq_len=512,
        warmup=False,
        dtype="float32",
    )
    model = models.load(path, "float32", n)
    if args.process_id:
        distributed.serve_worker(model, EngineConfig(**opts))
        return
    llm = LLM(model, **opts)
    assert isinstance(llm.engine, distributed.DriverEngine)
    r = llm.engine.runner
    programs = {}
    for tokens in (args.max_batch_size, r.token_ladder[-1]):
        shape = r.shape(tokens)
        # abstract: a real array would be broadcast to workers that expect no such thing
        packed = jax.ShapeDtypeStruct((shape.size(),), np.int32, sharding=r._replicated)
        lowered = step_fn.lower(
            r.state,
            r.kv,
            r.ring,
            packed,
            graphdef=r.graphdef,
            impl=r.impl,
            shape=shape,
            mesh=r.mesh,
            groups=r.groups,
        )
        text = lowered.compile().as_text() or ""
        programs[tokens] = (shape.size() * 4, collectives(text, r.model_config.num_layers))
    prompts = [[1 + (7 * i + j) % 1000 for j in range(32)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compiles
    before = llm.stats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.stats()
    delta = {
        k: after[k] - before[k]
        for k in (
            "steps",
            "broadcasts",
            "broadcast_bytes",
            "broadcast_s",
            "step_s",
            "tokens_generated",
        )
    }
    print(
        json.dumps({"processes": n, "programs": programs, "delta": delta, "wall_s": wall}),
        flush=True,
    )


def processes(args: argparse.Namespace) -> None:
    socks = [socket.socket() for _ in range(1)]
    socks[0].bind(("127.0.0.1", 0))
    port = socks[0].getsockname()[1]
    socks[0].close()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    base = [
        sys.executable,
        "-m",
        "benchmarks.bench_scaleout",
        "process",
        "--model",
        args.model,
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(args.num_processes),
        "--requests",
        str(args.requests),
        "--max-tokens",
        str(args.max_tokens),
        "--max-batch-size",
        str(args.max_batch_size),
    ]
    procs = [
        subprocess.Popen(
            [*base, "--process-id", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(args.num_processes)
    ]
    out, _ = procs[0].communicate(timeout=1800)
    for p in procs[1:]:
        p.wait(60)
    result = json.loads(out.strip().splitlines()[-1])
    print(f"TP {result['processes']} over {result['processes']} processes (gloo), {args.model}")
    print(
        "| step bucket (tokens) | packed input bytes | collectives a step runs (result "
        "shapes) | their result bytes per device |"
    )
    print("| --- | --- | --- | --- |")
    for tokens, (packed, colls) in result["programs"].items():
        listing = ", ".join(f"{times} x {op} {shape}" for op, shape, _, times in colls)
        total = sum(b * times for _, _, b, times in colls)
        print(f"| {tokens} | {packed:,} | {listing} | {total:,} |")
    d = result["delta"]
    steps = d["steps"]
    rate = d["tokens_generated"] / result["wall_s"]
    step_ms, host_ms = 1e3 * d["step_s"] / steps, 1e3 * d["broadcast_s"] / steps
    print(
        f"\n{args.requests} requests x {args.max_tokens} tokens: {steps:.0f} steps, "
        f"{rate:.1f} tok/s, step {step_ms:.1f} ms; broadcasts per step "
        f"{d['broadcasts'] / steps:.1f}, {d['broadcast_bytes'] / steps:,.0f} bytes, host "
        f"{host_ms:.2f} ms per step"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["dp", "processes", "process"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=48)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--num-processes", type=int, default=3)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--coordinator", default="")
    args = p.parse_args(argv)
    {"dp": data_parallel, "processes": processes, "process": process_main}[args.what](args)


if __name__ == "__main__":
    main()
