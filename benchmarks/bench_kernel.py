"""Decode attention over a paged pool vs a contiguous cache at the same lengths.

    python -m benchmarks.bench_kernel [--no-write]

On CPU: times the jitted "xla" paged path against the same math over a dense per-row
cache (`contiguous_decode_attention`), block_until_ready, warm-up excluded, median of
repeats with the two interleaved so machine load hits both alike. KV bytes/s counts
the K and V bytes each call must read (B * ctx * Hkv * D * 2 * itemsize).

On a GPU: jpaged's Pallas decode kernel, the engine's ragged kernel given one token per
sequence (`ragged_paged_attention`: what a decode-only step runs), JAX's own
(`jax.experimental.pallas.ops.gpu.paged_attention`, k_splits=16) and a dense
`jax.nn.dot_product_attention` over the same K/V gathered once, each checked against the
dense reference; microseconds per call (median of 7 runs of 20 back-to-back calls), KV
GB/s and % of the device copy bandwidth measured in the same run. Shuffled pages, every
row's last page partly filled; KV bytes count the tokens really held. The method of the
GPU numbers in issue 11.

Either writes its table into benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from jpaged.kernels import paged_attention as pa
from jpaged.kernels import ragged_attention
from jpaged.kernels.paged_attention import (
    contiguous_decode_attention,
    paged_decode_attention,
    paged_decode_attention_reference,
)

HEADING = "## Kernel: paged decode attention (issue 2)"
READING = (
    "How to read it: the XLA path gathers each row's pages in up to 8 static chunks of "
    '~4 MB (K, then V) and merges them flash-decoding style; "contig chunked" runs the '
    "same chunks as slices of a dense cache, so the ratio isolates gather vs slice. B=1 "
    "pays the gather copy with little work to hide it behind; the largest f32 cases hit "
    "the 8-chunk cap (more chunks cost ~0.3 s compile each), and chunks past glibc's "
    "32 MB mmap threshold are page-faulted in on every call."
)
GPU_HEADING = "## Kernel on a GPU: jpaged's Pallas kernel vs JAX's (issue 11)"
RESULTS = Path(__file__).with_name("RESULTS.md")
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B-like GQA
JAX_K_SPLITS = 16  # as in issue 11's measurement
CHECK_ROWS = 4  # rows checked against the dense reference (it repeats K/V per q head)


def _time(fns: dict[str, tuple[Callable[..., Any], tuple]], repeats: int) -> dict[str, list[float]]:
    for fn, args in fns.values():  # compile + warm up
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, args) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return times


def bench_case(batch: int, ctx: int, dtype: Any) -> dict[str, Any]:
    # uint16: bf16 bits in the pool, the XLA-CPU-friendly storage (see `jpaged.kernels.common`).
    bits = dtype == jnp.uint16
    dtype = jnp.dtype(jnp.bfloat16) if bits else dtype
    rng = np.random.default_rng(0)
    width = ctx // BLOCK_SIZE
    num_blocks = batch * width + 1  # + the null block
    pool_shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    q = jnp.asarray(rng.standard_normal((batch, NUM_Q_HEADS, HEAD_DIM)), dtype)
    k_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    # Shuffled pages: a row's blocks are scattered over the pool, as after churn.
    if bits:
        k_pool, v_pool = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k_pool, v_pool))
    tables = jnp.asarray(1 + rng.permutation(batch * width).reshape(batch, width), jnp.int32)
    lens = jnp.full((batch,), ctx, jnp.int32)
    dense_shape = (batch, NUM_KV_HEADS, ctx, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(dense_shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(dense_shape, np.float32), dtype)
    scale = HEAD_DIM**-0.5

    def paged(impl: pa.Impl) -> Callable[..., jax.Array]:
        return jax.jit(
            lambda q, kp, vp, bt, cl: paged_decode_attention(
                q, kp, vp, bt, cl, scale=scale, impl=impl
            )
        )

    def contiguous(num_chunks: int) -> Callable[..., jax.Array]:
        return jax.jit(
            lambda q, k, v, cl: contiguous_decode_attention(
                q, k, v, cl, scale=scale, num_chunks=num_chunks
            )
        )

    # The paged path's chunk count, so "chunked" differs from it only in gather vs slice.
    chunks = pa.xla_chunks(k.nbytes, width)
    fns: dict[str, tuple[Callable[..., Any], tuple]] = {
        "xla": (paged("xla"), (q, k_pool, v_pool, tables, lens)),
        "oneshot": (contiguous(1), (q, k, v, lens)),
        "chunked": (contiguous(chunks), (q, k, v, lens)),
    }
    # ~2 s of timing per case, 7 to 50 repeats.
    probe = _time({"xla": fns["xla"]}, 1)["xla"][0]
    repeats = int(min(50, max(7, 2.0 / max(probe, 1e-4))))
    times = _time(fns, repeats)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(dtype).itemsize
    result: dict[str, Any] = {name: statistics.median(ts) for name, ts in times.items()}
    result.update({f"{name}_min": min(ts) for name, ts in times.items()})
    return dict(result, kv_bytes=kv_bytes, repeats=repeats, chunks=chunks)


def _time_per_call(fn: Callable[..., Any], args: tuple, calls: int = 20, runs: int = 7) -> float:
    """Median seconds per call over `runs` runs of `calls` back-to-back calls, one sync
    each: the device time once the host runs ahead, as a serving step sees it."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s read + written by a jitted elementwise copy of a large array."""
    x = jnp.full((nbytes // 2,), 1.5, jnp.bfloat16)
    return 2 * x.nbytes / _time_per_call(jax.jit(lambda a: a * 2), (x,), calls=10, runs=5)


def gpu_case(rows: int, ctx: int, head_dim: int, dtype: Any) -> dict[str, Any]:
    """jpaged, JAX's kernel and dense attention on one shape: seconds per call and
    max |error| against the dense float32 reference on the first rows."""
    rng = np.random.default_rng(rows * 7919 + ctx)
    width = ctx // BLOCK_SIZE
    pool_shape = (rows * width + 1, NUM_KV_HEADS, BLOCK_SIZE, head_dim)  # + the null block
    k_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((rows, NUM_Q_HEADS, head_dim), np.float32), dtype)
    tables = jnp.asarray(1 + rng.permutation(rows * width).reshape(rows, width), jnp.int32)
    lens = jnp.asarray(rng.integers(ctx - BLOCK_SIZE + 1, ctx, size=rows), jnp.int32)
    scale = head_dim**-0.5
    interpret = jax.default_backend() != "gpu"  # the smoke test runs this on CPU

    def dense(pool: jax.Array) -> jax.Array:  # [rows, ctx, Hkv, D], gathered once, untimed
        return jnp.swapaxes(pool[tables], 2, 3).reshape(rows, ctx, NUM_KV_HEADS, head_dim)

    def jax_kernel(q: jax.Array, k: jax.Array, v: jax.Array, t: jax.Array, n: jax.Array) -> Any:
        return jax_paged.paged_attention(
            q * jnp.asarray(scale, q.dtype), k, v, t, n,
            k_splits=math.gcd(JAX_K_SPLITS, width), interpret=interpret,
        )  # fmt: skip

    def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, n: jax.Array) -> jax.Array:
        out = jax.nn.dot_product_attention(q[:, None], k, v, scale=scale, key_value_seq_lengths=n)
        return out[:, 0]

    def ragged(q: jax.Array, k: jax.Array, v: jax.Array, meta: ragged_attention.Ragged) -> Any:
        return ragged_attention.ragged_paged_attention(
            q, k, v, meta, scale=scale, impl="pallas", interpret=interpret
        )[0]

    meta = ragged_attention.plan(
        np.ones(rows, np.int32), np.asarray(lens), np.asarray(tables), num_tokens=rows,
        num_seqs=rows, width=width, block_size=BLOCK_SIZE, impl="pallas",
    )  # fmt: skip
    k_dense, v_dense = dense(k_pool), dense(v_pool)
    # JAX's kernel wants [Hkv, pages, page_size, D]: transposed once, untimed.
    k_heads, v_heads = jnp.swapaxes(k_pool, 0, 1), jnp.swapaxes(v_pool, 0, 1)
    fns: dict[str, tuple[Callable[..., Any], tuple]] = {
        "jpaged": (
            jax.jit(functools.partial(paged_decode_attention, scale=scale, impl="pallas")),
            (q, k_pool, v_pool, tables, lens),
        ),
        "ragged": (jax.jit(ragged), (q, k_pool, v_pool, meta)),
        "jax": (jax.jit(jax_kernel), (q, k_heads, v_heads, tables, lens)),
        "dense": (jax.jit(dense_attention), (q, k_dense, v_dense, lens)),
    }
    n = min(rows, CHECK_ROWS)
    f32 = lambda x: x[:n].astype(jnp.float32)
    ref = paged_decode_attention_reference(
        f32(q), f32(k_dense), f32(v_dense), lens[:n], scale=scale
    )
    result: dict[str, Any] = {
        "kv_bytes": int(np.asarray(lens).sum()) * NUM_KV_HEADS * head_dim * 2 * q.dtype.itemsize
    }
    for name, (fn, args) in fns.items():
        err = jnp.abs(fn(*args)[:n].astype(jnp.float32) - ref).max()
        result[name] = (_time_per_call(fn, args), float(err))
    return result


def gpu_table(
    rows_list: list[int], ctxs: list[int], head_dims: list[int], dtype: Any, bandwidth: float
) -> tuple[list[str], str]:
    """Prints and returns the table's lines, and a note on the worst cases."""
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    names = ["jpaged", "ragged", "jax", "dense"]
    lines = [
        "| head_dim | rows | ctx | KV MB | jpaged us (GB/s, %bw) | ragged us (GB/s, %bw) "
        "| JAX us (GB/s, %bw) | dense us (GB/s, %bw) | jpaged / JAX | ragged / jpaged "
        "| max err jpaged, ragged, JAX, dense |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    print(*lines, sep="\n", flush=True)
    ratios: list[float] = []
    ragged_ratios: list[float] = []  # > 1: decode-only steps would gain from the decode kernel
    shares: list[float] = []  # of the copy bandwidth, at >= 64 MB of KV
    wrong: list[str] = []
    for head_dim in head_dims:
        for rows in rows_list:
            for ctx in ctxs:
                r = gpu_case(rows, ctx, head_dim, dtype)
                cells = []
                for name in names:
                    t, err = r[name]
                    gbs = r["kv_bytes"] / t / 1e9
                    cells.append(f"{t * 1e6:.0f} ({gbs:.0f}, {100 * gbs * 1e9 / bandwidth:.0f}%)")
                    if err > tol:
                        wrong.append(f"{name} at D{head_dim} B{rows} ctx{ctx}: {err:.1e}")
                ratios.append(r["jpaged"][0] / r["jax"][0])
                ragged_ratios.append(r["ragged"][0] / r["jpaged"][0])
                if r["kv_bytes"] >= 64 << 20:
                    shares.append(r["kv_bytes"] / r["jpaged"][0] / bandwidth)
                errs = ", ".join(f"{r[name][1]:.1e}" for name in names)
                lines.append(
                    f"| {head_dim} | {rows} | {ctx} | {r['kv_bytes'] / 1e6:.0f} | "
                    + " | ".join(cells)
                    + f" | {ratios[-1]:.2f} | {ragged_ratios[-1]:.2f} | {errs} |"
                )
                print(lines[-1], flush=True)
    worst_share = f"{100 * min(shares):.0f}%" if shares else "-"
    note = (
        f"Copy bandwidth (read + write) {bandwidth / 1e9:.0f} GB/s. Worst jpaged / JAX "
        f"{max(ratios):.2f} (target <= 1.0); ragged / decode kernel {min(ragged_ratios):.2f}-"
        f"{max(ragged_ratios):.2f}; worst jpaged share of the copy bandwidth at "
        f">= 64 MB of KV {worst_share} (target >= 80%). "
        + (f"WRONG (err > {tol}): {'; '.join(wrong)}." if wrong else f"Every output within {tol}.")
    )
    return lines, note


def machine() -> dict[str, str]:
    cpu = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M)
        cpu = m.group(1).strip() if m else platform.processor()
    mem = "unknown"
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        m = re.search(r"^MemTotal:\s*(\d+) kB", meminfo.read_text(), re.M)
        mem = f"{int(m.group(1)) / 2**20:.1f} GiB" if m else mem
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    return {
        "cpu": f"{cpu}, nproc {os.cpu_count()}",
        "memory": mem,
        "jax": f"{jax.__version__} (backend {jax.default_backend()}: {devices})",
        "load": "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg()),
    }


def write_results(heading: str, info: dict[str, str], shape: str, body: list[str]) -> None:
    """Replace only this heading's section of RESULTS.md (up to the next "## ")."""
    section = "\n".join(
        [
            heading,
            "",
            f"- date: {datetime.date.today().isoformat()}",
            "- command: `python -m benchmarks.bench_kernel`",
            f"- machine: {info['cpu']}, {info['memory']} RAM; load average at start {info['load']}",
            f"- JAX {info['jax']}",
            f"- shape: {shape}",
            "",
            *body,
            "",
        ]
    )
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")


def cpu_table(batches: list[int], ctxs: list[int], dtypes: list[str]) -> tuple[list[str], str]:
    """Prints and returns the table's lines, and a note on the worst ratio."""
    header = (
        "| dtype | B | ctx | chunks | paged xla ms | contig one-shot ms | contig chunked ms "
        "| paged / best contig | same, min times | paged GB/s | best contig GB/s |"
    )
    lines = [header, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    print(*lines, sep="\n", flush=True)
    worst = worst_min = 0.0
    for dtype in dtypes:
        for batch in batches:
            for ctx in ctxs:
                r = bench_case(batch, ctx, jnp.dtype(dtype))
                best = min(r["oneshot"], r["chunked"])
                ratio = r["xla"] / best
                ratio_min = r["xla_min"] / min(r["oneshot_min"], r["chunked_min"])
                if ctx >= 1024:
                    worst = max(worst, ratio)
                    worst_min = max(worst_min, ratio_min)
                lines.append(
                    f"| {dtype} | {batch} | {ctx} | {r['chunks']} | {r['xla'] * 1e3:.2f} | "
                    f"{r['oneshot'] * 1e3:.2f} | {r['chunked'] * 1e3:.2f} | {ratio:.2f} | "
                    f"{ratio_min:.2f} | "
                    f"{r['kv_bytes'] / r['xla'] / 1e9:.1f} | {r['kv_bytes'] / best / 1e9:.1f} |"
                )
                print(lines[-1], flush=True)
    note = (
        f"Worst paged / best-contiguous ratio at ctx >= 1024: {worst:.2f} on medians, "
        f"{worst_min:.2f} on minimum times (target <= 1.25). Times are medians of 7-50 "
        "interleaved repeats; the min-time ratio is the one least hurt by other "
        "processes on a shared machine. Pallas not timed: no GPU here (its timings mean "
        "nothing in interpret mode)."
    )
    return lines, note


def main(argv: list[str] | None = None) -> None:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", help="default: CPU 1 8 32; GPU 1 ... 128")
    parser.add_argument(
        "--ctx", type=int, nargs="+", help="default: CPU 256 1024 4096; GPU 512 2048 8192"
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        help="default: CPU bfloat16 float32 (also: uint16, bf16 bits); GPU bfloat16 (one only)",
    )
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], help="GPU only")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    info = machine()
    print(f"# {info['cpu']} | {info['memory']} | JAX {info['jax']} | load {info['load']}")
    if on_gpu:
        bandwidth = copy_bandwidth()
        print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s", flush=True)
        dtype = jnp.dtype((args.dtype or ["bfloat16"])[0])
        lines, note = gpu_table(
            args.batch or [1, 8, 32, 64, 128], args.ctx or [512, 2048, 8192], args.head_dim,
            dtype, bandwidth,
        )  # fmt: skip
        heading, body = GPU_HEADING, ["\n".join(lines), "", note]
        shape = (
            f"{NUM_Q_HEADS} q heads / {NUM_KV_HEADS} kv heads, {dtype.name}, block_size "
            f"{BLOCK_SIZE}, shuffled page tables, each row's last page partly filled"
        )
    else:
        lines, note = cpu_table(
            args.batch or [1, 8, 32], args.ctx or [256, 1024, 4096],
            args.dtype or ["bfloat16", "float32"],
        )  # fmt: skip
        heading, body = HEADING, ["\n".join(lines), "", note, "", READING]
        shape = (
            f"{NUM_Q_HEADS} q heads / {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
            f"block_size {BLOCK_SIZE}, every row at the full context, shuffled page tables"
        )
    print(note)
    if not args.no_write:
        write_results(heading, info, shape, body)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main(sys.argv[1:])
