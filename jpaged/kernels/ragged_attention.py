"""Ragged paged decode attention: the XLA path over a flat list of visible pages.

`paged_decode_attention`'s XLA path gathers `[B, W]` pages, W the longest row's
page count rounded up to a bucket, and on CPU a padded page costs about as much
as a real one (the gather writes it and the einsums read it). Here the batch's
pages are one list `[P]` (each row's pages, in order, then padding), so the work
follows the pages the rows really hold; `P` is bucketed instead of `B x W`.
Per page: the scores of its row's query against its tokens, and its own max;
`segment_max` / `segment_sum` over rows (cheap on CPU: the list is sorted by
row) merge pages flash-decoding style. Same math and masking as
`paged_decode_attention` (see its module note on windows and uint16 pools).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.kernels.paged_attention import (
    _MASK_VALUE,
    _as_float,
    _check_common,
    _check_window,
    _soft_cap,
    _window_start,
    ieee_float32,
)

# Gathered K (or V) bytes per chunk of the page list: on CPU a cache-sized buffer reused
# chunk after chunk beats one fresh page-faulted buffer. The chunks are unrolled, not a
# `lax` loop: inside the model's loop over layers, a loop here copies the layer's pool
# into its state (measured: a 48-row decode step 73 -> 112 ms); each unrolled chunk adds
# compiled kernels, so there are at most _MAX_CHUNKS.
_CHUNK_BYTES = 2 << 20
_MAX_CHUNKS = 8


def _num_chunks(num_pages: int, page_bytes: int) -> int:
    return max(1, min(_MAX_CHUNKS, num_pages, -(-num_pages * page_bytes // _CHUNK_BYTES)))


def page_list(
    block_tables: np.ndarray,  # int32 [B, W]
    context_lens: np.ndarray,  # int32 [B]
    block_size: int,
    num_pages: int,
) -> np.ndarray:  # int32 [3, num_pages]
    """Every page of every row's context, row by row (pages before a sliding window too:
    the window is per layer, the list per step): (block id, row, first token position)
    per page, padded to `num_pages` with (0, B, 0) entries that attend to nothing."""
    batch = len(context_lens)
    pages = -(-np.asarray(context_lens, np.int64) // block_size)
    total = int(pages.sum())
    if total > num_pages:
        raise ValueError(f"the rows hold {total} pages, more than num_pages={num_pages}")
    if batch and pages.max() > block_tables.shape[1]:
        raise ValueError(f"block_tables has {block_tables.shape[1]} columns, a row needs more")
    rows = np.repeat(np.arange(batch), pages)
    index = np.arange(total) - np.repeat(np.cumsum(pages) - pages, pages)
    out = np.zeros((3, num_pages), np.int32)
    out[1] = batch
    out[0, :total] = block_tables[rows, index]
    out[1, :total] = rows
    out[2, :total] = index * block_size
    return out


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def _ragged_jit(
    q: jax.Array,  # [B, Hq, D]
    k_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    v_pool: jax.Array,  # [num_blocks, Hkv, block_size, D]
    pages: jax.Array,  # int32 [3, P]
    context_lens: jax.Array,  # int32 [B]
    window: jax.Array | None,  # int32 []
    *,
    scale: float,
    soft_cap: float | None,
) -> jax.Array:  # [B, Hq, D]
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    lens = context_lens.astype(jnp.int32)
    first = _window_start(lens, window)
    num_pages = pages.shape[1]
    n = _num_chunks(num_pages, num_kv_heads * block_size * head_dim * k_pool.dtype.itemsize)
    edges = [round(i * num_pages / n) for i in range(n + 1)]
    with ieee_float32(q.dtype):
        parts = []
        fence = jnp.zeros((), jnp.int32)
        for p0, p1 in zip(edges[:-1], edges[1:], strict=True):
            blocks, rows, starts = pages[0, p0:p1] + fence, pages[1, p0:p1], pages[2, p0:p1]
            # Padding pages name row B: `fill` gives them length 0 (nothing visible) and the
            # segment ops drop them.
            page_len = jnp.take(lens, rows, mode="fill", fill_value=0)
            page_first = jnp.take(first, rows, mode="fill", fill_value=0)
            pos = starts[:, None] + jnp.arange(block_size)  # [p, bs]
            visible = ((pos >= page_first[:, None]) & (pos < page_len[:, None]))[:, None, None, :]
            qp = jnp.take(q, rows, axis=0, mode="clip").reshape(-1, num_kv_heads, group, head_dim)
            k = _as_float(k_pool[blocks])  # [p, Hkv, bs, D]
            logits = jnp.einsum("phgd,phsd->phgs", qp, k, preferred_element_type=jnp.float32)
            logits = jnp.where(visible, _soft_cap(logits * scale, soft_cap), _MASK_VALUE)
            by_row = functools.partial(
                jax.ops.segment_sum, segment_ids=rows, num_segments=batch, indices_are_sorted=True
            )
            m = jax.ops.segment_max(logits.max(-1), rows, batch, indices_are_sorted=True)
            page_max = jnp.take(m, rows, axis=0, mode="clip")  # [p, Hkv, G]
            prob = jnp.where(visible, jnp.exp(logits - page_max[..., None]), 0.0)
            v = _as_float(v_pool[blocks])
            o = jnp.einsum(
                "phgs,phsd->phgd", prob.astype(v.dtype), v, preferred_element_type=jnp.float32
            )
            parts.append((by_row(o), m, by_row(prob.sum(-1))))
            fence = (o[0, 0, 0, 0] > jnp.inf).astype(jnp.int32)
    # rows without pages in a chunk have m = -inf there: weight 0
    m_all = functools.reduce(jnp.maximum, [m for _, m, _ in parts])
    m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    weights = [jnp.where(jnp.isfinite(m), jnp.exp(m - m_all), 0.0) for _, m, _ in parts]
    out = sum(w[..., None] * o for w, (o, _, _) in zip(weights, parts, strict=True))
    denom = sum(w * d for w, (_, _, d) in zip(weights, parts, strict=True))
    # denom == 0 only when nothing is visible (context_len 0): zeros, not NaN.
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def ragged_decode_attention(
    q: jax.Array,  # [B, num_q_heads, head_dim]
    k_pool: jax.Array,  # [num_blocks, num_kv_heads, block_size, head_dim], one layer
    v_pool: jax.Array,  # [num_blocks, num_kv_heads, block_size, head_dim], one layer
    pages: jax.Array,  # int32 [3, P] from `page_list`: block, row, first position per page
    context_lens: jax.Array,  # int32 [B], tokens visible incl. the current one; 0 = pad row
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [B, num_q_heads, head_dim] in q's dtype
    """What `paged_decode_attention` computes, over a page list instead of page tables.
    Rows with context_len 0 (or no pages) return zeros."""
    _check_common(q, k_pool, v_pool, context_lens, scale, soft_cap)
    if np.ndim(pages) != 2 or np.shape(pages)[0] != 3:
        raise ValueError(f"pages must be [3, num_pages], got shape {np.shape(pages)}")
    if not jnp.issubdtype(pages.dtype, jnp.integer):
        raise ValueError(f"pages must be integer, got {pages.dtype}")
    return _ragged_jit(
        q, k_pool, v_pool, pages, context_lens, _check_window(sliding_window),
        scale=float(scale), soft_cap=None if soft_cap is None else float(soft_cap),
    )  # fmt: skip
