"""Where a decode step's time goes at one to a few users: the device's programs vs the host.

    python -m benchmarks.profile_step                        # SmolLM2 (its GGUF), N = 1 and 4
    python -m benchmarks.profile_step --users 1,4,16 --quantization none
    python -m benchmarks.profile_step --users 4 --lora-ranks 0,8,16,64   # LoRA's cost per rank

For each N, N requests (`--prompt-tokens` each, 32 by default: the context the decode steps'
attention reads; greedy, EOS ignored) are prefilled, then
`--steps` decode steps are timed twice on the same engine state:
- as served: `Engine.step` in a loop (async scheduling: the host's work on step k's
  results overlaps the device's step k + 1), the wall time per step, split by the
  engine's own counters into scheduling, batch building, dispatch and waiting for the
  device, and the rest (outputs: detokenizing, stop checks, the request outputs);
- device alone: every device program of a step blocked on as it is dispatched, so the
  runner's device time is its programs' (step and sampler) run time plus their dispatch.
The host time between two device steps, the device's idle time, is the difference:
served wall per step minus the device-alone time per step (issue 36's target: under 10%
of the step at N = 1). With `--lora-ranks`, each N also runs with 4 random LoRA adapters of
each rank resident (0: none), the requests spread over them. Prints a table; `--write`
appends it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jax

from benchmarks.common import loadavg, machine_info, machine_line, render_table
from benchmarks.host_path import PARTS, decode_pass
from jpaged.engine import heap

PROMPT_TOKENS = 32
PREFILL_TOKENS = 2048  # the most prompt tokens a prefill step takes
ADAPTERS = 4  # --lora-ranks: adapters resident


def profile(
    model: Any,
    users: int,
    steps: int,
    rank: int = 0,
    dtype: str = "float32",
    impl: str = "auto",
    num_blocks: int | None = None,
    prompt_tokens: int = PROMPT_TOKENS,
    kv_cache_dtype: str = "auto",
) -> dict[str, dict[str, float]]:
    """One N: served, then device alone (same engine, fresh requests of the same shape);
    `rank` > 0: 4 random LoRA adapters of that rank resident, requests spread over them."""
    import tempfile
    from pathlib import Path

    from benchmarks.common import build_engine
    from benchmarks.serving.in_process import random_adapters
    from jpaged.config import EngineConfig

    config = EngineConfig(
        max_batch_size=max(users, 4),
        max_seq_len=prompt_tokens + steps + 64,
        max_num_batched_tokens=min(max(users * prompt_tokens, 64), PREFILL_TOKENS),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        attention_impl=impl,
        num_blocks=num_blocks,
        lora={"max_loras": ADAPTERS, "max_lora_rank": rank} if rank else None,
    )
    engine = build_engine(model, config)
    with tempfile.TemporaryDirectory() as root:
        loras = []
        for request in random_adapters(model.config, ADAPTERS if rank else 0, rank, Path(root)):
            engine.register_lora(request)
            loras.append(request.lora_name)
        return measure(engine, users, steps, prompt_tokens, loras)


def measure(
    engine: Any, users: int, steps: int, prompt_tokens: int, loras: list[str] | None = None
) -> dict[str, dict[str, float]]:
    """`users` decoding on `engine`: a pass that compiles, then one served and one with the
    device alone (`profile`'s two passes)."""
    decode = functools.partial(
        decode_pass, engine, users, steps, loras=loras or [], prompt_tokens=prompt_tokens
    )
    decode(seed=0)  # compiles what the measured passes run
    runner = engine.runner
    counted = runner._counted

    def blocking(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return jax.block_until_ready(counted(fn, *args, **kwargs))

    with heap.settled():  # as the server runs (a full collection took ~370 ms a pass)
        served = decode(seed=1)
        runner._counted = blocking
        try:
            alone = decode(seed=2)
        finally:
            runner._counted = counted
    return {"served": served, "alone": alone}


def main(argv: list[str] | None = None) -> list[list[str]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="smollm2-135m", help="a demo model's name, or a path")
    p.add_argument("--users", default="1,4", help="comma-separated N")
    p.add_argument("--steps", type=int, default=48, help="decode steps timed per pass")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="each request's")
    p.add_argument("--quantization", default="auto", help="models.load's (QUANTIZATIONS)")
    p.add_argument("--activations", default="float", help="models.load's (ACTIVATIONS)")
    p.add_argument("--dtype", default="auto", help="weights, KV (auto: bfloat16 on a GPU)")
    p.add_argument("--attention-impl", default="auto", help="EngineConfig's (auto, xla, pallas)")
    p.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig's (auto, int8, fp8_*)")
    p.add_argument("--num-blocks", type=int, help="KV pool blocks (default: EngineConfig's)")
    p.add_argument("--lora-ranks", default="0", help="comma-separated LoRA ranks (0: none)")
    p.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    args = p.parse_args(argv)
    from benchmarks import bench_model, common
    from jpaged import models

    path = bench_model.resolve(args.model)
    from jpaged.dtypes import concrete_dtype

    dtype = concrete_dtype(args.dtype)
    model = models.load(
        path, dtype=dtype, quantization=args.quantization, activations=args.activations
    )
    info = machine_info()
    print(machine_line(info))
    load0 = loadavg()
    rows = []
    ranks = [int(r) for r in args.lora_ranks.split(",")]
    for users in (int(n) for n in args.users.split(",")):
        for rank in ranks:
            r = profile(
                model, users, args.steps, rank, dtype, args.attention_impl, args.num_blocks,
                args.prompt_tokens, args.kv_cache_dtype,
            )  # fmt: skip
            served, alone = r["served"], r["alone"]
            # blocked on, a step's programs' dispatch and run time is the runner's device time
            wall, device = 1e3 * served["wall_s"], 1e3 * alone["device_s"]
            ms = {k: 1e3 * served[k] for k in PARTS}
            rest = 1e3 * served["step_s"] - sum(ms.values())
            idle = max(wall - device, 0.0)
            rows.append([
                str(users), str(rank), f"{wall:.1f}", f"{device:.1f}", f"{idle:.1f}",
                f"{idle / wall:.1%}", f"{ms['schedule_s']:.2f}", f"{ms['build_s']:.2f}",
                f"{ms['device_s']:.1f}", f"{rest:.2f}", f"{wall - 1e3 * served['step_s']:.2f}",
                f"{served['compilations'] + alone['compilations']:.0f}",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    head = ["N", "LoRA rank", "served ms/step", "device alone ms/step", "device idle ms/step",
            "idle share", "schedule ms", "batch build ms", "dispatch + wait ms",
            "outputs ms", "outside step() ms", "compilations"]  # fmt: skip
    table = render_table(head, rows)
    title = (
        f"{path.name} ({args.quantization} weights, {dtype}, {args.activations} inputs, "
        f"{args.kv_cache_dtype} KV), "
        f"{args.prompt_tokens}-token prompts, "
        f"{args.steps} decode steps per pass, greedy; load average {load0:.2f} before, "
        f"{loadavg():.2f} after"
    )
    print(f"\n{title}\n\n{table}")
    if args.write:
        common.append_results(
            "## Where a decode step's time goes (issue 36 item 3)",
            f"{machine_line(info)}\n\n{title}\n\n{table}\n",
        )
    return rows


if __name__ == "__main__":
    main()
