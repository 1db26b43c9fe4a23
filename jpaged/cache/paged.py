"""Paged KV cache: per-sequence page tables over a shared block allocator.

Page tables and lengths live in NumPy arrays indexed by a row per live
sequence, so a step's page tables are a few vectorised gathers rather
than Python loops over sequences or tokens.

Automatic prefix caching: every full block of computed tokens gets a content
key chained from the previous block's key (`block_key`), so equal keys mean
equal whole prefixes; the allocator keeps the block's token ids next to its
key and compares them on lookup. A new sequence reuses the longest cached run
of full blocks of its prompt (ref count +1, reviving evictable ones) and only
the rest is prefilled. Cached blocks are full and never written again, so a
sequence's writes land in blocks of its own (or shared forks, which
copy-on-write applies to).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence

import numpy as np

from jpaged.cache.allocator import BlockAllocator
from jpaged.cache.protocol import OutOfBlocksError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_tables(
    tables: np.ndarray,  # int [n, any]: each sequence's blocks, 0 past them
    lens: np.ndarray,  # int [n]: tokens each sequence holds
    width: int,
) -> tuple[np.ndarray, np.ndarray]:  # int32 [n, width], int32 [n]
    """The tables cut or padded (with the null block) to `width` columns, and the lengths.
    Which columns a step may read follows from the lengths: `ragged_attention.plan` alone
    masks the rest."""
    out = np.zeros((len(tables), width), np.int32)
    w = min(width, tables.shape[1])
    out[:, :w] = tables[:, :w]
    return out, np.asarray(lens, np.int32)


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Content key of a full block: a 128-bit hash of the previous block's key and this
    block's token ids, so equal keys mean equal prefixes up to and including it."""
    data = np.asarray(tokens, np.int64).tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


# The keys of `memory_stats` that only grow (the rest are levels, rates and ratios).
MEMORY_COUNTERS = ("allocations", "frees", "uptime_s", "prefix_cache_queries",
                   "prefix_cache_hits", "prefix_cache_evictions", "prefix_cache_evicted_blocks",
                   "cow_copies")  # fmt: skip


def memory_stats(
    *,
    blocks_total: int,
    blocks_used: int,
    tokens_stored: int,
    block_size: int,
    allocations: int,
    frees: int,
    elapsed: float,
    blocks_used_peak: int,
    prefix_cache_queries: int = 0,
    prefix_cache_hits: int = 0,
    prefix_cache_blocks: int = 0,
    prefix_cache_evictable_blocks: int = 0,
    prefix_cache_evictions: int = 0,
    prefix_cache_evicted_blocks: int = 0,
    cow_copies: int = 0,
    shared_blocks: int = 0,
) -> dict[str, float]:
    """The statistics both backends report, in the same keys.

    Prefix cache queries and hits count prompt tokens (looked up at admission /
    served from cached blocks); evictions count allocations that had to evict,
    evicted blocks the cached blocks they reclaimed; shared blocks are those
    with more than one holder right now.
    """
    slots = blocks_used * block_size
    empty = slots - tokens_stored
    elapsed = max(elapsed, 1e-9)
    return {
        "blocks_total": blocks_total,
        "blocks_used": blocks_used,
        "blocks_free": blocks_total - blocks_used,
        "blocks_used_peak": blocks_used_peak,
        "tokens_stored": tokens_stored,
        "utilization": tokens_stored / slots if slots else 0.0,
        "fragmentation_slots": empty,
        "fragmentation": empty / slots if slots else 0.0,
        "allocations": allocations,
        "frees": frees,
        "allocations_per_s": allocations / elapsed,
        "frees_per_s": frees / elapsed,
        "uptime_s": elapsed,
        "prefix_cache_queries": prefix_cache_queries,
        "prefix_cache_hits": prefix_cache_hits,
        "prefix_cache_hit_rate": (
            prefix_cache_hits / prefix_cache_queries if prefix_cache_queries else 0.0
        ),
        "prefix_cache_blocks": prefix_cache_blocks,
        "prefix_cache_evictable_blocks": prefix_cache_evictable_blocks,
        "prefix_cache_evictions": prefix_cache_evictions,
        "prefix_cache_evicted_blocks": prefix_cache_evicted_blocks,
        "cow_copies": cow_copies,
        "shared_blocks": shared_blocks,
    }


class PagedKVCache:
    """Paged backend of CacheProtocol: blocks handed out on demand, shared by ref count."""

    supports_fork = True

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_seq_tokens = (num_blocks - 1) * block_size  # every block but the null one
        self.enable_prefix_caching = enable_prefix_caching
        # Per sequence: the content keys of its leading full computed blocks (the chain).
        self._keys: dict[int, list[bytes]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of which served from cached blocks
        self._rows: dict[int, int] = {}  # seq id -> row of the arrays below
        self._free_rows = list(range(7, -1, -1))  # rows of the arrays below, lowest first
        self._tables = np.zeros((8, 8), np.int32)  # page tables, 0 past a row's blocks
        self._lens = np.zeros(8, np.int64)  # tokens stored (incl. the step about to run)
        self._nblocks = np.zeros(8, np.int64)  # blocks held; may exceed pages while prompt fills
        self._next_seq = 0
        self._t0 = time.perf_counter()
        self.num_cow_copies = 0

    # -- sequences ---------------------------------------------------------

    def allocate_seq(self, initial_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        if initial_tokens < 0:
            raise ValueError(f"initial_tokens must be >= 0, got {initial_tokens}")
        if token_ids is not None and len(token_ids) != initial_tokens:
            raise ValueError(f"{len(token_ids)} token_ids given for {initial_tokens} tokens")
        n = cdiv(initial_tokens, self.block_size)
        hits, keys = self._match(token_ids)
        revive = sum(self.allocator.is_evictable(b) for b in hits)
        if not self.allocator.can_allocate(n - len(hits) + revive):
            raise OutOfBlocksError(
                f"need {n - len(hits) + revive} blocks ({len(hits)} cached), "
                f"{self.allocator.num_free} free"
            )
        seq = self._next_seq
        # Cached blocks first, so that allocating the rest cannot evict them.
        for b in hits:
            self.allocator.acquire(b, owner=seq)
        # Eager: fail before the forward pass, never halfway through the prompt.
        blocks = hits + self.allocator.allocate_many(n - len(hits), owner=seq)
        self._next_seq += 1
        row = self._new_row(seq)
        self._ensure_cols(n)
        self._tables[row, :n] = blocks
        self._nblocks[row] = n
        self._lens[row] = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self._keys[seq] = keys
            if token_ids is not None:
                self.num_prefix_queries += initial_tokens
                self.num_prefix_hits += len(hits) * self.block_size
        return seq

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        return len(self._match(token_ids)[0]) * self.block_size

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        keys = self._keys.get(seq_id)
        if keys is None:  # prefix caching off
            self._row(seq_id)
            return
        bs = self.block_size
        full = min(num_computed, len(token_ids), int(self._lens[self._row(seq_id)])) // bs
        if full <= len(keys):
            return
        table = self._tables[self._rows[seq_id]]
        parent = keys[-1] if keys else b""
        for k in range(len(keys), full):
            tokens = token_ids[k * bs : (k + 1) * bs]
            parent = block_key(parent, tokens)
            keys.append(parent)
            # False when another block holds this prefix already: this one stays private.
            self.allocator.cache(int(table[k]), parent, tokens)

    def reset_prefix_cache(self) -> None:
        self.allocator.drop_cache()
        for keys in self._keys.values():
            keys.clear()  # their blocks' contents are gone too: nothing to chain from

    def free_seq(self, seq_id: int) -> None:
        row = self._row(seq_id)
        # Last block first: cached blocks join the LRU list tail-first, so a prompt's
        # later blocks are evicted before the prefix other prompts are likelier to share.
        for b in reversed(self._tables[row, : self._nblocks[row]].tolist()):
            self.allocator.free(b)
        self._tables[row] = 0
        self._lens[row] = 0
        self._nblocks[row] = 0
        del self._rows[seq_id]
        self._keys.pop(seq_id, None)
        self._free_rows.append(row)

    def fork(self, seq_id: int) -> int:
        row = self._row(seq_id)
        blocks = self._tables[row, : self._nblocks[row]].tolist()
        for b in blocks:
            self.allocator.share(b)
        seq = self._next_seq
        self._next_seq += 1
        new = self._new_row(seq)
        self._tables[new] = self._tables[row]
        self._lens[new] = self._lens[row]
        self._nblocks[new] = self._nblocks[row]
        if seq_id in self._keys:
            self._keys[seq] = list(self._keys[seq_id])
        return seq

    def get_seq_len(self, seq_id: int) -> int:
        return int(self._lens[self._row(seq_id)])

    def free_seq_count(self) -> int:
        return sys.maxsize  # sequences are bounded by blocks, not regions

    def free_token_capacity(self) -> int | None:
        return self.allocator.num_free * self.block_size  # evictable blocks count as free

    # -- growth --------------------------------------------------------------

    def _plan(self, row: int, num_tokens: int) -> tuple[int, int, list[int]]:
        """(new length, new blocks to allocate, shared block indices the write touches)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        bs = self.block_size
        old = int(self._lens[row])
        have = int(self._nblocks[row])
        new = old + num_tokens
        need = cdiv(new, bs)
        table = self._tables[row]
        ref = self.allocator.ref_count
        shared = [k for k in range(old // bs, min(have, need)) if ref(int(table[k])) > 1]
        return new, max(0, need - have), shared

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        _, grow, shared = self._plan(self._row(seq_id), num_tokens)
        return self.allocator.can_allocate(grow + len(shared))

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        row = self._row(seq_id)
        # Fast path, most decode steps: every token lands in one held, private block.
        old = int(self._lens[row])
        k = old // self.block_size
        if (
            num_tokens > 0
            and (old + num_tokens - 1) // self.block_size == k
            and k < self._nblocks[row]
            and self.allocator.ref_count(int(self._tables[row, k])) == 1
        ):
            self._lens[row] = old + num_tokens
            return []
        new, grow, shared = self._plan(row, num_tokens)
        if not self.allocator.can_allocate(grow + len(shared)):
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {grow + len(shared)} blocks, "
                f"{self.allocator.num_free} free"
            )
        have = int(self._nblocks[row])
        self._ensure_cols(have + grow)
        table = self._tables[row]
        filled = cdiv(int(self._lens[row]), self.block_size)
        copies = []
        for k in shared:
            src = int(table[k])
            dst = self.allocator.allocate(owner=seq_id)
            self.allocator.free(src)  # still held by the other sharers, so its data survives
            table[k] = dst
            if k < filled:  # only a block already holding this sequence's tokens needs its data
                copies.append((src, dst))
        if grow:
            table[have : have + grow] = self.allocator.allocate_many(grow, owner=seq_id)
            self._nblocks[row] = have + grow
        self._lens[row] = new
        self.num_cow_copies += len(copies)
        return copies

    # -- page tables ---------------------------------------------------------

    def page_tables(self, seq_ids: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.fromiter((self._row(s) for s in seq_ids), np.int64, len(seq_ids))
        return page_tables(self._tables[rows, :width], self._lens[rows], width)

    # -- accounting ----------------------------------------------------------

    def stats(self) -> dict[str, float]:
        a = self.allocator
        rows = np.fromiter(self._rows.values(), np.int64, len(self._rows))
        tables = self._tables[rows]
        cols = np.arange(tables.shape[1])
        held = cols < self._nblocks[rows][:, None]
        fill = np.clip(self._lens[rows][:, None] - cols * self.block_size, 0, self.block_size)
        # Shared blocks hold one copy of their tokens: count each block once, at its fullest.
        per_block = np.zeros(self.num_blocks, np.int64)
        np.maximum.at(per_block, tables[held], fill[held])
        s = memory_stats(
            blocks_total=self.num_blocks - 1,
            blocks_used=a.num_used,
            tokens_stored=int(per_block.sum()),
            block_size=self.block_size,
            allocations=a.num_allocations,
            frees=a.num_frees,
            elapsed=time.perf_counter() - self._t0,
            blocks_used_peak=a.peak_used,
            prefix_cache_queries=self.num_prefix_queries,
            prefix_cache_hits=self.num_prefix_hits,
            prefix_cache_blocks=a.num_cached,
            prefix_cache_evictable_blocks=a.num_evictable,
            prefix_cache_evictions=a.num_evictions,
            prefix_cache_evicted_blocks=a.num_evicted_blocks,
            cow_copies=self.num_cow_copies,
            shared_blocks=a.num_shared,
        )
        s["num_seqs"] = len(self._rows)
        return s

    def audit(self) -> list[int]:
        rows = np.fromiter(self._rows.values(), np.int64, len(self._rows))
        held = np.arange(self._tables.shape[1]) < self._nblocks[rows][:, None]
        return self.allocator.audit(self._tables[rows][held].tolist())

    # -- internals -----------------------------------------------------------

    def _match(self, token_ids: Sequence[int] | None) -> tuple[list[int], list[bytes]]:
        """Cached blocks (and their keys) of the longest matching run of full blocks,
        leaving at least the last token to compute."""
        if not self.enable_prefix_caching or not token_ids:
            return [], []
        bs = self.block_size
        hits: list[int] = []
        keys: list[bytes] = []
        parent = b""
        for k in range((len(token_ids) - 1) // bs):
            tokens = token_ids[k * bs : (k + 1) * bs]
            parent = block_key(parent, tokens)
            block = self.allocator.lookup(parent, tokens)
            if block is None:
                break
            hits.append(block)
            keys.append(parent)
        return hits, keys

    def _row(self, seq_id: int) -> int:
        try:
            return self._rows[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r} (never allocated or freed)") from None

    def _new_row(self, seq: int) -> int:
        if not self._free_rows:
            cap = len(self._lens)
            self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)])
            self._lens = np.concatenate([self._lens, np.zeros_like(self._lens)])
            self._nblocks = np.concatenate([self._nblocks, np.zeros_like(self._nblocks)])
            self._free_rows = list(range(2 * cap - 1, cap - 1, -1))
        row = self._free_rows.pop()
        self._rows[seq] = row
        return row

    def _ensure_cols(self, n: int) -> None:
        cols = self._tables.shape[1]
        if n > cols:
            grown = np.zeros((self._tables.shape[0], max(n, 2 * cols)), np.int32)
            grown[:, :cols] = self._tables
            self._tables = grown
