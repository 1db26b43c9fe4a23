"""Paged decode attention: one query token per sequence attends over its KV pages.

Three implementations behind one signature (`paged_decode_attention`):
- "pallas": a Pallas kernel, one program per (sequence, KV head, context split)
  that handles every query head of that KV head, so K/V pages are read once per
  group. Online softmax over chunks of pages with float32 accumulation; when the
  rows x KV heads are too few to fill the GPU, the context is split across
  programs and their partial softmaxes merged in XLA (flash-decoding). Lowers to
  Triton on GPU; runs with `interpret=True` elsewhere (tests).
- "xla": gather the visible pages and attend with plain jnp.
- `paged_decode_attention_reference`: dense un-paged K/V, for tests only.

Layout follows jpaged's pool: K or V is a pool of blocks
`[num_blocks, num_kv_heads, block_size, head_dim]`; block 0 is the null block
padded page-table entries point at, and masking hides whatever it holds. The
pool may be every layer's at once (`[layers * blocks, ...]`, a view) with tables
offset to a layer's blocks (`kv_pool.layer_blocks`): the layer then reaches the
kernel as data, and no layer slice is ever copied.

The pool's storage (bfloat16 as bits on CPU) and the sliding-window convention:
`jpaged.kernels.common`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jpaged.kernels.common import (
    MASK_VALUE,
    MIN_TILE,
    apply_soft_cap,
    as_float,
    attend_chunk,
    check_window,
    choose_tiles,
    ieee_float32,
    is_concrete,
    on_gpu,
    sm_count,
)

Impl = Literal["auto", "pallas", "xla"]

# Programs to aim for, in waves of the SMs: one wave leaves SMs idle behind the slowest.
_WAVES = 2
# Pallas context splits; None = `num_splits(...)`. Tests force a count.
_PALLAS_SPLITS: int | None = None
# XLA path: gathered K (or V) bytes per chunk, and at most this many chunks (each
# one unrolls into the graph: ~0.3 s more XLA CPU compile per chunk).
_XLA_CHUNK_BYTES = 4 << 20
_XLA_MAX_CHUNKS = 8


def _window_start(
    context_lens: jax.Array,  # int32 [B]
    sliding_window: jax.Array | None,  # int32 []
) -> jax.Array:  # int32 [B], first visible position
    if sliding_window is None:
        return jnp.zeros_like(context_lens)
    return jnp.maximum(context_lens - sliding_window, 0)


# --------------------------------------------------------------------------- pallas


def num_splits(rows: int, num_kv_heads: int, num_chunks: int, sms: int) -> int:
    """Context splits per (row, KV head): enough programs for `_WAVES` waves of the
    SMs, 1 when rows x heads already fill them, never more than the table's chunks.
    Static shapes only (the rows bucket, the table width), so no batch recompiles."""
    programs = rows * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(num_chunks, -(-_WAVES * sms // programs)))


def _paged_decode_kernel(
    q_ref: Any,  # [group_tile, head_dim]
    k_ref: Any,  # [num_blocks, block_size, head_dim], this program's KV head
    v_ref: Any,  # [num_blocks, block_size, head_dim]
    tables_ref: Any,  # [table_width], padded to a multiple of pages_per_chunk
    bounds_ref: Any,  # [2] = (first visible position, context_len)
    o_ref: Any,  # [group_tile, head_dim], normalised over this split's tokens
    *stats_refs: Any,  # split runs only: max and sum of exp, each f32 [group_tile]
    scale: float,
    soft_cap: float | None,
    pages_per_chunk: int,
    chunks_per_split: int,
) -> None:
    group_tile, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    chunk = pages_per_chunk * block_size
    start = bounds_ref[0]
    length = bounds_ref[1]
    q = q_ref[...]

    def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        # every chunk in [lo, hi) holds a visible position, so the max is a real logit
        return attend_chunk(
            q, k_ref, v_ref, tables_ref, c, carry,
            lambda pos: ((pos >= start) & (pos < length))[None, :],
            pages_per_chunk=pages_per_chunk, scale=scale, soft_cap=soft_cap,
        )  # fmt: skip

    # This split's chunks that overlap [start, length): splits wholly before the
    # window or past the context, and the padded tail of the table, do no work.
    # context_len is clipped to the table, so hi never passes its last chunk.
    split = pl.program_id(2)
    lo = jnp.maximum(start // chunk, split * chunks_per_split)
    hi = jnp.minimum(pl.cdiv(length, chunk), (split + 1) * chunks_per_split)
    init = (
        jnp.zeros((group_tile, head_dim), jnp.float32),
        jnp.full((group_tile,), MASK_VALUE, jnp.float32),
        jnp.zeros((group_tile,), jnp.float32),
    )
    o, m, denom = lax.fori_loop(lo, hi, body, init)
    # denom == 0 only when nothing is visible (context_len 0, or an empty split):
    # emit zeros, not NaN.
    safe = jnp.where(denom > 0, denom, 1.0)
    o_ref[...] = jnp.where((denom > 0)[:, None], o / safe[:, None], 0.0).astype(o_ref.dtype)
    if stats_refs:
        m_ref, denom_ref = stats_refs
        m_ref[...] = m
        denom_ref[...] = denom


def _merge_splits(
    o: jax.Array,  # f32 [B, Hkv, S, G, D], each split normalised over its own tokens
    m: jax.Array,  # f32 [B, Hkv, S, G], each split's max logit (MASK_VALUE if empty)
    denom: jax.Array,  # f32 [B, Hkv, S, G], each split's sum of exp(logit - m)
) -> jax.Array:  # f32 [B, Hkv, G, D]
    # Empty splits weigh 0 (denom 0); a row with nothing visible gets zeros, not NaN.
    weight = denom * jnp.exp(m - m.max(axis=2, keepdims=True))
    total = weight.sum(axis=2)
    out = (weight[..., None] * o).sum(axis=2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _pallas_impl(
    q: jax.Array,  # [B, Hq, D]
    k_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    v_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    block_tables: jax.Array,  # int32 [B, W]
    bounds: jax.Array,  # int32 [B, 2] = (first visible position, context_len)
    *,
    scale: float,
    soft_cap: float | None,
    interpret: bool,
    splits: int | None,
) -> jax.Array:  # [B, Hq, D]
    k_pool, v_pool = as_float(k_pool), as_float(v_pool)
    batch, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    # tl.dot needs >= 16 rows; padded query heads are computed and dropped.
    group_tile = max(MIN_TILE, pl.next_power_of_2(group))
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    if group_tile != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_tile - group), (0, 0)))
    tiles = choose_tiles(head_dim, k_pool.dtype.itemsize, block_size, group_tile)
    pages_per_chunk = tiles.chunk_tokens // block_size
    width = block_tables.shape[1]
    if width % pages_per_chunk:
        # Padded entries point at the null block and lie past every context_len.
        pad = pages_per_chunk - width % pages_per_chunk
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
        width += pad
    num_chunks = width // pages_per_chunk
    splits = splits or num_splits(batch, num_kv_heads, num_chunks, sm_count())
    chunks_per_split = -(-num_chunks // splits)
    splits = -(-num_chunks // chunks_per_split)  # drop splits left with no chunk

    kernel = functools.partial(
        _paged_decode_kernel, scale=scale, soft_cap=soft_cap, pages_per_chunk=pages_per_chunk,
        chunks_per_split=chunks_per_split,
    )  # fmt: skip
    pool_spec = pl.BlockSpec((num_blocks, None, block_size, head_dim), lambda b, h, s: (0, h, 0, 0))
    split_shape = (batch, num_kv_heads, splits, group_tile)
    # One split writes the answer; several write f32 partials and their softmax stats.
    out_dtype = q.dtype if splits == 1 else jnp.float32
    out_shape = [jax.ShapeDtypeStruct((*split_shape, head_dim), out_dtype)]
    out_specs = [
        pl.BlockSpec((None, None, None, group_tile, head_dim), lambda b, h, s: (b, h, s, 0, 0))
    ]
    if splits > 1:
        stats_spec = pl.BlockSpec((None, None, None, group_tile), lambda b, h, s: (b, h, s, 0))
        out_shape += [jax.ShapeDtypeStruct(split_shape, jnp.float32)] * 2
        out_specs += [stats_spec] * 2
    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, None, group_tile, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pool_spec,
            pool_spec,
            pl.BlockSpec((None, width), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, 2), lambda b, h, s: (b, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=tiles.num_stages),
        name="jpaged_paged_decode_attention",
    )(qg, k_pool, v_pool, block_tables, bounds)
    # Drop the padded query heads first, so the merge never reads them.
    o, *stats = (x[:, :, :, :group] for x in outs)
    out = o[:, :, 0] if splits == 1 else _merge_splits(o, *stats).astype(q.dtype)
    return out.reshape(batch, num_q_heads, head_dim)


# --------------------------------------------------------------------------- xla


def _gather_pages(
    pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    block_tables: jax.Array,  # int32 [B, W]
) -> jax.Array:  # [B, Hkv, W * block_size, D], float
    _, num_kv_heads, block_size, head_dim = pool.shape
    batch, width = block_tables.shape
    # Gather straight into [B, Hkv, W, block_size, D] (offset dims 1, 3, 4) so the
    # attention einsums see head-major K/V without a separate transpose copy.
    dnums = lax.GatherDimensionNumbers(
        offset_dims=(1, 3, 4), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    pages = lax.gather(
        pool,
        block_tables[..., None],
        dnums,
        slice_sizes=(1, num_kv_heads, block_size, head_dim),
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )
    return as_float(pages).reshape(batch, num_kv_heads, width * block_size, head_dim)


# (k [B, Hkv, T, D], v_fn) for tokens [t0, t1); `fence` [B] is 0 but data-dependent.
Fetch = Callable[[int, int, jax.Array], tuple[jax.Array, Callable[[jax.Array], jax.Array]]]


def xla_chunks(
    kv_bytes: int, num_pages: int, chunk_bytes: int | None = None, max_chunks: int | None = None
) -> int:
    """How many chunks the XLA path splits `kv_bytes` of gathered K (or V) into."""
    chunk_bytes, max_chunks = chunk_bytes or _XLA_CHUNK_BYTES, max_chunks or _XLA_MAX_CHUNKS
    return max(1, min(num_pages, max_chunks, -(-kv_bytes // chunk_bytes)))


def _split_attend(
    q: jax.Array,  # [B, Hq, D]
    fetch: Fetch,
    bounds: jax.Array,  # int32 [B, 2] = (first visible position, context_len)
    edges: list[int],  # token offsets of the chunk boundaries, 0 ... S
    *,
    scale: float,
    soft_cap: float | None,
) -> jax.Array:  # [B, Hq, D]
    """Attention over static token chunks, merged flash-decoding style.

    On CPU a single gather of every visible page costs a fresh temp buffer the size
    of the whole K (then V) on every call, and buffers past glibc's mmap threshold
    are page-faulted in each time. Chunks of a few MB are cache-sized and reused.
    Each fetch takes a fake data dependency (`fence`: x > inf is never true) on the
    previous chunk's result, so XLA runs the chunks in order and reuses one buffer
    instead of hoisting every gather to the front. No `lax` loop on purpose: XLA CPU
    hoists a whole-pool f32 convert of a bf16 pool out of any loop.
    """
    batch, num_q_heads, head_dim = q.shape
    start, length = bounds[:, :1], bounds[:, 1:]  # [B, 1]
    fence = jnp.zeros((batch,), jnp.int32)
    parts = []
    for t0, t1 in zip(edges[:-1], edges[1:], strict=True):
        k, get_v = fetch(t0, t1, fence)
        num_kv_heads = k.shape[1]
        qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        logits = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32)
        logits = apply_soft_cap(logits * scale, soft_cap)
        pos = jnp.arange(t0, t1)
        visible = ((pos >= start) & (pos < length))[:, None, None, :]  # [B, 1, 1, T]
        logits = jnp.where(visible, logits, MASK_VALUE)
        m = logits.max(axis=-1)  # [B, Hkv, G]
        v = get_v((m[:, 0, 0] > jnp.inf).astype(jnp.int32))
        p = jnp.where(visible, jnp.exp(logits - m[..., None]), 0.0)  # all-masked: 0, not 1
        o = jnp.einsum("bhgt,bhtd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        parts.append((o, m, p.sum(axis=-1)))
        fence = (o[:, 0, 0, 0] > jnp.inf).astype(jnp.int32)
    m_all = functools.reduce(jnp.maximum, [m for _, m, _ in parts])
    o_all = sum(jnp.exp(m - m_all)[..., None] * o for o, m, _ in parts)
    denom = sum(jnp.exp(m - m_all) * d for _, m, d in parts)
    # denom == 0 only when nothing is visible (context_len 0): zeros, not NaN.
    out = o_all / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def _xla_impl(
    q: jax.Array,  # [B, Hq, D]
    k_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    v_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    block_tables: jax.Array,  # int32 [B, W]
    bounds: jax.Array,  # int32 [B, 2]
    *,
    scale: float,
    soft_cap: float | None,
    chunk_bytes: int,
    max_chunks: int,
) -> jax.Array:  # [B, Hq, D]
    batch, width = block_tables.shape
    _, num_kv_heads, block_size, head_dim = k_pool.shape
    kv_bytes = batch * width * num_kv_heads * block_size * head_dim * k_pool.dtype.itemsize
    n = xla_chunks(kv_bytes, width, chunk_bytes, max_chunks)
    page_edges = [round(i * width / n) for i in range(n + 1)]

    def fetch(t0: int, t1: int, fence: jax.Array) -> tuple[jax.Array, Any]:
        tables = block_tables[:, t0 // block_size : t1 // block_size]
        k = _gather_pages(k_pool, tables + fence[:, None])
        return k, lambda fence_v: _gather_pages(v_pool, tables + fence_v[:, None])

    edges = [e * block_size for e in page_edges]
    return _split_attend(q, fetch, bounds, edges, scale=scale, soft_cap=soft_cap)


def contiguous_decode_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k: jax.Array,  # [B, num_kv_heads, S, head_dim], dense per-row cache
    v: jax.Array,  # [B, num_kv_heads, S, head_dim]
    context_lens: jax.Array,  # int32 [B]
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    num_chunks: int = 1,
) -> jax.Array:  # [B, num_q_heads, head_dim]
    """The "xla" path's math over a contiguous cache, in `num_chunks` token slices:
    the baseline of the kernel benchmark."""
    seq = k.shape[2]
    lens = context_lens.astype(jnp.int32)
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32)
    bounds = jnp.stack([_window_start(lens, window), lens], axis=-1)

    def fetch(t0: int, t1: int, fence: jax.Array) -> tuple[jax.Array, Any]:
        # Dynamic slices so the fences order the chunks here too.
        cut = lambda x, f: lax.dynamic_slice_in_dim(x, t0 + f[0], t1 - t0, axis=2)
        return cut(k, fence), lambda fence_v: cut(v, fence_v)

    edges = [round(i * seq / num_chunks) for i in range(num_chunks + 1)]
    with ieee_float32(q.dtype):
        return _split_attend(q, fetch, bounds, edges, scale=scale, soft_cap=soft_cap)


# --------------------------------------------------------------------------- public


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "soft_cap", "impl", "interpret", "chunk_bytes", "max_chunks", "splits"
    ),
)  # fmt: skip
def _paged_decode_attention_jit(
    q: jax.Array,  # [B, Hq, D]
    k_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    v_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    block_tables: jax.Array,  # int [B, W]
    context_lens: jax.Array,  # int [B]
    sliding_window: jax.Array | None,  # int32 []
    *,
    scale: float,
    soft_cap: float | None,
    impl: str,
    interpret: bool,
    chunk_bytes: int,
    max_chunks: int,
    splits: int | None,
) -> jax.Array:  # [B, Hq, D]
    block_tables = block_tables.astype(jnp.int32)
    # Clamp so a row never reads past its own table.
    lens = jnp.clip(context_lens.astype(jnp.int32), 0, block_tables.shape[1] * k_pool.shape[2])
    bounds = jnp.stack([_window_start(lens, sliding_window), lens], axis=-1)
    if impl == "pallas":
        return _pallas_impl(
            q, k_pool, v_pool, block_tables, bounds,
            scale=scale, soft_cap=soft_cap, interpret=interpret, splits=splits,
        )  # fmt: skip
    with ieee_float32(q.dtype):
        return _xla_impl(
            q, k_pool, v_pool, block_tables, bounds,
            scale=scale, soft_cap=soft_cap, chunk_bytes=chunk_bytes, max_chunks=max_chunks,
        )  # fmt: skip


def _check_common(
    q: Any, k_pool: Any, v_pool: Any, context_lens: Any, scale: Any, soft_cap: Any
) -> None:
    """What every decode attention validates: the query, one layer's pools, the lengths."""
    if np.ndim(q) != 3:
        raise ValueError(f"q must be [B, num_q_heads, head_dim], got shape {np.shape(q)}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be float, got {q.dtype}")
    if np.ndim(k_pool) != 4:
        raise ValueError(
            f"k_pool must be [num_blocks, num_kv_heads, block_size, head_dim], "
            f"got shape {np.shape(k_pool)}"
        )
    if np.shape(v_pool) != np.shape(k_pool):
        raise ValueError(f"v_pool shape {np.shape(v_pool)} != k_pool shape {np.shape(k_pool)}")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"v_pool dtype {v_pool.dtype} != k_pool dtype {k_pool.dtype}")
    if not (jnp.issubdtype(k_pool.dtype, jnp.floating) or k_pool.dtype == jnp.uint16):
        raise ValueError(f"k_pool must be float (or uint16 bf16 bits), got {k_pool.dtype}")
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, pool_head_dim = k_pool.shape
    if pool_head_dim != head_dim:
        raise ValueError(f"k_pool head_dim {pool_head_dim} != q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"q num_q_heads {num_q_heads} must be a multiple of k_pool num_kv_heads {num_kv_heads}"
        )
    if np.shape(context_lens) != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {np.shape(context_lens)}")
    if not jnp.issubdtype(context_lens.dtype, jnp.integer):
        raise ValueError(f"context_lens must be integer, got {context_lens.dtype}")
    if is_concrete(context_lens) and bool((np.asarray(context_lens) < 0).any()):
        raise ValueError(f"context_lens must be >= 0, got {np.asarray(context_lens)}")
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise ValueError(f"scale must be a Python float, got {scale!r}")
    if soft_cap is not None and (not isinstance(soft_cap, int | float) or soft_cap <= 0):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")


def _check_inputs(
    q: Any, k_pool: Any, v_pool: Any, block_tables: Any, context_lens: Any, scale: Any,
    soft_cap: Any, impl: str,
) -> None:  # fmt: skip
    _check_common(q, k_pool, v_pool, context_lens, scale, soft_cap)
    batch, num_blocks = q.shape[0], k_pool.shape[0]
    if np.ndim(block_tables) != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks], got {np.shape(block_tables)}"
        )
    if not jnp.issubdtype(block_tables.dtype, jnp.integer):
        raise ValueError(f"block_tables must be integer, got {block_tables.dtype}")
    if block_tables.shape[1] > num_blocks:
        raise ValueError(
            f"block_tables width {block_tables.shape[1]} exceeds the pool's {num_blocks} blocks"
        )
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"impl must be 'auto', 'pallas' or 'xla', got {impl!r}")


def paged_decode_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k_pool: jax.Array,  # [num_blocks, num_kv_heads, block_size, head_dim], one layer
    v_pool: jax.Array,  # [num_blocks, num_kv_heads, block_size, head_dim], one layer
    block_tables: jax.Array,  # int32 [B, max_blocks], padded with the null block 0
    context_lens: jax.Array,  # int32 [B], tokens visible incl. the current one; 0 = pad row
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    impl: Impl = "auto",
    interpret: bool | None = None,
) -> jax.Array:  # [B, num_q_heads, head_dim] in q's dtype
    """softmax(soft_cap(scale * q·k)) · v over each row's visible pages.

    `sliding_window` (None, a positive int, or a traced int scalar) keeps the last
    `sliding_window` tokens. The pools may be any float dtype, or uint16 holding
    bfloat16 bits (computed as bfloat16; see `jpaged.kernels.common` on XLA CPU).
    `impl`: "auto" = "pallas" on GPU, "xla" elsewhere. `interpret` (pallas only):
    None = interpret unless on GPU. Rows with context_len 0 return zeros.
    """
    _check_inputs(q, k_pool, v_pool, block_tables, context_lens, scale, soft_cap, impl)
    window = check_window(sliding_window)
    if impl == "auto":
        impl = "pallas" if on_gpu() else "xla"
    if interpret is None:
        interpret = not on_gpu()
    return _paged_decode_attention_jit(
        q, k_pool, v_pool, block_tables, context_lens, window,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        impl=impl,
        interpret=bool(interpret),
        chunk_bytes=_XLA_CHUNK_BYTES,  # module globals, so tests can shrink them
        max_chunks=_XLA_MAX_CHUNKS,
        splits=_PALLAS_SPLITS,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def paged_decode_attention_reference(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k: jax.Array,  # [B, S, num_kv_heads, head_dim], dense un-paged
    v: jax.Array,  # [B, S, num_kv_heads, head_dim]
    context_lens: jax.Array,  # int32 [B]
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [B, num_q_heads, head_dim]
    """Plain float32 softmax attention over dense K/V, written independently of the kernels."""
    batch, num_q_heads, head_dim = q.shape
    seq, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    kf = jnp.repeat(k.astype(jnp.float32), group, axis=2)  # [B, S, Hq, D]
    vf = jnp.repeat(v.astype(jnp.float32), group, axis=2)
    logits = jnp.einsum("bhd,bshd->bhs", q.astype(jnp.float32), kf, precision=lax.Precision.HIGHEST)
    logits = logits * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    j = jnp.arange(seq)[None, :]
    p_pos = context_lens[:, None] - 1  # the query's position
    visible = j <= p_pos
    if sliding_window is not None:
        visible &= j > p_pos - sliding_window
    logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
    any_visible = visible.any(axis=-1)[:, None, None]
    weights = jax.nn.softmax(jnp.where(any_visible, logits, 0.0), axis=-1)
    out = jnp.einsum("bhs,bshd->bhd", weights, vf, precision=lax.Precision.HIGHEST)
    out = jnp.where(any_visible, out, 0.0)
    return out.astype(q.dtype)
