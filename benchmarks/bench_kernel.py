"""Decode-only steps of the engine's attention: a paged pool vs a contiguous cache.

    python -m benchmarks.bench_kernel [--no-write]

Every row is a sequence of one new token (a decode-only step) through
`ragged_paged_attention`, the one attention the engine runs.

On CPU: times its jitted "xla" path (the CPU serving path) against the same attention
over a dense per-row cache at the same lengths (`dense_attention`), block_until_ready,
warm-up excluded, median of repeats with the two interleaved so machine load hits both
alike. KV bytes/s counts the K and V bytes each call must read (B * ctx * Hkv * D * 2 *
itemsize).

On a GPU: its Pallas kernel with the context splits the bucket gets and with none, JAX's
own paged kernel (`jax.experimental.pallas.ops.gpu.paged_attention`, k_splits=16) and
`dense_attention` over the same K/V gathered once into a contiguous cache, each checked
against the dense reference; microseconds per call (median of 7 runs of 20 back-to-back calls), KV
GB/s and % of the device copy bandwidth measured in the same run (the ceiling: a decode
step reads each K/V byte once). Shuffled pages, every row's last page partly filled; KV
bytes count the tokens really held. The method of the GPU numbers in issue 11.

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

from jpaged.cache.kv_pool import quantize
from jpaged.dtypes import KV_QUANT
from jpaged.kernels import ragged_attention, ragged_plan
from jpaged.kernels.ragged_attention import ragged_paged_attention
from jpaged.kernels.ragged_plan import Ragged

# an int8 cache moves attention outputs of N(0, 1) values by ~1% (test_ragged_attention)
QUANT_TOL = 0.1
# The Mosaic GPU kernel's error bound: timed in bfloat16 even for float32 shapes (`gpu_case`)
MOSAIC_TOL = 2e-2
HEADING = "## Kernel on a CPU: decode-only steps, paged vs a dense cache (issue 22)"
READING = (
    "How to read it: the XLA path walks each row's pages as (page, token) work items, a "
    "cache-sized chunk of them per loop iteration, merging partial softmaxes per token; "
    '"dense" is the same grouped attention over a contiguous [B, Hkv, ctx, D] cache, so '
    "the ratio is what paging costs on a CPU. B=1 pays the gathers with little work to "
    "hide them behind. uint16: bfloat16 values stored as their bits, as the engine's pool "
    "is on a CPU (a bfloat16 pool makes XLA CPU convert it whole inside the loop)."
)
GPU_HEADING = "## Kernel on a GPU: the ragged kernel on decode-only steps vs JAX's (issue 22)"
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


def decode_meta(lens: np.ndarray, tables: np.ndarray, impl: str) -> Ragged:
    """A decode-only step: each of the rows one new token, at its last position; on the
    device, as a step's meta is (host arrays would be copied in every timed call)."""
    rows, width = tables.shape
    meta = ragged_plan.plan(
        np.ones(rows, np.int32),
        lens,
        tables,
        num_tokens=rows,
        num_seqs=rows,
        width=width,
        block_size=BLOCK_SIZE,
        impl=impl,
    )
    return Ragged(*(jnp.asarray(a) for a in meta))


def dense_attention(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, S, D], a contiguous cache
    v: jax.Array,  # [B, Hkv, S, D]
    lens: jax.Array,  # int32 [B]: keys each row sees
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, D]
    """Grouped attention over a contiguous cache, each K/V byte read once (the query heads
    of a KV head are the rows of one dot, as in the kernel)."""
    batch, num_q_heads, head_dim = q.shape
    qg = q.reshape(batch, k.shape[1], -1, head_dim)
    f32 = jnp.float32
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=f32) * scale
    logits = jnp.where(jnp.arange(k.shape[2]) < lens[:, None, None, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgs,bhsd->bhgd", p, v, preferred_element_type=f32)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def quantized_pools(
    k_pool: jax.Array, v_pool: jax.Array, kv_dtype: str, scale_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The pools in a 1-byte KV dtype, and their scales."""
    (k, ks), (v, vs) = (quantize(p, KV_QUANT[kv_dtype][0], scale_dtype) for p in (k_pool, v_pool))
    return k, v, ks, vs


def bench_case(batch: int, ctx: int, dtype: str) -> dict[str, Any]:
    """`dtype`: the pool's, float32, bfloat16, uint16 (bf16 bits in the pool, the
    XLA-CPU-friendly storage, see jpaged.kernels.common) or a 1-byte KV dtype (float32
    scales, as on a CPU; the dense cache then float32)."""
    kv_dtype = dtype if dtype in KV_QUANT else None
    bits = dtype == "uint16"
    pool_dtype = jnp.dtype(jnp.bfloat16 if bits else jnp.float32 if kv_dtype else dtype)
    rng = np.random.default_rng(0)
    width = ctx // BLOCK_SIZE
    num_blocks = batch * width + 1  # + the null block
    pool_shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    q = jnp.asarray(rng.standard_normal((batch, NUM_Q_HEADS, HEAD_DIM)), pool_dtype)
    k_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), pool_dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), pool_dtype)
    k_scale = v_scale = None
    if bits:
        k_pool, v_pool = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k_pool, v_pool))
    if kv_dtype is not None:
        k_pool, v_pool, k_scale, v_scale = quantized_pools(k_pool, v_pool, kv_dtype, pool_dtype)
    # Shuffled pages: a row's blocks are scattered over the pool, as after churn.
    tables = 1 + rng.permutation(batch * width).reshape(batch, width).astype(np.int32)
    lens = np.full(batch, ctx, np.int32)
    dense_shape = (batch, NUM_KV_HEADS, ctx, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(dense_shape, np.float32), pool_dtype)
    v = jnp.asarray(rng.standard_normal(dense_shape, np.float32), pool_dtype)
    scale = HEAD_DIM**-0.5

    def ragged(q: jax.Array, k: jax.Array, v: jax.Array, meta: Ragged) -> jax.Array:
        return ragged_paged_attention(
            q, k, v, meta, scale=scale, impl="xla", k_scale=k_scale, v_scale=v_scale
        )[0]

    fns: dict[str, tuple[Callable[..., Any], tuple]] = {
        "ragged": (jax.jit(ragged), (q, k_pool, v_pool, decode_meta(lens, tables, "xla"))),
        "dense": (
            jax.jit(functools.partial(dense_attention, scale=scale)),
            (q, k, v, jnp.asarray(lens)),
        ),
    }
    # ~2 s of timing per case, 7 to 50 repeats.
    probe = _time({"ragged": fns["ragged"]}, 1)["ragged"][0]
    repeats = int(min(50, max(7, 2.0 / max(probe, 1e-4))))
    times = _time(fns, repeats)
    # the bytes the paged path reads (1-byte values and their scales, if quantized)
    itemsize = pool_dtype.itemsize
    per_token = (HEAD_DIM + itemsize) if kv_dtype else HEAD_DIM * itemsize
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * per_token
    result: dict[str, Any] = {name: statistics.median(ts) for name, ts in times.items()}
    result.update({f"{name}_min": min(ts) for name, ts in times.items()})
    return dict(result, kv_bytes=kv_bytes, repeats=repeats)


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


def gpu_case(
    rows: int, ctx: int, head_dim: int, dtype: Any, kv_dtype: str = "int8"
) -> dict[str, Any]:
    """The ragged kernel (split as its bucket is, and unsplit, and on the same pages in a
    1-byte `kv_dtype`; split, under Mosaic GPU too), JAX's kernel and dense attention on
    one decode-only shape: seconds per call and max |error| against the dense float32
    reference on the first rows."""
    rng = np.random.default_rng(rows * 7919 + ctx)
    width = ctx // BLOCK_SIZE
    pool_shape = (rows * width + 1, NUM_KV_HEADS, BLOCK_SIZE, head_dim)  # + the null block
    k_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape, np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((rows, NUM_Q_HEADS, head_dim), np.float32), dtype)
    tables = 1 + rng.permutation(rows * width).reshape(rows, width).astype(np.int32)
    lens = rng.integers(ctx - BLOCK_SIZE + 1, ctx, size=rows).astype(np.int32)
    scale = head_dim**-0.5
    interpret = jax.default_backend() != "gpu"  # the smoke test runs this on CPU

    def dense(pool: jax.Array) -> jax.Array:  # [rows, Hkv, ctx, D], gathered once, untimed
        return jnp.swapaxes(pool[tables], 1, 2).reshape(rows, NUM_KV_HEADS, ctx, head_dim)

    def jax_kernel(q: jax.Array, k: jax.Array, v: jax.Array, t: jax.Array, n: jax.Array) -> Any:
        return jax_paged.paged_attention(
            q * jnp.asarray(scale, q.dtype),
            k,
            v,
            t,
            n,
            k_splits=math.gcd(JAX_K_SPLITS, width),
            interpret=interpret,
        )

    def ragged(splits: int | None, lowering: str = "triton") -> Callable[..., jax.Array]:
        return jax.jit(
            lambda q, k, v, meta: ragged_paged_attention(
                q,
                k,
                v,
                meta,
                scale=scale,
                impl="pallas",
                interpret=interpret,
                splits=splits,
                lowering=lowering,
            )[0]
        )

    meta = decode_meta(lens, tables, "pallas")
    k_dense, v_dense = dense(k_pool), dense(v_pool)
    # JAX's kernel wants [Hkv, pages, page_size, D]: transposed once, untimed.
    k_heads, v_heads = jnp.swapaxes(k_pool, 0, 1), jnp.swapaxes(v_pool, 0, 1)
    n_lens = jnp.asarray(lens)
    k_q, v_q, k_s, v_s = quantized_pools(k_pool, v_pool, kv_dtype, dtype)
    quantized = jax.jit(
        lambda q, k, v, ks, vs, meta: ragged_paged_attention(
            q,
            k,
            v,
            meta,
            scale=scale,
            k_scale=ks,
            v_scale=vs,
            impl="pallas",
            interpret=interpret,
        )[0]
    )
    # Mosaic's wgmma takes 16-bit operands: float32 shapes (a CPU's) run it in bfloat16
    half = dtype if jnp.dtype(dtype).itemsize == 2 else jnp.bfloat16
    fns: dict[str, tuple[Callable[..., Any], tuple]] = {
        "ragged": (ragged(None), (q, k_pool, v_pool, meta)),
        "mosaic": (ragged(None, "mosaic"), (*(a.astype(half) for a in (q, k_pool, v_pool)), meta)),
        "unsplit": (ragged(1), (q, k_pool, v_pool, meta)),
        "quantized": (quantized, (q, k_q, v_q, k_s, v_s, meta)),
        "jax": (jax.jit(jax_kernel), (q, k_heads, v_heads, jnp.asarray(tables), n_lens)),
        "dense": (
            jax.jit(functools.partial(dense_attention, scale=scale)),
            (q, k_dense, v_dense, n_lens),
        ),
    }
    n = min(rows, CHECK_ROWS)
    check = decode_meta(lens[:n], tables[:n], "xla")
    ref = ragged_attention.ragged_paged_attention_reference(
        q[:n].astype(jnp.float32),
        k_pool,
        v_pool,
        jnp.asarray(check.seq_of),
        jnp.asarray(check.positions),
        jnp.asarray(check.block_tables),
        scale=scale,
    )
    tokens = int(lens.sum()) * NUM_KV_HEADS * 2  # K and V head vectors read
    result: dict[str, Any] = {
        "kv_bytes": tokens * head_dim * q.dtype.itemsize,
        "quantized_bytes": tokens * (head_dim + q.dtype.itemsize),  # values + scales
    }
    for name, (fn, args) in fns.items():
        try:
            err = jnp.abs(fn(*args)[:n].astype(jnp.float32) - ref).max()
        except Exception as e:  # one column's failure (a lowering on a new card) is a finding
            print(f"{name} at B{rows} ctx{ctx} D{head_dim} failed: {e!r:.600}", flush=True)
            result[name] = (math.nan, math.nan)
            continue
        # interpreted, Mosaic simulates every thread and copy: one call, not a median
        few = {"calls": 1, "runs": 1} if interpret and name == "mosaic" else {}
        result[name] = (_time_per_call(fn, args, **few), float(err))
    return result


def gpu_table(
    rows_list: list[int], ctxs: list[int], head_dims: list[int], dtype: Any, bandwidth: float
) -> tuple[list[str], str]:
    """Prints and returns the table's lines, and a note on the worst cases."""
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    names = ["ragged", "mosaic", "unsplit", "jax", "dense", "quantized"]
    tols = {"quantized": QUANT_TOL, "mosaic": max(tol, MOSAIC_TOL)}
    lines = [
        "| head_dim | rows | ctx | KV MB | ragged us (GB/s, %bw) | Mosaic us (GB/s, %bw) "
        "| unsplit us (GB/s, %bw) | JAX us (GB/s, %bw) | dense us (GB/s, %bw) "
        "| int8 pages us (GB/s, %bw) | ragged / JAX | ragged / Mosaic | ragged / unsplit "
        "| ragged / int8 | max err ragged, Mosaic, unsplit, JAX, dense, int8 |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    print(*lines, sep="\n", flush=True)
    ratios: list[float] = []
    lowerings: list[float] = []  # > 1: Mosaic GPU's kernel faster than Triton's
    split_gains: list[float] = []  # < 1: the bucket's splits pay
    shares: list[float] = []  # of the copy bandwidth, at >= 64 MB of KV
    wrong: list[str] = []
    for head_dim in head_dims:
        for rows in rows_list:
            for ctx in ctxs:
                r = gpu_case(rows, ctx, head_dim, dtype)
                cells = []
                for name in names:
                    t, err = r[name]
                    read = r["quantized_bytes" if name == "quantized" else "kv_bytes"]
                    gbs = read / t / 1e9
                    cells.append(f"{t * 1e6:.0f} ({gbs:.0f}, {100 * gbs * 1e9 / bandwidth:.0f}%)")
                    if not err <= tols.get(name, tol):  # NaN: failed
                        wrong.append(f"{name} at D{head_dim} B{rows} ctx{ctx}: {err:.1e}")
                ratios.append(r["ragged"][0] / r["jax"][0])
                lowerings.append(r["ragged"][0] / r["mosaic"][0])
                split_gains.append(r["ragged"][0] / r["unsplit"][0])
                if r["kv_bytes"] >= 64 << 20:
                    shares.append(r["kv_bytes"] / r["ragged"][0] / bandwidth)
                errs = ", ".join(f"{r[name][1]:.1e}" for name in names)
                lines.append(
                    f"| {head_dim} | {rows} | {ctx} | {r['kv_bytes'] / 1e6:.0f} | "
                    + " | ".join(cells)
                    + f" | {ratios[-1]:.2f} | {lowerings[-1]:.2f} "
                    f"| {split_gains[-1]:.2f} | "
                    f"{r['ragged'][0] / r['quantized'][0]:.2f} | {errs} |"
                )
                print(lines[-1], flush=True)
    worst_share = f"{100 * min(shares):.0f}%" if shares else "-"
    note = (
        f"Copy bandwidth (read + write) {bandwidth / 1e9:.0f} GB/s. Worst ragged / JAX "
        f"{max(ratios):.2f} (target <= 1.0); ragged (Triton) / Mosaic {min(lowerings):.2f}-"
        f"{max(lowerings):.2f} (> 1: Mosaic faster); ragged / unsplit {min(split_gains):.2f}-"
        f"{max(split_gains):.2f}; worst ragged share of the copy bandwidth at "
        f">= 64 MB of KV {worst_share} (target >= 80%). "
        + (
            f"WRONG (err > {tol}, Mosaic's {tols['mosaic']}): {'; '.join(wrong)}."
            if wrong
            else f"Every output within {tol} (Mosaic's {tols['mosaic']})."
        )
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
        "| dtype | B | ctx | ragged xla ms | dense ms | ragged / dense | same, min times "
        "| ragged GB/s | dense GB/s |"
    )
    lines = [header, "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    print(*lines, sep="\n", flush=True)
    worst = worst_min = 0.0
    for dtype in dtypes:
        for batch in batches:
            for ctx in ctxs:
                r = bench_case(batch, ctx, dtype)
                ratio = r["ragged"] / r["dense"]
                ratio_min = r["ragged_min"] / r["dense_min"]
                if ctx >= 1024:
                    worst = max(worst, ratio)
                    worst_min = max(worst_min, ratio_min)
                lines.append(
                    f"| {dtype} | {batch} | {ctx} | {r['ragged'] * 1e3:.2f} | "
                    f"{r['dense'] * 1e3:.2f} | {ratio:.2f} | {ratio_min:.2f} | "
                    f"{r['kv_bytes'] / r['ragged'] / 1e9:.1f} | "
                    f"{r['kv_bytes'] / r['dense'] / 1e9:.1f} |"
                )
                print(lines[-1], flush=True)
    note = (
        f"Worst ragged / dense ratio at ctx >= 1024: {worst:.2f} on medians, "
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
        help="default: CPU uint16 (bf16 bits, as the engine stores bf16 pools on a CPU) float32 "
        "(also: bfloat16, and the 1-byte KV dtypes int8, fp8_e4m3, fp8_e5m2 with float32 "
        "scales); GPU bfloat16 (one only)",
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
            args.batch or [1, 8, 32, 64, 128],
            args.ctx or [512, 2048, 8192],
            args.head_dim,
            dtype,
            bandwidth,
        )
        heading, body = GPU_HEADING, ["\n".join(lines), "", note]
        shape = (
            f"{NUM_Q_HEADS} q heads / {NUM_KV_HEADS} kv heads, {dtype.name}, block_size "
            f"{BLOCK_SIZE}, shuffled page tables, each row's last page partly filled"
        )
    else:
        lines, note = cpu_table(
            args.batch or [1, 8, 32],
            args.ctx or [256, 1024, 4096],
            args.dtype or ["uint16", "float32"],
        )
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
