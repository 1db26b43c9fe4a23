"""Attention on a CPU: XLA's path against `jpaged/kernels/attention.cc`, one layer's call.

    python -m benchmarks.bench_cpu_attention                 # SmolLM2's heads
    python -m benchmarks.bench_cpu_attention --cases 8x256,48x1@450 --kv auto,int8 --no-write

Each case is a step of `ragged_paged_attention` as the engine runs it (impl "xla", a model
whole on one CPU: `cpu.unsplit(True)` lets the kernel serve, `False` keeps XLA's path):
`PxL` P prompts of L tokens from scratch (causal, tiles of 32 tokens), `Dx1@C` D decoding
tokens over C-token contexts (pages of 16, each sequence's its own). Milliseconds per call
(min over repeats, the two paths interleaved), useful multiply-adds a second (the causal
ones: q.k and p.v), and the largest difference between the two outputs. `--kv int8` holds
the pools as int8 with a scale per token (`--kv-cache-dtype int8`). Writes its table to
benchmarks/RESULTS.md unless `--no-write`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import append_results, loadavg, machine_info, machine_line, render_table

BLOCK = 16


def case(spec: str) -> list[tuple[int, int]]:
    """`PxL` or `Dx1@C` -> (new tokens, tokens stored) per sequence."""
    count, rest = spec.split("x")
    if "@" in rest:
        new, context = (int(v) for v in rest.split("@"))
        return [(new, context)] * int(count)
    return [(int(rest), int(rest))] * int(count)


def inputs(seqs: list[tuple[int, int]], heads: tuple[int, int, int], kv: str, seed: int) -> dict:
    from jpaged.cache import kv_pool
    from jpaged.kernels import ragged_plan

    num_q, num_kv, dim = heads
    query = np.array([q for q, _ in seqs])
    context = np.array([c for _, c in seqs])
    pages = -(-context // BLOCK)
    width = int(pages.max())
    tables = np.zeros((len(seqs), width), np.int32)
    start = 1  # block 0: the null block
    for i, n in enumerate(pages):
        tables[i, :n] = range(start, start + n)
        start += n
    rng = np.random.default_rng(seed)
    shape = (start, num_kv, BLOCK, dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    scales: dict[str, Any] = {}
    if kv == "int8":
        (k, ks), (v, vs) = (kv_pool.quantize(x, jnp.dtype(jnp.int8), jnp.float32) for x in (k, v))
        scales = dict(k_scale=ks, v_scale=vs)
    tokens = int(query.sum())
    meta = ragged_plan.plan(query, context, tables, num_tokens=tokens, num_seqs=len(seqs),
                            width=width, block_size=BLOCK, impl="xla")  # fmt: skip
    q = jnp.asarray(rng.standard_normal((tokens, num_q, dim)), jnp.float32)
    macs = 2 * num_q * dim * sum(n * (c - n) + n * (n + 1) // 2 for n, c in seqs)
    return dict(q=q, k=k, v=v, meta=meta, scales=scales, macs=macs, scale=dim**-0.5)


def time_paths(x: dict, repeats: int) -> tuple[float, float, float]:
    """ms of XLA's path, ms of the kernel, their outputs' largest difference."""
    from jpaged.kernels import cpu
    from jpaged.kernels import ragged_attention as ra

    def compiled(kernel: bool) -> Any:
        with cpu.unsplit(kernel):
            f = jax.jit(
                lambda q, k, v, meta, s: ra.ragged_paged_attention(
                    q, k, v, meta, scale=x["scale"], impl="xla", **s
                )[0]  # the pools are not returned: no copies of them timed
            )
            f(x["q"], x["k"], x["v"], x["meta"], x["scales"]).block_until_ready()
        return f

    fns = [compiled(False), compiled(True)]
    outs = [np.asarray(f(x["q"], x["k"], x["v"], x["meta"], x["scales"])) for f in fns]
    best = [float("inf")] * 2
    for _ in range(repeats):
        for i, f in enumerate(fns):
            start = time.perf_counter()
            f(x["q"], x["k"], x["v"], x["meta"], x["scales"]).block_until_ready()
            best[i] = min(best[i], time.perf_counter() - start)
    return 1e3 * best[0], 1e3 * best[1], float(np.abs(outs[0] - outs[1]).max())


def main(argv: list[str] | None = None) -> list[list[str]]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_cpu_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", default="8x256,2x384,1x1@450,4x1@450,48x1@32,48x1@450")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    p.add_argument("--kv", default="auto,int8", help="pools: auto (float32), int8")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    num_q, num_kv, dim = (int(v) for v in args.heads.split(","))
    info = machine_info()
    print(machine_line(info), flush=True)
    load0 = loadavg()
    rows = []
    for kv in args.kv.split(","):
        for spec in args.cases.split(","):
            x = inputs(case(spec), (num_q, num_kv, dim), kv, seed=0)
            xla, kernel, diff = time_paths(x, args.repeats)
            rows.append([
                spec, kv, f"{xla:.3f}", f"{kernel:.3f}", f"{xla / kernel:.2f}x",
                f"{x['macs'] / xla / 1e6:.1f}", f"{x['macs'] / kernel / 1e6:.1f}", f"{diff:.1e}",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    head = ["case", "KV", "XLA ms", "attention.cc ms", "speed-up", "XLA G MAC/s",
            "attention.cc G MAC/s", "max difference"]  # fmt: skip
    table = render_table(head, rows)
    title = (
        f"{num_q} query heads, {num_kv} KV heads of {dim}, pages of {BLOCK}; min of "
        f"{args.repeats}; load average {load0:.2f} before, {loadavg():.2f} after"
    )
    print(f"\n{title}\n\n{table}")
    if not args.no_write:
        append_results(
            "## Attention on a CPU: XLA's path vs attention.cc (issue 36)",
            f"{machine_line(info)}\n\n{title}\n\n{table}\n",
        )
    return rows


if __name__ == "__main__":
    main()
