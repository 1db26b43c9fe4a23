"""Ragged paged attention: one step's flat tokens, each attending over its sequence's pages.

A step is a flat axis of T tokens: every decoding sequence's next token and the
prompt chunks of prefilling ones, sequence after sequence. Token t belongs to
sequence `seq_of[t]` (S for padding tokens) and sits at `positions[t]`; it sees
the keys of its sequence at positions p with `positions[t] - window < p <=
positions[t]` (causal within the sequence's new tokens, over its cached pages
before them; transformers' convention, see `jpaged.kernels.common`).
The step's own K/V are handed in (`new_kv`) and written first, each at its position in
its sequence's pages: by the Pallas kernel itself for float pools (no scatter launch; it
attends to them from its inputs, as the slots are being written in the same launch), by
`kv_pool.write`'s scatter otherwise (quantizing 1-byte pools, the XLA path).

Three implementations behind `ragged_paged_attention`:
- "pallas": one program per (query tile, KV head, context split). A tile is up
  to PALLAS_TILE consecutive tokens of one sequence (`Ragged.tiles`); the program
  loads them with every query head of the KV head as the rows of one dot, and
  loops over its share of the pages the tile sees (online softmax, float32
  accumulation), then (split 0) over the sequence's new keys of the step, and
  writes its tile's tokens' K/V. q, k and v come token-major in one array; unsplit,
  a program stores its rows at their tokens too (no layout launch before or after).
  When a bucket's tiles x KV heads are too few to fill the GPU (small batches, long
  contexts), each tile's pages are divided among several programs whose partial
  softmaxes merge by log-sum-exp (flash-decoding; see `num_splits`). Lowers to
  Triton on GPU (`interpret=True` elsewhere), or, `lowering="mosaic"` (or
  JPAGED_PALLAS_LOWERING=mosaic: `pallas_lowering`), to Mosaic GPU: the same tiles,
  splits and merge, a body of its own (`ragged_mosaic`: pages copied into shared
  memory by the TMA, wgmma dots), interpreted elsewhere by Mosaic GPU's interpret mode.
  It takes 16-bit float pools and causal attention only (`ragged_mosaic.check`), leaves the
  step's K/V to the scatter and has q's rows laid out by XLA.
- "xla" (the CPU path): two work lists of (page, query tile) pairs, one with a
  token per item (decoding sequences) and one with XLA_TILE tokens per item
  (prompt chunks), walked in chunks by a loop that runs only as many times as
  the step has live items, so the work follows the pages really attended and
  not the lists' padded sizes. The partial softmaxes merge per token with
  segment ops.
- `ragged_paged_attention_reference`: every token against its whole page
  table, dense, for tests only.

The pools may be any float dtype, or uint16 holding bfloat16 bits (XLA CPU, see
`jpaged.kernels.common`), or a 1-byte type (int8, fp8) with a scale per token and
KV head (`k_scale`, `v_scale`): every implementation dequantizes the pages it
reads, a chunk at a time (int8 pages hold K and V rotated, so q is rotated the same
way and the output back: `jpaged.cache.kv_pool.rotate`). They are passed with
their leading (layer, block) dimensions whole and returned (`Pools`): inside a loop
over layers, a loop that reads a pool it does not carry makes XLA copy the pool
first (measured: 1.6 s a step for a 400 MB pool), so the XLA path threads the
pools through its loops.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jpaged.cache import kv_pool
from jpaged.kernels import cpu
from jpaged.kernels.common import (
    MASK_VALUE,
    apply_soft_cap,
    as_float,
    attend_chunk,
    check_window,
    choose_tiles,
    dequantize,
    ieee_float32,
    on_gpu,
    sm_count,
    softmax_step,
    split_run,
)
from jpaged.kernels.ragged_plan import PALLAS_TILE, XLA_TILE, Ragged, num_splits

# (k_pool, v_pool, k_scale, v_scale): values [..., Hkv, bs, D], and for 1-byte values
# each token's scale [..., Hkv, bs] (None otherwise)
Pools = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]
# (k, v): the step's new K and V [T, Hkv, D] (RoPE applied), for `ragged_paged_attention`
# to write into each token's slot (its position in its sequence's pages) before it attends
NewKV = tuple[jax.Array, jax.Array]

# The XLA path's attention on a CPU (`_attend`)
ATTENTION = Path(__file__).with_name("attention.cc")
# Bytes of the largest array of a loop iteration of the XLA path: cache-sized.
_CHUNK_BYTES = 1 << 20
# The Pallas kernel's GPU lowerings (`pallas_lowering`): Triton's, deprecated since JAX 0.11
# but measured; Mosaic GPU's, its successor.
LOWERINGS = ("triton", "mosaic")


# --------------------------------------------------------------------------- xla


def _xla_impl(
    q: jax.Array,  # [T, Hq, D]
    pools: Pools,  # [..., Hkv, bs, D] values, [..., Hkv, bs] scales: blocks over leading dims
    meta: Ragged,
    window: jax.Array | None,
    *,
    scale: float,
    soft_cap: float | None,
    cpu_kernel: bool,
) -> tuple[jax.Array, Pools]:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = pools[0].shape[-3]
    group = num_q_heads // num_kv_heads
    if cpu_kernel:
        _, denom, acc = _attend(q, pools, meta, window, scale=scale, soft_cap=soft_cap)
    else:
        # per token and query head: running max, sum of exp, weighted sum of values
        stats = (
            jnp.full((num_tokens, num_kv_heads, group), MASK_VALUE, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
        )
        walk = functools.partial(_walk, q, meta, window, scale=scale, soft_cap=soft_cap)
        pools, stats = walk(pools, stats, meta.single, meta.num_work[0], tile=1)
        pools, (_, denom, acc) = walk(pools, stats, meta.tiled, meta.num_work[1], tile=XLA_TILE)
    # denom == 0 only for tokens that see nothing (padding): zeros, not NaN.
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype), pools


def _cpu_kernel(q: jax.Array, k_pool: jax.Array, k_scale: jax.Array | None) -> bool:
    """Whether the XLA path's work lists go to `attention.cc` (decided while tracing,
    outside the jitted call: its cache keeps the two programs apart): a whole model on a
    CPU (`cpu.serves`), float32 pools or int8 ones with float32 scales, heads of whole
    vectors, up to 512."""
    float32 = k_pool.dtype == jnp.float32 and k_scale is None
    int8 = k_pool.dtype == jnp.int8 and k_scale is not None and k_scale.dtype == jnp.float32
    return (
        (float32 or int8)
        and q.dtype == jnp.float32
        and k_pool.shape[-1] % 16 == 0
        and k_pool.shape[-1] <= 512
        and q.shape[1] // k_pool.shape[-3] <= 16
        and k_pool.shape[-2] <= 64
        and cpu.serves()
        and cpu.register(ATTENTION, ("jpaged_attend",))
    )


def _attend(
    q: jax.Array,  # [T, Hq, D]
    pools: Pools,
    meta: Ragged,
    window: jax.Array | None,
    *,
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`_walk` over both work lists from fresh stats, by `attention.cc`: each page read where
    it lies in the pool."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = pools[0].shape[-3]
    group = num_q_heads // num_kv_heads
    stat = jax.ShapeDtypeStruct((num_tokens, num_kv_heads, group), jnp.float32)
    call: Any = jax.ffi.ffi_call(
        "jpaged_attend",
        (stat, stat, jax.ShapeDtypeStruct((*stat.shape, head_dim), jnp.float32)),
        vmap_method="sequential",
    )
    no_window = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
    k, v, *scales = (jnp.zeros(0, jnp.float32) if a is None else a for a in pools)
    m, denom, acc = call(
        q.reshape(num_tokens, num_kv_heads, group, head_dim), k, v, *scales, meta.single,
        meta.tiled, meta.num_work, meta.seq_of, meta.positions,
        no_window if window is None else window,
        scale=np.float32(scale), cap=np.float32(soft_cap or 0.0), tile=np.int64(XLA_TILE),
    )  # fmt: skip
    return m, denom, acc


def _walk(
    q: jax.Array,  # [T, Hq, D]
    meta: Ragged,
    window: jax.Array | None,
    pools: Pools,
    stats: tuple[jax.Array, jax.Array, jax.Array],  # max, sum of exp, sum of p·v per token
    work: jax.Array,  # int32 [3, P]: (block, first token, first key position) per item
    count: jax.Array,  # int32 []: live items at the head of `work`
    *,
    tile: int,
    scale: float,
    soft_cap: float | None,
) -> tuple[Pools, tuple[jax.Array, jax.Array, jax.Array]]:
    """Fold the live items of one work list into the per-token softmax stats, a chunk of
    items per loop iteration (only as many iterations as the list has live chunks)."""
    if work.shape[1] == 0:
        return pools, stats
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = pools[0].shape[-3], pools[0].shape[-2]
    group = num_q_heads // num_kv_heads
    qf = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    # f32 bytes of an item's largest array: its page, its scores or its weighted values
    item_bytes = 4 * num_kv_heads * max(block_size, tile * group) * max(block_size, head_dim)
    chunk = max(1, min(work.shape[1], _CHUNK_BYTES // item_bytes))
    pad = jnp.array([[0], [num_tokens], [0]], jnp.int32).repeat(-work.shape[1] % chunk, 1)
    work = jnp.concatenate([work, pad], axis=1)

    def page(values: jax.Array, scales: jax.Array | None, blocks: jax.Array) -> jax.Array:
        # one chunk's pages, dequantized (never the pool's)
        flat = values.reshape(-1, *values.shape[-3:])[blocks]
        s = None if scales is None else scales.reshape(-1, *scales.shape[-2:])[blocks]
        return dequantize(flat, s, q.dtype)

    def body(i: jax.Array, carry: tuple) -> tuple:
        (k_all, v_all, ks_all, vs_all), (m, denom, acc) = carry
        blocks, first, key0 = lax.dynamic_slice_in_dim(work, i * chunk, chunk, axis=1)
        tok = first[:, None] + jnp.arange(tile)  # [c, tile]
        # tokens past the item's sequence (the tile's tail, padding) take no part
        own = (
            jnp.take(meta.seq_of, tok, mode="fill", fill_value=-1)
            == jnp.take(meta.seq_of, first, mode="fill", fill_value=-2)[:, None]
        )
        tok_pos = jnp.take(meta.positions, tok, mode="fill", fill_value=-1)
        tok_limit = (
            tok_pos
            if meta.limits.shape[0] == 0
            else jnp.take(meta.limits, tok, mode="fill", fill_value=-1)
        )
        key_pos = key0[:, None, None] + jnp.arange(block_size)  # [c, 1, bs]
        visible = own[..., None] & (key_pos <= tok_limit[..., None])  # [c, tile, bs]
        if window is not None:
            visible &= key_pos > tok_pos[..., None] - window
        visible = visible[:, None, :, None, :]  # [c, 1, tile, 1, bs]
        qt = jnp.take(qf, tok, axis=0, mode="fill", fill_value=0)  # [c, tile, Hkv, G, D]
        k = page(k_all, ks_all, blocks)  # [c, Hkv, bs, D]
        s = jnp.einsum("cthgd,chsd->chtgs", qt, k, preferred_element_type=jnp.float32)
        s = jnp.where(visible, apply_soft_cap(s * scale, soft_cap), MASK_VALUE)
        # merge each token's items in the chunk into its running stats
        ids = jnp.where(own, tok, num_tokens).reshape(-1)  # padding: dropped

        def per_token(x: jax.Array) -> jax.Array:  # [c, Hkv, tile, G, ...] -> [c * tile, ...]
            return jnp.moveaxis(x, 2, 1).reshape(-1, *x.shape[1:2], *x.shape[3:])

        m_new = jnp.maximum(m, jax.ops.segment_max(per_token(s.max(-1)), ids, num_tokens))
        m_item = jnp.take(m_new, ids, axis=0, mode="fill", fill_value=0.0)
        m_item = jnp.moveaxis(m_item.reshape(-1, tile, num_kv_heads, group), 1, 2)
        p = jnp.where(visible, jnp.exp(s - m_item[..., None]), 0.0)
        v = page(v_all, vs_all, blocks)
        pv = jnp.einsum(
            "chtgs,chsd->chtgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        correction = jnp.exp(m - m_new)
        denom = correction * denom + jax.ops.segment_sum(per_token(p.sum(-1)), ids, num_tokens)
        acc = correction[..., None] * acc + jax.ops.segment_sum(per_token(pv), ids, num_tokens)
        return (k_all, v_all, ks_all, vs_all), (m_new, denom, acc)

    trips = -(-count // chunk)
    return lax.fori_loop(0, trips, body, (pools, stats))


# --------------------------------------------------------------------------- pallas


def _ragged_kernel(
    *refs: Any,
    scale: float,
    soft_cap: float | None,
    pages_per_chunk: int,
    splits: int,
    quantized: bool,
    writes: bool,
    group_tile: int,
) -> None:
    """refs: the step's queries of this program's KV head [T, G, D], in token order; this
    KV head of k and v [num_blocks, block_size, D] (and, quantized, of their scales
    [num_blocks, block_size]); the tile's sequence's pages [W] (padded to whole chunks);
    each row's first visible position and position + 1 [2, rows]; the tile's (flat index
    of its sequence's position 0, the sequence's first new position, the tile's first
    token, the first token its rows are stored at) [4]; where the kernel `writes` the
    step's new K/V: this KV head of them [T, D] each. A program's rows are its tile's
    tokens x the KV head's query heads padded to `group_tile`.
    Outputs: unsplit, this KV head's query heads of every token [T, G, D]; split, [rows,
    D] normalised over this split's keys and its max and sum of exp, each f32 [rows];
    where it `writes`, the pools again (aliased)."""
    q_ref, k_ref, v_ref, *rest = refs
    ks_ref, vs_ref = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
    tables_ref, bounds_ref, span_ref, *rest = rest
    k_new_ref = v_new_ref = None
    if writes:
        k_new_ref, v_new_ref, *rest = rest
    o_ref, *rest = rest
    stats_refs = rest[:2] if splits > 1 else []
    num_tokens, group, head_dim = q_ref.shape
    rows = PALLAS_TILE * group_tile
    block_size = k_ref.shape[1]
    chunk = pages_per_chunk * block_size
    first, end = bounds_ref[0], bounds_ref[1]  # end = 0 on padding rows
    # The rows gathered here from the token-major queries: the layer makes q, k and v in
    # one launch, with no tile layout of q (padding tiles' and heads' rows are real
    # rows clamped in: their output is dropped).
    r = jnp.arange(rows)
    tok = jnp.minimum(span_ref[2] + r // group_tile, num_tokens - 1)
    head = jnp.minimum(r % group_tile, group - 1)
    q = q_ref[tok[:, None], head[:, None], jnp.arange(head_dim)[None, :]]
    # keys from the pool: positions before the step's new ones where the kernel writes
    # them (those slots are other programs' to write: never read), else all of them
    stored = span_ref[1] if writes else None
    cached = end if stored is None else jnp.minimum(end, stored)  # [rows]

    def body(c: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        # causal rows, windows, splits: a chunk may hold nothing a row sees (its p is masked)
        return attend_chunk(
            q,
            k_ref,
            v_ref,
            tables_ref,
            c,
            carry,
            lambda pos: (pos[None, :] >= first[:, None]) & (pos[None, :] < cached[:, None]),
            pages_per_chunk=pages_per_chunk,
            scale=scale,
            soft_cap=soft_cap,
            ks_ref=ks_ref,
            vs_ref=vs_ref,
            stored=stored,
        )

    # The chunks some row of the tile sees, cut into `splits` equal runs: the tile's own
    # pages, not the table's width, so a short context still spreads over the programs.
    # Runs past the tile's last chunk (short contexts, padding tiles) are empty.
    lo, hi, lowest = _chunk_range(first, end, cached, chunk)
    lo, hi = split_run(lo, hi, splits, pl.program_id(2))
    carry: tuple[jax.Array, ...] = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    carry = lax.fori_loop(lo, hi, body, carry)
    if writes:
        assert k_new_ref is not None and v_new_ref is not None
        carry = _attend_new(
            q, k_new_ref, v_new_ref, span_ref, first, end, lowest, carry,
            chunk=chunk, scale=scale, soft_cap=soft_cap,
        )  # fmt: skip
        live = bounds_ref[1, jnp.arange(PALLAS_TILE) * group_tile] > 0  # the tile's own tokens
        _write_new(k_new_ref, v_new_ref, span_ref, tables_ref, live, *rest[-2:])
    o, m, denom = carry
    # denom == 0 when a row sees nothing here (padding, an empty run): zeros, not NaN
    safe = jnp.where(denom > 0, denom, 1.0)
    o = jnp.where((denom > 0)[:, None], o / safe[:, None], 0.0)
    if splits > 1:
        o_ref[...] = o
    else:
        # Unsplit, each row goes to its token itself (no layout launch after the kernel):
        # a live tile's own tokens, a padding tile's share of the padding tokens (zeros,
        # as it sees nothing). The other rows (the tile's tail, padded heads) store the
        # first row's value where it goes: no store of a row may land on another's with
        # a different value (interpreted, a masked row would write back the old one). A
        # padding tile past the last token stores nothing (its first row is no token).
        out_tok = span_ref[3] + r // group_tile
        padding_tile = span_ref[2] >= num_tokens
        keep = ((end > 0) | padding_tile) & (out_tok < num_tokens) & (r % group_tile < group)
        first_row = r == 0
        o = jnp.where(keep[:, None], o, jnp.sum(jnp.where(first_row[:, None], o, 0.0), axis=0))
        out_tok = jnp.minimum(jnp.where(keep, out_tok, span_ref[3]), num_tokens - 1)
        out_head = jnp.where(keep, r % group_tile, 0)
        stores = jnp.broadcast_to(jnp.max(jnp.where(keep & first_row, 1, 0)) > 0, (rows, head_dim))
        at = (out_tok[:, None], out_head[:, None], jnp.arange(head_dim)[None, :])
        plgpu.store(o_ref.at[at], o.astype(o_ref.dtype), mask=stores)
    if stats_refs:
        m_ref, denom_ref = stats_refs
        m_ref[...] = m
        denom_ref[...] = denom


def _chunk_range(
    first: jax.Array,  # int32 [..., rows]: each row's first visible position
    end: jax.Array,  # int32 [..., rows]: past its last visible one; 0: padding
    cached: jax.Array,  # int32 [..., rows]: past the last one read from the pool
    chunk: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # int32 [...] each
    """The chunks of a page table some row of a tile reads, [lo, hi), and the least `first`
    of a live row (int32 max: none): in a Triton program, or in XLA for every tile at once
    (Mosaic's programs read them as scalars)."""
    hi = pl.cdiv(jnp.max(cached, axis=-1), chunk)
    lowest = jnp.min(jnp.where(end > 0, first, jnp.iinfo(jnp.int32).max), axis=-1)
    return jnp.minimum(lowest // chunk, hi), hi, lowest


def _attend_new(
    q: jax.Array,  # [rows, D]
    k_new_ref: Any,  # [T, D]: the step's new keys, this KV head
    v_new_ref: Any,  # [T, D]
    span_ref: Any,  # [4]: see `_ragged_kernel`
    first: jax.Array,  # int32 [rows]: each row's first visible position
    end: jax.Array,  # int32 [rows]: the position past its last visible one; 0: padding
    lowest: jax.Array,  # int32 []: the least `first` of a live row (int32 max: none)
    carry: tuple[jax.Array, ...],
    *,
    chunk: int,
    scale: float,
    soft_cap: float | None,
) -> tuple[jax.Array, ...]:
    """Fold the step's new keys the tile sees into the softmax, from the kernel's inputs
    (the pool's copies of them are being written in this launch). A sequence's new tokens
    are consecutive in the flat axis, its position p at flat index `origin + p`. Split 0
    alone takes them: the other splits' partials hold cached pages only."""
    num_tokens = k_new_ref.shape[0]
    origin, stored = span_ref[0], span_ref[1]
    lo = jnp.maximum(lowest, stored)
    trips = jnp.where(pl.program_id(2) == 0, pl.cdiv(jnp.maximum(jnp.max(end) - lo, 0), chunk), 0)

    def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        pos = lo + i * chunk + jnp.arange(chunk)
        # past the step's last token: a real row clamped in, never seen (pos >= end)
        tok = jnp.minimum(origin + pos, num_tokens - 1)
        seen = (pos[None, :] >= first[:, None]) & (pos[None, :] < end[:, None])
        return softmax_step(
            q, k_new_ref[tok], v_new_ref[tok], seen, carry, scale=scale, soft_cap=soft_cap
        )

    return lax.fori_loop(0, trips, body, carry)


def _write_new(
    k_new_ref: Any,  # [T, D]: the step's new keys, this KV head
    v_new_ref: Any,  # [T, D]
    span_ref: Any,  # [4]: see `_ragged_kernel`
    tables_ref: Any,  # [W]: the tile's sequence's pages
    live: jax.Array,  # bool [tile]: the tile's tokens of its sequence (not padding)
    k_out_ref: Any,  # [num_blocks, block_size, D]: the pool, this KV head (aliased)
    v_out_ref: Any,
) -> None:
    """The tile's tokens' K/V into their slots (their positions in their sequence's
    pages), by split 0 only: each (token, KV head) row has exactly one writer. Padding
    tokens write nothing."""
    tile = live.shape[0]
    block_size, head_dim = k_out_ref.shape[1], k_out_ref.shape[2]
    tok = span_ref[2] + jnp.arange(tile)
    pos = tok - span_ref[0]
    live &= pl.program_id(2) == 0
    # rows written nowhere point at the null block: masked, they store nothing on a GPU,
    # and interpreted, their old values back where no row writes
    page = jnp.clip(pos // block_size, 0, tables_ref.shape[0] - 1)  # padding's pos is noise
    block = jnp.where(live, tables_ref[page], 0)
    offset = jnp.where(live, pos % block_size, 0)
    mask = jnp.broadcast_to(live[:, None], (tile, head_dim))
    rows = jnp.minimum(tok, k_new_ref.shape[0] - 1)
    # every axis indexed by an array: what interpret mode can mask
    at = (block[:, None], offset[:, None], jnp.arange(head_dim)[None, :])
    for new_ref, out_ref in ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref)):
        plgpu.store(out_ref.at[at], new_ref[rows].astype(out_ref.dtype), mask=mask)


def _merge_splits(
    o: jax.Array,  # f32 [NT, Hkv, S, rows, D], each split normalised over its own keys
    m: jax.Array,  # f32 [NT, Hkv, S, rows], each split's max logit (MASK_VALUE if empty)
    denom: jax.Array,  # f32 [NT, Hkv, S, rows], each split's sum of exp(logit - m)
) -> jax.Array:  # f32 [NT, Hkv, rows, D]
    # Empty splits weigh 0 (denom 0); a row that sees nothing gets zeros, not NaN.
    weight = denom * jnp.exp(m - m.max(axis=2, keepdims=True))
    total = weight.sum(axis=2)
    out = (weight[..., None] * o).sum(axis=2)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _pallas_impl(
    q: jax.Array,  # [T, Hq, D]
    pools: Pools,  # [N, Hkv, bs, D] values, [N, Hkv, bs] scales
    meta: Ragged,
    window: jax.Array | None,
    new: NewKV | None,  # the step's K/V for the kernel to write (float pools), or None
    *,
    scale: float,
    soft_cap: float | None,
    interpret: bool,
    splits: int | None,
    lowering: str,
) -> tuple[jax.Array, Pools]:  # [T, Hq, D], the pools (written where `new` is given)
    stored_dtype = pools[0].dtype
    k_pool, v_pool, k_scale, v_scale = (None if a is None else as_float(a) for a in pools)
    assert k_pool is not None and v_pool is not None
    quantized = k_scale is not None
    writes = new is not None
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_pool.shape
    group = num_q_heads // num_kv_heads
    group_tile = pl.next_power_of_2(group)
    rows = PALLAS_TILE * group_tile
    num_tiles = meta.tiles.shape[1]
    seq, first = meta.tiles[0], meta.tiles[1]
    # Each tile's tokens, gathered in XLA (a few KB): the kernel's blocks stay static.
    tok = first[:, None] + jnp.arange(PALLAS_TILE)  # [NT, tile]
    own = jnp.take(meta.seq_of, tok, mode="fill", fill_value=-1) == seq[:, None]
    pos = jnp.take(meta.positions, tok, mode="fill", fill_value=0)
    limits = meta.limits if meta.limits.shape[0] else meta.positions  # last key each sees
    limit = jnp.take(limits, tok, mode="fill", fill_value=0)
    end = jnp.where(own, limit + 1, 0)
    start = jnp.zeros_like(pos) if window is None else jnp.maximum(pos + 1 - window, 0)

    tiles = choose_tiles(head_dim, k_pool.dtype.itemsize, block_size, rows)
    pages_per_chunk = tiles.chunk_tokens // block_size
    tables = jnp.take(meta.block_tables, seq, axis=0, mode="fill", fill_value=0)  # [NT, W]
    width = tables.shape[1] + (-tables.shape[1] % pages_per_chunk)
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    if splits is None:
        splits = num_splits(num_tiles, num_kv_heads, width // pages_per_chunk, sm_count())
    if lowering == "mosaic":
        from jpaged.kernels import ragged_mosaic  # (Mosaic GPU's modules: 0.08 s to import)

        lo, hi, _ = _chunk_range(start, end, end, tiles.chunk_tokens)
        no_window = jnp.iinfo(jnp.int32).max  # end - window never overflows: end >= 0
        per_tile = jnp.stack(
            [lo, hi, pos[:, 0], jnp.sum(own, axis=1), jnp.broadcast_to(
                no_window if window is None else window, lo.shape
            )],
            axis=1,
        ).astype(jnp.int32)  # fmt: skip
        # each tile's rows (its tokens x the KV head's query heads, padded) laid out by XLA:
        # a wgmma reads its operand whole from shared memory
        q_rows = jnp.take(q, tok, axis=0, mode="fill", fill_value=0)  # [NT, tile, Hq, D]
        q_rows = q_rows.reshape(num_tiles, PALLAS_TILE, num_kv_heads, group, head_dim)
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, 0), (0, group_tile - group), (0, 0)))
        q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_dim)
        padded = -(-rows // ragged_mosaic.ROWS) * ragged_mosaic.ROWS
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        outs = ragged_mosaic.call(
            q_rows, k_pool, v_pool, tables, per_tile,
            scale=scale, soft_cap=soft_cap, pages_per_chunk=pages_per_chunk, splits=splits,
            group_tile=group_tile, interpret=interpret,
        )  # fmt: skip
        return _tiles_to_tokens(outs, meta, splits, rows, group, q.dtype), pools
    bounds = jnp.stack([start, end], axis=1).repeat(group_tile, axis=2)  # [NT, 2, rows]
    # The tile's sequence's first token: its tiles are consecutive, the first of them
    # starts there (padding tiles: T). Tiles x tiles compares, a few KB.
    same = seq[:, None] == seq[None, :]
    seq_first = jnp.min(jnp.where(same, first[None, :], num_tokens), axis=1)  # [NT]
    stored = jnp.take(meta.positions, seq_first, mode="fill", fill_value=0)
    # Where an unsplit tile stores its rows: a live tile at its tokens, the k-th padding
    # tile at the k-th PALLAS_TILE padding tokens. A bucket has enough padding tiles
    # (`sizes`): n sequences of L live tokens take at most L / tile + n tiles of the
    # T / tile + S, which leaves (T - L) / tile or more, as S >= n.
    num_seqs = meta.block_tables.shape[-2]
    live_tiles, live_tokens = jnp.sum(seq < num_seqs), jnp.sum(meta.seq_of < num_seqs)
    zeros_at = live_tokens + (jnp.arange(num_tiles) - live_tiles) * PALLAS_TILE
    out_first = jnp.where(seq < num_seqs, first, zeros_at)
    span = jnp.stack([seq_first - stored, stored, first, out_first], axis=1)  # [NT, 4]
    kernel = functools.partial(
        _ragged_kernel,
        scale=scale,
        soft_cap=soft_cap,
        pages_per_chunk=pages_per_chunk,
        splits=splits,
        quantized=quantized,
        writes=writes,
        group_tile=group_tile,
    )
    pool_spec = pl.BlockSpec((num_blocks, None, block_size, head_dim), lambda i, h, s: (0, h, 0, 0))
    scale_spec = pl.BlockSpec((num_blocks, None, block_size), lambda i, h, s: (0, h, 0))
    scales = [k_scale, v_scale] if quantized else []
    # q, and the new k and v, token-major in one array: the layer's one launch for them
    # (RoPE, the split of the QKV projection) feeds the kernel directly.
    tokens = [q]
    q_spec = pl.BlockSpec((num_tokens, group, head_dim), lambda i, h, s: (0, h, 0))
    extra_specs: list[pl.BlockSpec] = []
    if new is not None:
        k_new, v_new = new
        tokens += [k_new.astype(q.dtype), v_new.astype(q.dtype)]
        extra_specs = [
            pl.BlockSpec((num_tokens, None, head_dim), lambda i, h, s: (0, num_q_heads + h, 0)),
            pl.BlockSpec(
                (num_tokens, None, head_dim),
                lambda i, h, s: (0, num_q_heads + num_kv_heads + h, 0),
            ),
        ]
    qkv = jnp.concatenate(tokens, axis=1)  # [T, Hq (+ 2 Hkv), D]
    # One split stores the answer token-major; several write f32 partials and their
    # softmax stats, merged and laid out after.
    out_shape = [jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q.dtype)]
    out_specs = [pl.BlockSpec((num_tokens, group, head_dim), lambda i, h, s: (0, h, 0))]
    if splits > 1:
        part = jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows, head_dim), jnp.float32)
        stats = jax.ShapeDtypeStruct((num_tiles, num_kv_heads, splits, rows), jnp.float32)
        out_shape = [part, stats, stats]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda i, h, s: (i, h, s, 0, 0)),
            *2 * [pl.BlockSpec((None, None, None, rows), lambda i, h, s: (i, h, s, 0))],
        ]
    aliases = {}
    if writes:
        # the pools come back as the last outputs, written in place (donated: no copy)
        aliases = {1: len(out_shape), 2: len(out_shape) + 1}
        out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (k_pool, v_pool)]
        out_specs += [pool_spec, pool_spec]
    outs = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads, splits),
        in_specs=[
            q_spec,
            pool_spec,
            pool_spec,
            *[scale_spec] * len(scales),
            pl.BlockSpec((None, width), lambda i, h, s: (i, 0)),
            pl.BlockSpec((None, 2, rows), lambda i, h, s: (i, 0, 0)),
            pl.BlockSpec((None, 4), lambda i, h, s: (i, 0)),
            *extra_specs,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=tiles.num_stages),
        name="jpaged_ragged_paged_attention",
    )(qkv, k_pool, v_pool, *scales, tables, bounds, span, *([qkv, qkv] if writes else []))
    if writes:
        *outs, k_pool, v_pool = outs
        if stored_dtype == jnp.uint16:  # back to the bits the pool is kept in
            k_pool, v_pool = (lax.bitcast_convert_type(p, jnp.uint16) for p in (k_pool, v_pool))
        pools = (k_pool, v_pool, None, None)
    if splits == 1:
        return outs[0], pools
    return _tiles_to_tokens(outs, meta, splits, rows, group, q.dtype), pools


def _tiles_to_tokens(
    outs: list[jax.Array],  # f32 [NT, Hkv, S, >= rows, D], [NT, Hkv, S, >= rows] twice
    meta: Ragged,
    splits: int,
    rows: int,  # a tile's rows: PALLAS_TILE tokens x the group padded
    group: int,
    dtype: Any,
) -> jax.Array:  # [T, Hq, D]
    """The programs' rows, merged over their splits, back at their tokens."""
    o = outs[0][:, :, 0] if splits == 1 else _merge_splits(*outs)
    num_tiles, num_kv_heads, _, head_dim = o.shape
    # token t is row (token_tile % tile) of tile (token_tile // tile)
    out = o[:, :, :rows].astype(dtype).reshape(num_tiles, num_kv_heads, PALLAS_TILE, -1, head_dim)
    out = out[..., :group, :].transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads * group, head_dim)
    return jnp.take(out, meta.token_tile, axis=0, mode="fill", fill_value=0)


# --------------------------------------------------------------------------- public


@functools.partial(
    jax.jit,
    static_argnames=("scale", "soft_cap", "impl", "interpret", "splits", "cpu_kernel", "lowering"),
)
def _ragged_jit(
    q: jax.Array,
    pools: Pools,
    meta: Ragged,
    window: jax.Array | None,
    new: NewKV | None,
    *,
    scale: float,
    soft_cap: float | None,
    impl: str,
    interpret: bool,
    splits: int | None,
    cpu_kernel: bool,
    lowering: str,
) -> tuple[jax.Array, Pools]:
    meta = Ragged(*(jnp.asarray(a, jnp.int32) for a in meta))
    values = pools[0].dtype
    # The Triton kernel writes float pools of q's dtype itself, beside its reads (no
    # scatter launch); 1-byte pools (quantized per token first), the Mosaic kernel and
    # the XLA path take the scatter.
    in_kernel = (
        impl == "pallas"
        and lowering == "triton"
        and pools[2] is None
        and as_float(pools[0]).dtype == q.dtype
    )
    if new is not None and not in_kernel:
        pools = _scatter(pools, new, meta)
        new = None
    q = kv_pool.rotate(q, values)  # into an int8 pool's basis (see `rotate`), and out again below
    if impl == "pallas":
        # one axis of blocks: the leading (layer, block) dims are a view
        lead = pools[0].ndim - 3
        k, v, ks, vs = (None if a is None else a.reshape(-1, *a.shape[lead:]) for a in pools)
        assert k is not None and v is not None
        out, written = _pallas_impl(
            q,
            (k, v, ks, vs),
            meta,
            window,
            new,
            scale=scale,
            soft_cap=soft_cap,
            interpret=interpret,
            splits=splits,
            lowering=lowering,
        )
        if new is not None:
            pools = (
                written[0].reshape(pools[0].shape),
                written[1].reshape(pools[1].shape),
                *pools[2:],
            )
    else:
        with ieee_float32(q.dtype):
            out, pools = _xla_impl(
                q, pools, meta, window, scale=scale, soft_cap=soft_cap, cpu_kernel=cpu_kernel
            )
    return kv_pool.rotate(out, values, back=True), pools


def _scatter(pools: Pools, new: NewKV, meta: Ragged) -> Pools:
    """`kv_pool.write` of the step's K/V into pools of leading dims (..., blocks), each
    token's block id counted over all of them (the metadata's) split back into (layer,
    block): a scatter at the pools' own leading indices, in place, in a loop over layers
    too (around a reshape of the carried pool to one layer, XLA copied it). Padding goes
    to the null block."""
    k, v = new
    lead = len(pools[0].shape) - 3
    num_blocks, block_size = pools[0].shape[lead - 1], pools[0].shape[-2]
    slots = kv_pool.slot_mapping(meta.block_tables, meta.seq_of, meta.positions, block_size)
    per_layer = num_blocks * block_size

    def layers(a: jax.Array | None) -> Any:  # [L, N, ...]: no reshape at all for the model's
        return None if a is None else a.reshape(-1, num_blocks, *a.shape[lead:])

    kv = kv_pool.KVPool(*map(layers, pools))
    written = kv_pool.write(kv, (slots // per_layer)[:, None], slots % per_layer, k, v)
    out = (written.k, written.v, written.k_scale, written.v_scale)
    return tuple(  # type: ignore[return-value]
        None if a is None or b is None else a.reshape(b.shape)
        for a, b in zip(out, pools, strict=True)
    )


def ragged_paged_attention(
    q: jax.Array,  # [T, num_q_heads, head_dim]
    k_pool: jax.Array,  # [..., num_kv_heads, block_size, head_dim]: blocks over the leading dims
    v_pool: jax.Array,  # same shape as k_pool
    meta: Ragged,  # from `plan`, block ids counted over k_pool's leading dims
    *,
    scale: float,
    k_scale: jax.Array | None = None,  # [..., num_kv_heads, block_size]: 1-byte pools' scales
    v_scale: jax.Array | None = None,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    impl: str,  # "pallas" or "xla": resolved by the caller (`EngineConfig.attention_impl`)
    interpret: bool | None = None,
    splits: int | None = None,
    new_kv: NewKV | None = None,  # the step's (k, v) [T, Hkv, D] to write
    lowering: str | None = None,
) -> tuple[jax.Array, Pools]:  # out [T, Hq, D] in q's dtype, (k_pool, v_pool, k_scale, v_scale)
    """softmax(soft_cap(scale * q·k)) · v of every token over the keys it sees, and the
    pools (thread them on: see the module note). Padding tokens get zeros.
    1-byte pools (int8, fp8) come with each token's scale and are read dequantized.
    `new_kv`: the step's new K/V, written first at each token's position in its sequence's
    pages (`meta`; padding into the null block), each token then seeing its own: by the
    Pallas kernel itself for float pools of q's dtype, which attends to them from its
    inputs; by `kv_pool.write`'s scatter (quantizing) otherwise. Without it the pools come
    back unchanged and must hold the step's K/V already.
    `impl`: "pallas" or "xla" (the config resolves "auto": `EngineConfig.validate`);
    `interpret` (pallas): None = interpret unless on GPU; `splits` (pallas): context splits
    per tile, None = the bucket's (`num_splits`); `lowering` (pallas on a GPU, and what is
    interpreted elsewhere): "triton" or "mosaic" (see `pallas_lowering`), None =
    `pallas_lowering()`."""
    _check(q, k_pool, v_pool, k_scale, v_scale, meta, scale, soft_cap, impl, splits)
    _check_new(q, k_pool, new_kv)
    window = check_window(sliding_window)
    lowering = pallas_lowering() if lowering is None else lowering
    if lowering not in LOWERINGS:
        raise ValueError(f"lowering must be one of {LOWERINGS}, got {lowering!r}")
    if impl == "pallas" and lowering == "mosaic":
        from jpaged.kernels import ragged_mosaic

        ragged_mosaic.check(q, k_pool, k_scale, meta)
    return _ragged_jit(
        q,
        (k_pool, v_pool, k_scale, v_scale),
        meta,
        window,
        new_kv,
        scale=float(scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        impl=impl,
        interpret=not on_gpu() if interpret is None else bool(interpret),
        splits=splits,
        lowering=lowering,
        # (`attention.cc` masks causally: a step with images takes the XLA walk)
        cpu_kernel=impl == "xla"
        and np.shape(meta.limits)[0] == 0
        and _cpu_kernel(q, k_pool, k_scale),
    )


def pallas_lowering() -> str:
    """The Pallas kernel's lowering where a call names none: `JPAGED_PALLAS_LOWERING`
    ("triton", the default, or "mosaic"), read as a step is traced (a program already
    compiled keeps its own)."""
    return os.environ.get("JPAGED_PALLAS_LOWERING", "triton")


def _check(
    q: Any,
    k_pool: Any,
    v_pool: Any,
    k_scale: Any,
    v_scale: Any,
    meta: Any,
    scale: Any,
    soft_cap: Any,
    impl: str,
    splits: Any,
) -> None:
    if np.ndim(q) != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(
            f"q must be float [T, num_q_heads, head_dim], got {np.shape(q)} "
            f"{getattr(q, 'dtype', None)}"
        )
    if np.ndim(k_pool) < 4 or np.shape(v_pool) != np.shape(k_pool):
        raise ValueError(
            f"k_pool and v_pool must be [..., num_kv_heads, block_size, head_dim] "
            f"alike, got {np.shape(k_pool)} and {np.shape(v_pool)}"
        )
    quantized = k_pool.dtype.itemsize == 1
    if k_pool.dtype != v_pool.dtype or not (
        jnp.issubdtype(k_pool.dtype, jnp.floating) or k_pool.dtype in (jnp.uint16, jnp.int8)
    ):
        raise ValueError(
            f"pools must share a float (or uint16 bf16 bits, or int8) dtype, got "
            f"{k_pool.dtype} and {v_pool.dtype}"
        )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if quantized and np.shape(s) != np.shape(k_pool)[:-1]:
            raise ValueError(
                f"{name} must be {np.shape(k_pool)[:-1]} for {k_pool.dtype} pools "
                f"(a scale per token and KV head), got {np.shape(s)}"
            )
        if not quantized and s is not None:
            raise ValueError(f"{name} goes with 1-byte pools only, not {k_pool.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, pool_head_dim = k_pool.shape[-3:]
    if pool_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q {q.shape} does not fit pools of {num_kv_heads} KV heads of head_dim {pool_head_dim}"
        )
    if not isinstance(meta, Ragged):
        raise ValueError(f"meta must be a Ragged from `plan`, got {type(meta).__name__}")
    for name in ("seq_of", "positions"):
        if np.shape(getattr(meta, name)) != (num_tokens,):
            raise ValueError(
                f"meta.{name} must be [{num_tokens}], got {np.shape(getattr(meta, name))}"
            )
    for name in ("tiles", "single", "tiled"):
        shape = np.shape(getattr(meta, name))
        if len(shape) != 2 or shape[0] != (2 if name == "tiles" else 3):
            raise ValueError(f"meta.{name} has shape {shape}")
    if impl not in ("pallas", "xla"):
        raise ValueError(f"impl must be 'pallas' or 'xla', got {impl!r}")
    if not isinstance(scale, int | float) or isinstance(scale, bool):
        raise ValueError(f"scale must be a Python float, got {scale!r}")
    if soft_cap is not None and (not isinstance(soft_cap, int | float) or soft_cap <= 0):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")
    if splits is not None and (
        not isinstance(splits, int) or isinstance(splits, bool) or splits < 1
    ):
        raise ValueError(f"splits must be None or a positive int, got {splits!r}")


def _check_new(q: Any, k_pool: Any, new_kv: Any) -> None:
    if new_kv is None:
        return
    k, v = new_kv
    rows = (q.shape[0], *k_pool.shape[-3:-2], k_pool.shape[-1])
    if np.shape(k) != rows or np.shape(v) != rows:
        raise ValueError(f"new_kv must be k and v {rows}, got {np.shape(k)}, {np.shape(v)}")


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap"))
def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pool: jax.Array,  # [N, Hkv, bs, D]
    v_pool: jax.Array,
    seq_of: jax.Array,  # int32 [T], S for padding
    positions: jax.Array,  # int32 [T]
    block_tables: jax.Array,  # int32 [S, W]
    *,
    scale: float,
    k_scale: jax.Array | None = None,  # [N, Hkv, bs] (1-byte pools)
    v_scale: jax.Array | None = None,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    limits: jax.Array | None = None,  # int32 [T]: the last key each sees (default: its own)
) -> jax.Array:  # [T, Hq, D]
    """Plain float32 attention of each token over its sequence's whole table, dense
    (1-byte pools dequantized first: the reference may materialise what it likes)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_q_heads // num_kv_heads
    table = jnp.take(block_tables, seq_of, axis=0, mode="fill", fill_value=0)  # [T, W]

    def dense(pool: jax.Array, scales: jax.Array | None) -> jax.Array:  # [T, W * bs, Hq, D]
        pages = dequantize(pool[table], None if scales is None else scales[table], jnp.float32)
        pages = kv_pool.rotate(pages, pool.dtype, back=True)
        pages = pages.astype(jnp.float32).transpose(0, 1, 3, 2, 4)
        return jnp.repeat(pages.reshape(num_tokens, -1, num_kv_heads, head_dim), group, axis=2)

    k, v = dense(k_pool, k_scale), dense(v_pool, v_scale)
    hi = lax.Precision.HIGHEST
    logits = jnp.einsum("thd,tshd->ths", q.astype(jnp.float32), k, precision=hi) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    key = jnp.arange(k.shape[1])[None, :]
    last = positions if limits is None else limits
    visible = (key <= last[:, None]) & (seq_of < block_tables.shape[0])[:, None]
    if sliding_window is not None:
        visible &= key > positions[:, None] - sliding_window
    logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
    any_visible = visible.any(axis=-1)[:, None, None]
    weights = jax.nn.softmax(jnp.where(any_visible, logits, 0.0), axis=-1)
    out = jnp.einsum("ths,tshd->thd", weights, v, precision=hi)
    return jnp.where(any_visible, out, 0.0).astype(q.dtype)
