"""One prepared GPU run: what a lent card's few minutes should measure, in one command.

    python -m benchmarks.gpu_check --out DIR     # on a GPU: ~13 minutes on an H200 (below)
    python -m benchmarks.gpu_check --small       # anywhere: tiny shapes (the suite runs it)

Prints, and writes to DIR/gpu_check.md (with `--write`, to RESULTS.md too):
- the card, JAX, and its copy bandwidth (read + write of a 2 GiB array);
- the attention kernel against JAX's own Pallas paged attention and a dense cache
  (`bench_kernel.gpu_table`: µs, GB/s, % of the copy bandwidth), under both of its GPU
  lowerings (Triton's, the default, and Mosaic GPU's: "ragged / Mosaic" > 1 where Mosaic
  is faster, which decides the default on Hopper);
- the decode step of random-weight Llama-3.2-1B and Llama-3.1-8B geometries in bfloat16
  at 1 / 4 / 64 / 256 users (32-token prompts): the device's time a step (every program
  blocked on), the step as served, and the share of the memory roofline (the weights'
  bytes plus the KV read, over the card's memory bandwidth from its target proto, against
  the served step); the served output tokens a second; the served step's own time split
  into the engine's Python, launching its programs (with their inputs), and reading their
  results (waiting for the device among it);
- the seed burst (256 requests at once, prompts of 128-384 random ids, the workload's mean
  of new tokens each, greedy, EOS ignored) on the 1B geometry: jpaged's output tokens a
  second against transformers' continuous batching (`generate_batch`, paged KV) on a model
  of the same geometry (random weights: the time does not depend on them), after a warm
  pass of other prompts on each; transformers runs first, in a process of its own;
- a trace of the served decode steps at each number of users (`trace_step`: the device's
  busy share of a step, kernels a step, the kernels that take the time; the trace files in
  DIR, for a profile viewer);
- the pool scan: the 1B step at 64 users with a 1024- and a 16384-block pool (flat: no
  op of the step touches the whole pool);
- the card's target proto (DIR/target_config.txtpb), for the deviceless compile
  (`benchmarks/gpu_structure.py`).

On a GPU image without the project installed, run it from the checkout with
`PYTHONPATH=.` (../shared/gpu/README.md: the wheels the image lacks: gguf, llguidance).
On an H200 (JAX 0.11.2) each step program compiles in ~21 s (its GEMMs autotuned), and
the whole run outlasts one 10-minute call (2026-11-27: the first four sections of the
1B took 560 s): split it over two, `--sections peer,kernel,pool,burst --models 1B` and
`--sections steps`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_kernel, profile_step, trace_step, workloads
from benchmarks.common import append_results, build_engine, render_table
from benchmarks.gpu_structure import SHAPES
from benchmarks.random_weights import TINY, random_model
from jpaged.config import EngineConfig
from jpaged.engine.interface import PromptRequest
from jpaged.engine.sampling import SamplingParams
from jpaged.models.config import ModelConfig
from jpaged.models.loaded import LoadedModel

PROMPT_TOKENS = 32
GEOMETRIES = {"tiny": TINY, "1B": SHAPES["1b"], "8B": SHAPES["8b"]}


def weight_bytes(model: LoadedModel) -> int:
    """What a decode step reads of the weights (all of them; a tied table once, as the head)."""
    state = nnx.state(model.model)
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))


def kv_bytes(c: ModelConfig, users: int, context: int, dtype: str) -> int:
    return (
        2 * c.num_layers * c.num_kv_heads * c.head_dim * users * context * np.dtype(dtype).itemsize
    )


# `--enforce-eager`: every engine of the run without CUDA graphs (a run each way compares)
EAGER: dict[str, Any] = {"enforce_eager": False}


def engine_for(model: LoadedModel, users: int, dtype: str, num_blocks: int | None) -> Any:
    # an earlier section's engine, gone but in a reference cycle, holds the card's memory
    # until a collection: its pool would leave this one no block
    gc.collect()
    config = EngineConfig(
        max_batch_size=users,
        max_seq_len=PROMPT_TOKENS + 128,
        max_num_batched_tokens=2048,
        dtype=dtype,
        num_blocks=num_blocks,
        enable_prefix_caching=False,
        **EAGER,
    )
    return build_engine(model, config)


def decode_rows(
    name: str, model: LoadedModel, users: list[int], steps: int, dtype: str, bandwidth: float
) -> list[list[str]]:
    """The decode step at each number of users, on one engine (its programs compiled once)."""
    engine = engine_for(model, max(users), dtype, None)
    weights = weight_bytes(model)
    rows = []
    for n in users:
        start = time.perf_counter()
        r = profile_step.measure(engine, n, steps, PROMPT_TOKENS)
        device, served = r["alone"]["wall_s"], r["served"]["wall_s"]
        # as served: the engine's Python (scheduling, batch building, outputs), and its
        # device calls: putting and launching, then reading results (waiting among it)
        calls, wait = r["served"]["device_s"], r["served"]["wait_s"]
        python = r["served"]["step_s"] - calls
        read = weights + kv_bytes(model.config, n, PROMPT_TOKENS + steps, dtype)
        rows.append([
            name, str(n), f"{1e3 * device:.2f}", f"{1e3 * served:.2f}",
            f"{1e3 * python:.2f}", f"{1e3 * (calls - wait):.2f}", f"{1e3 * wait:.2f}",
            f"{read / bandwidth / served:.0%}", f"{n / served:,.0f}",
            f"{time.perf_counter() - start:.0f}",
        ])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def burst(users: int, vocab: int, seed: int) -> tuple[list[list[int]], int]:
    """The seed burst's prompts and its mean of new tokens (one length for all: transformers'
    `generate_batch` takes one generation config); at the tiny vocabulary, a tiny burst."""
    lengths = {"prompt_range": (16, 32), "output_range": (4, 8)} if vocab == TINY.vocab_size else {}
    w = workloads.paged_attention(users, seed=seed, vocab_size=vocab, **lengths)
    return [list(r.prompt_ids) for r in w.requests], round(w.output_tokens / users)


def burst_jpaged(model: LoadedModel, users: int, dtype: str) -> float:
    """jpaged's output tokens a second on the seed burst (a warm pass of other prompts first)."""
    prompts, new = burst(users, model.config.vocab_size, seed=0)
    longest = 384 + new
    config = EngineConfig(
        max_batch_size=users, max_seq_len=longest, max_num_batched_tokens=2048, dtype=dtype,
        num_blocks=users * -(-longest // 16), enable_prefix_caching=False, **EAGER,
    )  # fmt: skip
    engine = build_engine(model, config)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    for seed in (1, 0):  # the first pass compiles
        start = time.perf_counter()
        for prompt in burst(users, model.config.vocab_size, seed)[0]:
            engine.add(engine.prepare(PromptRequest(prompt, params)))
        while engine.has_unfinished():
            engine.step()
        elapsed = time.perf_counter() - start
    return len(prompts) * new / elapsed


def burst_transformers(name: str, users: int) -> dict[str, Any]:
    """transformers' continuous batching on the seed burst, in a process of its own (its
    memory apart from JAX's): {"tok_s", "version", "attention"}."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--transformers", name,
         "--users", str(users)], capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def transformers_peer(name: str, users: int) -> None:
    import torch
    import transformers

    c = GEOMETRIES[name]
    hf = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        tie_word_embeddings=c.tie_word_embeddings,
    )  # fmt: skip
    cuda = torch.cuda.is_available()
    torch.set_default_dtype(torch.bfloat16 if cuda else torch.float32)  # this process's only
    with torch.device("cuda" if cuda else "cpu"):
        model = transformers.LlamaForCausalLM(hf).eval()
    # on a GPU its paged cache takes most of the free memory; on a CPU that is most of the
    # host's RAM, zero-filled at each pass (~40 s of the suite's tiny run): the burst's pages
    cache = None
    if not cuda:
        pages = users * -(-(384 + 256) // 256)  # the longest prompt and output, 256-token pages
        cache = transformers.ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=2048)
    for seed in (1, 0):  # the first pass warms up
        prompts, new = burst(users, c.vocab_size, seed)
        generation = transformers.GenerationConfig(
            max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        start = time.perf_counter()
        outputs = model.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=cache
        )
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    print(json.dumps({"tok_s": tokens / elapsed, "version": transformers.__version__,
                      "attention": model.config._attn_implementation}))  # fmt: skip


def pool_scan(model: LoadedModel, users: int, steps: int, dtype: str, pools: list[int]) -> str:
    times = []
    for blocks in pools:
        engine = engine_for(model, users, dtype, blocks)
        times.append(profile_step.measure(engine, users, steps, PROMPT_TOKENS)["alone"]["wall_s"])
    cells = ", ".join(f"{b} blocks {1e3 * t:.2f} ms" for b, t in zip(pools, times, strict=True))
    return f"Pool scan ({users} users, device ms a step): {cells}; ratio {times[-1] / times[0]:.2f}"


SECTIONS = ("peer", "kernel", "steps", "trace", "pool", "burst")


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--small", action="store_true", help="tiny shapes: any machine, seconds")
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="folder of the outputs")
    p.add_argument("--users", default="1,4,64,256")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per pass")
    p.add_argument("--models", default="1B,8B", help="geometries of the decode steps")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help="what to run (a lease too short for all: split them over calls); "
                   "pool and burst run on the first of --models")  # fmt: skip
    p.add_argument("--head-dims", default="64,128", help="head sizes of the kernel table")
    p.add_argument("--enforce-eager", action="store_true", help="engines without CUDA graphs")
    p.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    p.add_argument("--transformers", choices=GEOMETRIES, help=argparse.SUPPRESS)  # the peer's run
    args = p.parse_args(argv)
    if args.transformers:
        transformers_peer(args.transformers, int(args.users))
        return ""
    sections = set(args.sections.split(","))
    EAGER["enforce_eager"] = args.enforce_eager
    if sections - set(SECTIONS):
        p.error(f"--sections: unknown {sorted(sections - set(SECTIONS))}; of {SECTIONS}")
    models = ["tiny"] if args.small else args.models.split(",")
    burst_users = 4 if args.small else 256
    parts = []
    peer: dict[str, Any] = {}
    if "peer" in sections:  # first: JAX, once started on a GPU, holds most of its memory
        peer = burst_transformers(models[0], burst_users)
        parts.append(
            f"Seed burst ({models[0]}, {burst_users} requests at once): transformers "
            f"{peer['version']} `generate_batch` ({peer['attention']}) {peer['tok_s']:,.0f} "
            "output tok/s"
        )
        print(parts[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    dtype = "bfloat16" if on_gpu else "float32"
    users = [int(n) for n in args.users.split(",")]
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    copy = bench_kernel.copy_bandwidth(1 << 20 if args.small else 2 << 30)
    bandwidth = copy
    if on_gpu:
        from jax._src.lib import xla_client

        proto = str(xla_client.get_topology_for_devices(jax.devices()).target_config)
        (args.out / "target_config.txtpb").write_text(proto)
        bandwidth = float(re.search(r"memory_bandwidth: (\d+)", proto).group(1))  # type: ignore[union-attr]
    head = (
        f"{devices}, JAX {jax.__version__}, copy bandwidth {copy / 1e9:.0f} GB/s (read + "
        f"write); the roofline at {bandwidth / 1e9:.0f} GB/s (the card's, else the copy's)"
    )
    print(head, flush=True)

    if "kernel" in sections:
        if args.small:
            kernel, note = bench_kernel.gpu_table([2], [64], [64], jnp.dtype(dtype), copy)
        else:
            head_dims = [int(d) for d in args.head_dims.split(",")]
            kernel, note = bench_kernel.gpu_table(
                [1, 64, 256], [512, 4096], head_dims, jnp.dtype(dtype), copy
            )
        parts += ["\n".join(kernel), note]
    steps, pools = (min(args.steps, 4), [64, 256]) if args.small else (args.steps, [1024, 16384])
    rows = []
    for name in models:
        if not sections & {"steps", "trace", "pool", "burst"}:
            break
        model = random_model(GEOMETRIES[name], dtype)
        if "steps" in sections:
            rows += decode_rows(name, model, users, steps, dtype, bandwidth)
        if "trace" in sections:
            engine = engine_for(model, max(users), dtype, None)
            for n in users:
                keep = args.out / f"trace_{name}_{n}.xplane.pb"
                summary = trace_step.trace(engine, n, steps, PROMPT_TOKENS, keep)
                parts.append(f"Trace ({name}, {summary}")
                print(parts[-1], flush=True)
            del engine
        if name == models[0] and "pool" in sections:
            parts.append(pool_scan(model, min(64, max(users)), steps, dtype, pools))
            print(parts[-1], flush=True)
        if name == models[0] and "burst" in sections:
            ours = burst_jpaged(model, burst_users, dtype)
            parts.append(
                f"Seed burst ({name}, {burst_users} requests at once): jpaged {ours:,.0f} "
                "output tok/s"
                + (
                    f"; transformers / jpaged {peer['tok_s'] / ours:.2f}"
                    if "peer" in sections
                    else ""
                )
            )
            print(parts[-1], flush=True)
        del model
    if rows:
        step_head = ["model", "users", "device ms a step", "served ms a step",
                     "host Python ms", "launching ms", "reading results ms",
                     "memory roofline (served)",
                     "served tok/s", "s measured"]  # fmt: skip
        parts.append(render_table(step_head, rows))
    command = " ".join(["python -m benchmarks.gpu_check", *(argv or sys.argv[1:])])
    text = "\n\n".join([f"{datetime.date.today()}: `{command}` on {head}", *parts])
    print(f"\n{text}")
    (args.out / "gpu_check.md").write_text(text + "\n")
    if args.write:
        append_results("## One prepared GPU run (issue 50, `benchmarks/gpu_check.py`)", text)
    return text


if __name__ == "__main__":
    main()
