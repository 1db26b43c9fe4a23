"""The ragged attention kernel's host plan, NumPy only: a step's flat tokens as the
kernel's metadata (`Ragged`: each token's sequence and position, the page tables, the
Pallas query tiles and the XLA path's work items), the static list sizes of a token
bucket (`sizes`) and the Pallas kernel's context splits (`num_splits`).

Apart from `ragged_attention` (the device kernel) so that the engine plans its steps
without importing JAX's Pallas modules, and so that both kernel bodies
(`ragged_attention`, `ragged_mosaic`) read one plan. See `ragged_attention` for how the
tiles, work items and splits are walked."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

# Query tokens per Pallas program (Triton dots want >= 16 rows: the tile's tokens x the
# KV head's query heads).
PALLAS_TILE = 16
# Query tokens per work item of a prompt chunk on the XLA path: each item gathers one
# page for this many queries.
XLA_TILE = 32
# Context splits aim for this many waves of programs over the GPU's SMs: with one wave,
# the SMs that finish first idle behind the slowest.
SPLIT_WAVES = 2


class Ragged(NamedTuple):
    """A step's attention metadata (NumPy on the host, device arrays in the step)."""

    seq_of: Any  # int32 [T]: each token's sequence; S for padding tokens
    positions: Any  # int32 [T]: each token's position in its sequence
    block_tables: Any  # int32 [S, W]: each sequence's pages (pallas, reference); a model
    # step's meta has one table per KV group, [G, S, W] (`models.common.group_meta`)
    tiles: Any  # int32 [2, NT]: (sequence, first token) per Pallas query tile; (S, T) pads
    token_tile: Any  # int32 [T] (Pallas; [0] else): tile * PALLAS_TILE + row of each token
    # XLA work items, (block, first token, first key position) each, padded with (0, T, 0):
    single: Any  # int32 [3, P1]: a decoding sequence's token and one of its pages
    tiled: Any  # int32 [3, PQ]: XLA_TILE tokens of a prompt chunk and one of their pages
    num_work: Any  # int32 [2]: live items at the head of `single` and of `tiled`
    # int32 [T] or [0]: the last key position each token sees (its own position but for a
    # Gemma 3 image token, which sees its whole image: `plan`'s `extents`); [0]: causal.
    limits: Any = np.zeros(0, np.int32)


def sizes(num_tokens: int, num_seqs: int, width: int, impl: str) -> tuple[int, int, int]:
    """Static list sizes (Pallas tiles, single-token items, tile items) for a bucket of
    `num_tokens` tokens over at most `num_seqs` sequences of at most `width` pages.
    Each sequence starts at most one partial tile."""
    if impl == "pallas":
        return -(-num_tokens // PALLAS_TILE) + num_seqs, 0, 0
    tiles = min(-(-num_tokens // XLA_TILE) + num_seqs, num_tokens // 2)
    return 0, min(num_seqs, num_tokens) * width, tiles * width


def plan(
    query_lens: np.ndarray,  # int [n]: new tokens of each sequence, laid out in order
    context_lens: np.ndarray,  # int [n]: tokens stored incl. the new ones
    block_tables: np.ndarray,  # int32 [..., n, >= pages]: each sequence's pages (per group)
    *,
    num_tokens: int,
    num_seqs: int,
    width: int,
    block_size: int,
    impl: str,
    extents: np.ndarray | None = None,
) -> Ragged:
    """The metadata of `n` sequences whose new tokens fill the flat axis in order, padded
    to a bucket of `num_tokens` tokens, `num_seqs` sequences, `width` pages each. Leading
    dims of `block_tables` (KV groups) are kept; the work items hold the first table's
    blocks.

    `extents` (int [sum(query_lens)], or None: causal): how many keys past its own
    position each new token also sees (bidirectional attention within an image: those
    keys must be new tokens of the same step); the metadata then has `limits`."""
    q = np.asarray(query_lens, np.int64)
    ctx = np.asarray(context_lens, np.int64)
    n = len(q)
    pages = -(-ctx // block_size)
    total = int(q.sum())
    if n > num_seqs or total > num_tokens:
        raise ValueError(
            f"{n} sequences of {total} tokens exceed the bucket "
            f"({num_seqs} sequences, {num_tokens} tokens)"
        )
    if n and (q.min() < 1 or (q > ctx).any()):
        raise ValueError(f"query_lens {q.tolist()} must be in [1, context_lens {ctx.tolist()}]")
    if n and pages.max() > min(width, block_tables.shape[-1]):
        raise ValueError(f"a sequence holds {pages.max()} pages, the tables only {width}")
    starts = np.cumsum(q) - q
    seq_of = np.full(num_tokens, num_seqs, np.int32)
    live = slice(total)  # (the new tokens lead the flat axis: a slice, not a mask)
    seq_of[live], within = _expand(q)
    positions = np.zeros(num_tokens, np.int32)
    positions[live] = (ctx - q)[seq_of[live]] + within
    limits = np.zeros(0, np.int32)
    reach = np.zeros(num_tokens, np.int64)  # keys past each token's position it sees
    if extents is not None:
        reach[live] = extents
        if (reach < 0).any() or (within + reach[live] >= q[seq_of[live]]).any():
            raise ValueError("extents must stay within each sequence's new tokens")
        limits = (positions + reach).astype(np.int32)
    tables = np.zeros((*block_tables.shape[:-2], num_seqs, width), np.int32)
    tables[..., :n, :] = np.where(np.arange(width) < pages[:, None], block_tables[..., :width], 0)
    first_table = tables.reshape(-1, num_seqs, width)[0]

    num_tiles, p1, pq = sizes(num_tokens, num_seqs, width, impl)
    tiles = np.array([[num_seqs], [num_tokens]], np.int32).repeat(num_tiles, 1)
    token_tile = np.full(num_tokens if impl == "pallas" else 0, num_tiles * PALLAS_TILE, np.int32)
    work = [np.array([[0], [num_tokens], [0]], np.int32).repeat(size, 1) for size in (p1, pq)]
    num_work = np.zeros(2, np.int32)
    if impl == "pallas":
        per_seq = -(-q // PALLAS_TILE)
        seq, k = _expand(per_seq)
        tiles[:, : len(seq)] = seq, starts[seq] + k * PALLAS_TILE
        # a sequence's tiles are consecutive, and so are its tokens
        token_tile[live] = np.repeat(np.cumsum(per_seq) - per_seq, q) * PALLAS_TILE + within
    else:
        for part, (sel, size, tile) in enumerate(((q == 1, p1, 1), (q > 1, pq, XLA_TILE))):
            if not sel.any():  # (a pure decode step has no tiled part: ~30 NumPy calls)
                continue
            seq, k = _expand(np.where(sel, -(-q // tile), 0))
            first = starts[seq] + k * tile
            # a tile sees its sequence's pages up to its last token's (or the furthest
            # key a token of it sees)
            end = np.minimum((k + 1) * tile, q[seq])
            last = (ctx - q)[seq] + end - 1
            if extents is not None:
                sees = positions + reach
                last = np.array(
                    [sees[f : f + n].max() for f, n in zip(first, end - k * tile, strict=True)],
                    np.int64,
                ).reshape(last.shape)
            item_tile, page = _expand(last // block_size + 1)
            if len(page) > size:
                raise ValueError(f"{len(page)} work items exceed the bucket's {size}")
            work[part][:, : len(page)] = (
                first_table[seq[item_tile], page],
                first[item_tile],
                page * block_size,
            )
            num_work[part] = len(page)
    return Ragged(seq_of, positions, tables, tiles, token_tile, work[0], work[1], num_work, limits)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, index within the owner) of each of `counts[i]` things owned by each i."""
    owner = np.repeat(np.arange(len(counts)), counts)
    return owner, np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)


def num_splits(num_tiles: int, num_kv_heads: int, num_chunks: int, sms: int) -> int:
    """Context splits per (query tile, KV head): enough programs for SPLIT_WAVES waves of
    `sms` SMs, 1 when the tiles x heads already fill them, never more than the chunks of
    a page table. Static shapes only: a token bucket fixes its tiles (`sizes`) and the
    table width, so each bucket compiles one split count and batches never recompile."""
    programs = num_tiles * num_kv_heads
    if programs >= sms:
        return 1
    return max(1, min(num_chunks, -(-SPLIT_WAVES * sms // programs)))
