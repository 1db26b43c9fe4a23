"""KV capacity: how many sequences each backend holds at once in the same memory.

    python -m benchmarks.bench_capacity                 # capacity + block-size sweep
    python -m benchmarks.bench_capacity --no-throughput # capacity and utilization only (seconds)

Capacity is measured, not computed: sequences drawn from a length distribution
(a workload's prompt + output lengths, in order, seeded) are admitted into the
host caches themselves (`PagedKVCache`, `ContiguousKVCache`) at their full
length until the pool refuses one (OutOfBlocksError). The budget is the
contiguous reservation, `--contiguous-batch-size` x `--max-seq-len` tokens
(8 x 4096 by default), and the paged pool gets the same bytes
(`num_blocks = budget / block_size`). Utilization is tokens stored / token slots
allocated when the pool refused.

The KV dtype table (`--kv-cache-dtypes`) fills paged pools of the same bytes (the
budget above, in bfloat16) whose blocks are float32, bfloat16 or 1-byte values with a
scale per token and KV head (int8 and both fp8 types take the same bytes; the scale
is of the model's dtype: bfloat16 on a GPU, float32 on a CPU), on the bench model's
shape (head_dim 64), and gives the byte ratio at head_dim 16, 64, 128 and 256.

The sliding-window table fills pools with sequences of 2k, 8k and 32k tokens of
Gemma 3's shapes (1B and 270M: every sixth layer global, the others a 512-token
window) and the bench model's (no window), with KV groups (`jpaged.cache.groups`)
and with every layer keeping the whole context, in the same bytes.

The block-size sweep (8, 16, 32, 64) repeats the paged capacity measure and runs
a burst of `--sweep-requests` (24) `paged_attention` requests through an
in-process paged engine with the same KV bytes (`--sweep-batch-size`, 24),
reporting output tok/s and the KV utilization at peak. Each block size is a
different pool shape, so each needs its own programs: the sweep warms up with one
unmeasured pass of the workload (fresh prompt ids; compiles only the buckets it
uses — the engine's full warm-up runs every bucket, minutes per block size on this
2-core CPU) and checks that the measured pass compiles nothing. About 4 min with
a warm `~/.cache/jpaged/xla`, ~7 min cold.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import workloads
from benchmarks.common import fmt, machine_info, machine_line, render_table

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
BLOCK_SIZES = (8, 16, 32, 64)
DISTRIBUTIONS = ("paged_attention", "long_tail", "uniform")


def length_stream(name: str, n: int, *, max_seq_len: int, seed: int = 0) -> list[int]:
    """`n` sequence lengths (prompt + output) from a named distribution, seeded."""
    if name == "uniform":
        rng = np.random.default_rng(seed)
        return [int(x) for x in rng.integers(1, max_seq_len + 1, n)]
    w = workloads.make(name, n, seed=seed, vocab_size=64, max_seq_len=max_seq_len)
    return [r.total_len for r in w.requests]


def fill(pool: Any, lengths: list[int]) -> dict[str, Any]:
    """Admit sequences at their full length until the pool refuses one."""
    from jpaged.cache.protocol import OutOfBlocksError

    held = 0
    for n in lengths:
        try:
            seq = pool.allocate_seq(n)
        except OutOfBlocksError:
            break
        pool.append(seq, n)
        held += 1
    else:
        raise RuntimeError(f"the pool never refused: draw more than {len(lengths)} lengths")
    s = pool.stats()
    return {
        "held": held,
        "tokens_stored": int(s["tokens_stored"]),
        "blocks_used": int(s["blocks_used"]),
        "blocks_total": int(s["blocks_total"]),
        "utilization": float(s["utilization"]),
        "fragmentation": float(s["fragmentation"]),
    }


def capacity(
    distribution: str,
    *,
    budget_tokens: int,
    contiguous_batch: int,
    max_seq_len: int,
    block_size: int,
    seed: int = 0,
) -> dict[str, Any]:
    from jpaged.cache.contiguous import ContiguousKVCache
    from jpaged.cache.paged import PagedKVCache

    lengths = length_stream(
        distribution, 4 * budget_tokens // 16 + 64, max_seq_len=max_seq_len, seed=seed
    )
    cont = fill(ContiguousKVCache(contiguous_batch, max_seq_len, block_size), lengths)
    paged = fill(PagedKVCache(budget_tokens // block_size + 1, block_size), lengths)
    return {
        "distribution": distribution,
        "block_size": block_size,
        "budget_tokens": budget_tokens,
        "mean_len": float(np.mean(lengths)),
        "contiguous": cont,
        "paged": paged,
        "ratio": paged["held"] / max(cont["held"], 1),
    }


def kv_dtype_capacity(
    distribution: str,
    *,
    kv_bytes: int,
    shape: tuple[int, int, int],
    block_size: int,
    max_seq_len: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Sequences a paged pool of `kv_bytes` holds, per KV storage, for a model of `shape`
    (layers, KV heads, head_dim)."""
    from jpaged.cache.kv_pool import block_bytes
    from jpaged.cache.paged import PagedKVCache

    layers, heads, head_dim = shape
    lengths = length_stream(
        distribution,
        4 * kv_bytes // (layers * heads * head_dim) + 64,
        max_seq_len=max_seq_len,
        seed=seed,
    )
    rows = []
    for label, dtype, kv in KV_STORAGE:
        per_block = block_bytes(layers, heads, block_size, head_dim, dtype, kv)
        blocks = kv_bytes // per_block
        held = fill(PagedKVCache(blocks + 1, block_size), lengths)["held"]
        rows.append({"storage": label, "block_bytes": per_block, "blocks": blocks, "held": held})
    return rows


def scale_layout(head_dims: tuple[int, ...] = (16, 64, 128, 256)) -> list[dict[str, Any]]:
    """Tokens a 1-byte cache holds per token of a bfloat16 / float32 one, scales counted."""
    from jpaged.cache.kv_pool import block_bytes

    out = []
    for d in head_dims:
        size = {(dt, kv): block_bytes(1, 1, 1, d, dt, kv) for _, dt, kv in KV_STORAGE}
        out.append(
            {
                "head_dim": d,
                "vs_bfloat16": size["bfloat16", "auto"] / size["bfloat16", "int8"],
                "vs_float32": size["float32", "auto"] / size["float32", "int8"],
            }
        )
    return out


# (label, model dtype, kv_cache_dtype); fp8 takes the bytes of int8
KV_STORAGE = [
    ("float32", "float32", "auto"),
    ("bfloat16", "bfloat16", "auto"),
    ("int8/fp8 + bf16 scales", "bfloat16", "int8"),
    ("int8/fp8 + f32 scales", "float32", "int8"),
]


# (name, layers, KV heads, head_dim, sliding window, sliding layers): Gemma 3's real
# shapes (every sixth layer global) and the bench model's, which has no window
WINDOW_SHAPES = [
    ("gemma-3-1b", 26, 1, 256, 512, [(i + 1) % 6 != 0 for i in range(26)]),
    ("gemma-3-270m", 18, 1, 256, 512, [(i + 1) % 6 != 0 for i in range(18)]),
    ("bench (llama)", 4, 2, 64, None, []),
]
CONTEXTS = (2048, 8192, 32768)


def window_capacity(
    *,
    budget_tokens: int,
    block_size: int,
    chunk: int = 512,
    contexts: tuple[int, ...] = CONTEXTS,
) -> list[dict[str, Any]]:
    """Sequences of each context length a paged pool holds at once, decoding, with KV groups
    (sliding layers keep their window) and without (every layer the whole context), in the
    bytes of `budget_tokens` whole-context tokens. Sequences grow as served: prompts in
    chunks of `chunk` tokens, then a decode step, until the pool refuses."""
    from jpaged.cache.groups import KVGroups
    from jpaged.cache.paged import PagedKVCache
    from jpaged.cache.protocol import OutOfBlocksError

    def held(groups: KVGroups, layers: int, context: int) -> int:
        # the budget in blocks of the group's layers (a whole-context block holds all)
        pool = PagedKVCache(
            budget_tokens * layers // (groups.size * block_size) + 1,
            block_size,
            enable_prefix_caching=False,
            groups=groups,
        )
        n = 0
        try:
            while True:
                seq = pool.allocate_seq(context)
                for done in range(0, context, chunk):
                    pool.append(seq, min(chunk, context - done))
                pool.append(seq, 1)
                n += 1
        except OutOfBlocksError:
            return n

    rows = []
    for name, layers, _, _, window, sliding in WINDOW_SHAPES:
        groups = KVGroups.of(layers, sliding, window)
        for context in contexts:
            before, after = (held(g, layers, context) for g in (KVGroups.of(layers), groups))
            rows.append(
                {
                    "shape": name,
                    "context": context,
                    "groups": groups.num_groups,
                    "group_size": groups.size,
                    "before": before,
                    "after": after,
                    "ratio": after / max(before, 1),
                }
            )
    return rows


def sweep_throughput(
    model_path: Path,
    block_size: int,
    *,
    budget_tokens: int,
    batch: int,
    max_seq_len: int,
    num_requests: int,
    dtype: str,
    progress: bool,
) -> dict[str, Any]:
    from benchmarks.serving.configs import BenchConfig
    from benchmarks.serving.in_process import run_in_process
    from jpaged import models

    cfg = BenchConfig(
        f"paged b{batch} bs{block_size}",
        "paged",
        batch,
        max_seq_len,
        block_size,
        budget_tokens // block_size,
        dtype,
        512,
    )
    model = _model_cache.get(str(model_path))
    if model is None:
        model = _model_cache[str(model_path)] = models.load(model_path, dtype=dtype)
    vocab = model.config.vocab_size
    w = workloads.make("paged_attention", num_requests, vocab_size=vocab)
    r = run_in_process(model, cfg, w, warmup="workload", temperature=0.0, progress=progress)
    r.pop("timeline")
    return r


_model_cache: dict[str, Any] = {}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_capacity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="bench", help="for the bytes per token and the sweep")
    p.add_argument("--contiguous-batch-size", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16, help="for the capacity table")
    p.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    p.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    p.add_argument("--no-throughput", action="store_true", help="skip the engine runs")
    p.add_argument("--sweep-batch-size", type=int, default=24)
    p.add_argument("--sweep-requests", type=int, default=24)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON (default benchmarks/results/capacity.json)")
    p.add_argument("--plot", type=Path, help="PNG (default benchmarks/capacity.png); 'none'")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    from benchmarks import bench_model
    from benchmarks.serving.configs import BenchConfig, kv_block_bytes

    budget = args.contiguous_batch_size * args.max_seq_len
    info = machine_info()
    print(machine_line(info))
    model_path = bench_model.resolve(args.model) if not args.no_throughput else None
    if model_path is None and args.model != "bench":
        model_path = Path(args.model)
    if model_path is not None:
        probe = BenchConfig("", "paged", 1, args.max_seq_len, 1, None, args.dtype, 1)
        per_token = kv_block_bytes(model_path, probe)
    else:  # the bench model's shape, without writing its checkpoint
        c = bench_model.CONFIG
        itemsize = 4 if args.dtype == "float32" else 2
        per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * itemsize
    print(
        f"budget: {args.contiguous_batch_size} x {args.max_seq_len} = {budget} token slots = "
        f"{budget * per_token:,} bytes of KV ({per_token} bytes/token, {args.dtype}); "
        f"both backends get exactly this"
    )

    dists = [d for d in args.distributions.split(",") if d]
    cap = [
        capacity(
            d,
            budget_tokens=budget,
            contiguous_batch=args.contiguous_batch_size,
            max_seq_len=args.max_seq_len,
            block_size=args.block_size,
            seed=args.seed,
        )
        for d in dists
    ]
    rows = [
        [
            c["distribution"],
            f"{c['mean_len']:.0f}",
            str(c["contiguous"]["held"]),
            f"{c['contiguous']['utilization']:.1%}",
            str(c["paged"]["held"]),
            f"{c['paged']['utilization']:.1%}",
            f"{c['ratio']:.2f}x",
        ]
        for c in cap
    ]
    print(
        f"\n## capacity at {budget * per_token / 2**20:.0f} MiB of KV, block {args.block_size}: "
        f"sequences held at once (admitted at full length until refusal)"
    )
    print(
        render_table(
            [
                "lengths",
                "mean len",
                "contiguous seqs",
                "contiguous util",
                "paged seqs",
                "paged util",
                "paged / contiguous",
            ],
            rows,
        )
    )

    bench = bench_model.CONFIG
    shape = (bench["num_hidden_layers"], bench["num_key_value_heads"], bench["head_dim"])
    kv_bytes = budget * 2 * shape[0] * shape[1] * shape[2] * 2  # the budget in bfloat16
    kv_dtypes = {
        d: kv_dtype_capacity(
            d,
            kv_bytes=kv_bytes,
            shape=shape,
            block_size=args.block_size,
            max_seq_len=args.max_seq_len,
            seed=args.seed,
        )
        for d in dists
    }
    rows = []
    for i, (label, _, _) in enumerate(KV_STORAGE):
        first = kv_dtypes[dists[0]][i]
        row = [label, f"{first['block_bytes']:,}", str(first["blocks"])]
        for d in dists:
            held, bf16, f32 = (kv_dtypes[d][j]["held"] for j in (i, 1, 0))
            row += [str(held), f"{held / bf16:.2f}x / {held / f32:.2f}x"]
        rows.append(row)
    header = ["KV storage", "bytes/block", "blocks"]
    for d in dists:
        header += [f"{d} seqs", f"{d} vs bf16 / f32"]
    print(
        f"\n## KV dtypes: paged sequences held in {kv_bytes / 2**20:.0f} MiB, bench model shape "
        f"(layers, KV heads, head_dim) = {shape}, block {args.block_size}"
    )
    print(render_table(header, rows))
    layout = scale_layout()
    print(
        "\n1-byte tokens per bfloat16 / float32 token, a scale of the model's dtype per token "
        "and KV head:"
    )
    print(
        render_table(
            ["head_dim", "vs bfloat16 (bf16 scales)", "vs float32 (f32 scales)"],
            [
                [str(r["head_dim"]), f"{r['vs_bfloat16']:.2f}x", f"{r['vs_float32']:.2f}x"]
                for r in layout
            ],
        )
    )

    windows = window_capacity(budget_tokens=8 * budget, block_size=args.block_size)
    print(
        f"\n## sliding-window KV groups: sequences held at once, decoding, in the KV bytes of "
        f"{8 * budget} whole-context tokens (block {args.block_size}; prompts in chunks of "
        f"512)"
    )
    print(
        render_table(
            [
                "model shape",
                "KV groups (layers each)",
                "context",
                "every layer whole",
                "groups",
                "groups / whole",
            ],
            [
                [
                    r["shape"],
                    f"{r['groups']} ({r['group_size']})",
                    str(r["context"]),
                    str(r["before"]),
                    str(r["after"]),
                    f"{r['ratio']:.2f}x",
                ]
                for r in windows
            ],
        )
    )

    sizes = [int(b) for b in args.block_sizes.split(",") if b]
    sweep = []
    for bs in sizes:
        entry: dict[str, Any] = {"block_size": bs, "num_blocks": budget // bs}
        for d in dists:
            c = capacity(
                d,
                budget_tokens=budget,
                contiguous_batch=args.contiguous_batch_size,
                max_seq_len=args.max_seq_len,
                block_size=bs,
                seed=args.seed,
            )
            entry[d] = {
                "held": c["paged"]["held"],
                "utilization": c["paged"]["utilization"],
                "fragmentation": c["paged"]["fragmentation"],
            }
        if not args.no_throughput:
            assert model_path is not None
            entry["run"] = sweep_throughput(
                model_path,
                bs,
                budget_tokens=budget,
                batch=args.sweep_batch_size,
                max_seq_len=args.max_seq_len,
                num_requests=args.sweep_requests,
                dtype=args.dtype,
                progress=not args.no_progress,
            )
        sweep.append(entry)
    header = ["block size", "blocks"]
    for d in dists:
        header += [f"{d} seqs", f"{d} util"]
    if not args.no_throughput:
        header += ["burst tok/s", "util at peak", "peak running", "compilations after warm-up"]
    rows = []
    for e in sweep:
        row = [str(e["block_size"]), str(e["num_blocks"])]
        for d in dists:
            row += [str(e[d]["held"]), f"{e[d]['utilization']:.1%}"]
        if "run" in e:
            r = e["run"]
            row += [
                f"{r['output_tok_s']:.1f}",
                f"{r['utilization_at_peak']:.1%}",
                str(r["peak_running"]),
                fmt(r["compilations_after_warmup"]),
            ]
        rows.append(row)
    print(
        f"\n## block-size sweep (paged, same {budget} token slots"
        + (
            ""
            if args.no_throughput
            else f"; burst of {args.sweep_requests} paged_attention "
            f"requests, max_batch_size {args.sweep_batch_size}"
        )
        + ")"
    )
    print(render_table(header, rows))

    report = {
        "machine": info,
        "budget_tokens": budget,
        "bytes_per_token": per_token,
        "capacity": cap,
        "kv_dtypes": kv_dtypes,
        "scale_layout": layout,
        "windows": windows,
        "sweep": sweep,
    }
    out = args.out or RESULTS_DIR / "capacity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=float))
    print(f"\nraw numbers: {out}")
    if args.plot is None or str(args.plot).lower() != "none":
        png = args.plot or HERE / "capacity.png"
        plot(report, png, dists)
        print(f"plot: {png}")
    return report


def plot(report: dict[str, Any], path: Path, dists: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = report["sweep"]
    has_run = bool(sweep) and "run" in sweep[0]
    fig, axes = plt.subplots(1, 3 if has_run else 2, figsize=(14 if has_run else 10, 4))
    cap = report["capacity"]
    x = np.arange(len(cap))
    axes[0].bar(x - 0.2, [c["contiguous"]["held"] for c in cap], 0.4, label="contiguous")
    axes[0].bar(x + 0.2, [c["paged"]["held"] for c in cap], 0.4, label="paged")
    for i, c in enumerate(cap):
        axes[0].annotate(
            f"{c['ratio']:.1f}x",
            (i + 0.2, c["paged"]["held"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    axes[0].set_xticks(x, [c["distribution"] for c in cap], fontsize=8)
    axes[0].set(ylabel="sequences held at once", title="capacity, same KV bytes")
    axes[0].legend(fontsize=8)
    sizes = [e["block_size"] for e in sweep]
    for d in dists:
        axes[1].plot(sizes, [100 * e[d]["utilization"] for e in sweep], "o-", label=d)
    axes[1].set(
        xscale="log",
        xlabel="block size (tokens)",
        ylabel="KV utilization (%)",
        title="paged utilization when full",
    )
    axes[1].minorticks_off()
    axes[1].set_xticks(sizes, [str(s) for s in sizes])
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3)
    if has_run:
        axes[2].bar([str(s) for s in sizes], [e["run"]["output_tok_s"] for e in sweep])
        axes[2].set(
            xlabel="block size (tokens)",
            ylabel="output tok/s",
            title="paged_attention burst throughput",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


if __name__ == "__main__":
    main()
