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
from jpaged.cache.groups import KVGroups, first_visible_block
from jpaged.cache.protocol import OutOfBlocksError, block_salt, salt_of


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_tables(
    tables: np.ndarray,  # int [G, n, any]: each group's table of each sequence, 0 past it
    lens: np.ndarray,  # int [n]: tokens each sequence holds
    width: int,
) -> tuple[np.ndarray, np.ndarray]:  # int32 [G, n, width], int32 [n]
    """The tables cut or padded (with the null block) to `width` columns, and the lengths.
    Which columns a step may read follows from the lengths: `ragged_plan.plan` alone
    masks the rest."""
    out = np.zeros((*tables.shape[:2], width), np.int32)
    w = min(width, tables.shape[2])
    out[:, :, :w] = tables[:, :, :w]
    return out, np.asarray(lens, np.int32)


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Content key of a full block: a 128-bit hash of the previous block's key and this
    block's token ids, so equal keys mean equal prefixes up to and including it."""
    data = np.asarray(tokens, np.int64).tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


# The keys of `memory_stats` that only grow (the rest are levels, rates and ratios).
MEMORY_COUNTERS = (
    "allocations",
    "frees",
    "uptime_s",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_evictions",
    "prefix_cache_evicted_blocks",
    "cow_copies",
    "window_frees",
)


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
    window_frees: int = 0,
    group_blocks: Sequence[int] | None = None,
) -> dict[str, float]:
    """The statistics both backends report, in the same keys.

    Prefix cache queries and hits count prompt tokens (looked up at admission /
    served from cached blocks); evictions count allocations that had to evict,
    evicted blocks the cached blocks they reclaimed; shared blocks are those
    with more than one holder right now; window frees count the blocks sliding-window
    groups gave back, group blocks those each KV group holds (`group{g}_blocks`).
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
        "window_frees": window_frees,
        **{f"group{g}_blocks": n for g, n in enumerate(group_blocks or [blocks_used])},
    }


class PagedKVCache:
    """Paged backend of CacheProtocol: blocks handed out on demand, shared by ref count.

    With several KV groups (`groups`) each sequence has a page table per group; a
    full group holds every block of the sequence, a sliding group only those its
    window still sees (the others go back to the allocator and read as the null
    block in its table)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        groups: KVGroups | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = groups or KVGroups.of(1)
        self.windows = self.groups.windows
        self.num_groups = len(self.windows)
        self.max_seq_tokens = self.groups.max_tokens(num_blocks - 1, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        # Per sequence: the content keys of its leading full computed blocks (the chain).
        self._keys: dict[int, list[bytes]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of which served from cached blocks
        self.num_window_frees = 0  # blocks sliding groups gave back as their windows passed
        self._rows: dict[int, int] = {}  # seq id -> row of the arrays below
        self._free_rows = list(range(7, -1, -1))  # rows of the arrays below, lowest first
        g = self.num_groups
        # page tables, 0 where no block is held (past the end, or passed by a window)
        self._tables = np.zeros((g, 8, 8), np.int32)
        self._lens = np.zeros(8, np.int64)  # tokens stored (incl. the step about to run)
        # per group, the columns held: [start, end) (start > 0 once a window has passed
        # blocks; end may exceed the pages while a prompt fills)
        self._start = np.zeros((g, 8), np.int64)
        self._end = np.zeros((g, 8), np.int64)
        self._next_seq = 0
        self._t0 = time.perf_counter()
        self.num_cow_copies = 0

    # -- sequences ---------------------------------------------------------

    def allocate_seq(self, initial_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Full groups get the whole prompt's blocks now (the prompt never fails halfway);
        sliding groups take theirs chunk by chunk (`append`), never more than the window
        and a chunk need."""
        n, hit, keys, hits, need = self._admission(initial_tokens, token_ids, 0)
        if not self.allocator.can_allocate(need):
            raise OutOfBlocksError(
                f"need {need} blocks ({hit} cached), {self.allocator.num_free} free"
            )
        seq = self._next_seq
        self._next_seq += 1
        row = self._new_row(seq)
        self._ensure_cols(n)
        # Cached blocks first, so that allocating the rest cannot evict them.
        for blocks in hits:
            for b in blocks:
                self.allocator.acquire(b, owner=seq)
        for g, (w, blocks) in enumerate(zip(self.windows, hits, strict=True)):
            end, start = (n if w is None else hit), hit - len(blocks)
            table = self._tables[g, row]
            table[start:hit] = blocks
            table[hit:end] = self.allocator.allocate_many(end - hit, owner=seq)
            self._start[g, row], self._end[g, row] = start, end
        self._lens[row] = hit * self.block_size
        if self.enable_prefix_caching:
            self._keys[seq] = keys
            if token_ids is not None:
                self.num_prefix_queries += initial_tokens
                self.num_prefix_hits += hit * self.block_size
        return seq

    def allocate_slots(
        self,
        seq_id: int | None,
        num_new_tokens: int,
        *,
        num_tokens: int = 0,
        token_ids: Sequence[int] | None = None,
        reserve: int = 0,
    ) -> tuple[int, list[tuple[int, int]]] | None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if seq_id is None:
            need = self._admission(num_tokens, token_ids, num_new_tokens)[4]
            if need > self.allocator.num_free - reserve:
                return None
            seq_id = self.allocate_seq(num_tokens, token_ids)
        elif self._in_place(row := self._row(seq_id), num_new_tokens):
            self._lens[row] += num_new_tokens  # (`append`'s fast path: most decode steps)
            return seq_id, []
        elif self._net_blocks(row, self._plan(seq_id, num_new_tokens)) > (
            self.allocator.num_free - reserve
        ):
            return None
        return seq_id, self.append(seq_id, num_new_tokens)

    def grow_decodes(self, seq_ids: Sequence[int], n: int = 1) -> list[bool]:
        # One NumPy pass for a step's decodes, where `allocate_slots` costs ~3 Python calls
        # a row: only `_in_place`'s case (no window, a held private block) is taken here.
        # Its ~15 NumPy calls cost more than `allocate_slots` below ~16 rows.
        if self.windows != (None,) or len(seq_ids) < 16:
            return [False] * len(seq_ids)
        rows = np.fromiter(map(self._row, seq_ids), np.int64, len(seq_ids))
        lens = self._lens[rows]
        k = lens // self.block_size
        held = k < self._end[0, rows]
        if n > 1:  # every token in that block
            held &= (lens + n - 1) // self.block_size == k
        blocks = self._tables[0, rows, np.where(held, k, 0)].tolist()
        ok = held & (np.array(self.allocator.ref_counts(blocks)) == 1)
        self._lens[rows] = lens + n * ok if n > 1 else lens + ok
        return ok.tolist()

    def grow_all(self, seq_ids: Sequence[int]) -> bool:
        # A steady decode step's growth in one pass: most rows in place, the few whose
        # token starts a page with a fresh block each (`append`'s plan for them: nothing
        # given back, shared or copied), taken in order as `allocate_slots` row by row would.
        if self.windows != (None,):
            return False
        rows = np.fromiter(map(self._row, seq_ids), np.int64, len(seq_ids))
        lens = self._lens[rows]
        k = lens // self.block_size
        end = self._end[0, rows]
        held = k < end
        blocks = self._tables[0, rows, np.where(held, k, 0)].tolist()
        private = np.array(self.allocator.ref_counts(blocks)) == 1
        fresh = ~held & (k == end)
        starts = np.flatnonzero(fresh)
        if not (held & private | fresh).all() or len(starts) > self.allocator.num_free:
            return False
        if len(starts):
            self._ensure_cols(int(k[starts].max()) + 1)
            for i in starts.tolist():
                block = self.allocator.allocate(owner=seq_ids[i])
                self._tables[0, rows[i], k[i]] = block
            self._end[0, rows[starts]] = k[starts] + 1
        self._lens[rows] = lens + 1
        return True

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        return self._match(token_ids)[0] * self.block_size

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        keys = self._keys.get(seq_id)
        row = self._row(seq_id)
        if keys is None:  # prefix caching off
            return
        bs = self.block_size
        full = min(num_computed, len(token_ids), int(self._lens[row])) // bs
        parent = keys[-1] if keys else salt_of(token_ids)
        for k in range(len(keys), full):
            tokens = token_ids[k * bs : (k + 1) * bs]
            parent = block_key(parent + block_salt(token_ids, k * bs, (k + 1) * bs), tokens)
            keys.append(parent)
            for g in range(self.num_groups):
                block = int(self._tables[g, row, k])
                if block:  # (a block a window passed is gone, and so is its content)
                    # False when another block holds this prefix already: it stays private.
                    self.allocator.cache(block, _group_key(parent, g), tokens)

    def reset_prefix_cache(self) -> None:
        self.allocator.drop_cache()
        for keys in self._keys.values():
            keys.clear()  # their blocks' contents are gone too: nothing to chain from

    def free_seq(self, seq_id: int) -> None:
        row = self._row(seq_id)
        # Last block first: cached blocks join the LRU list tail-first, so a prompt's
        # later blocks are evicted before the prefix other prompts are likelier to share.
        for b in reversed(self._tables[:, row].T.reshape(-1).tolist()):
            if b:
                self.allocator.free(b)
        self._tables[:, row] = 0
        self._lens[row] = 0
        self._start[:, row] = self._end[:, row] = 0
        del self._rows[seq_id]
        self._keys.pop(seq_id, None)
        self._free_rows.append(row)

    def fork(self, seq_id: int) -> int:
        row = self._row(seq_id)
        for b in self._tables[:, row].reshape(-1).tolist():
            if b:
                self.allocator.share(b)
        seq = self._next_seq
        self._next_seq += 1
        new = self._new_row(seq)
        self._tables[:, new] = self._tables[:, row]
        self._lens[new] = self._lens[row]
        self._start[:, new], self._end[:, new] = self._start[:, row], self._end[:, row]
        if seq_id in self._keys:
            self._keys[seq] = list(self._keys[seq_id])
        return seq

    def get_seq_len(self, seq_id: int) -> int:
        return int(self._lens[self._row(seq_id)])

    def free_seq_count(self) -> int:
        return sys.maxsize  # sequences are bounded by blocks, not regions

    def free_block_capacity(self) -> int | None:
        return self.allocator.num_free  # evictable blocks count as free

    # -- growth --------------------------------------------------------------

    def _plan(self, seq_id: int, num_tokens: int) -> list[tuple[range, range, list[int]]]:
        """Per group: (columns its window has passed, to give back; columns to allocate;
        shared columns the write touches, to copy). With prefix caching a passed block is
        given back once published (`cache_blocks`), so that later prompts may still find
        it: with async scheduling the next step's growth comes before this one's results."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        bs = self.block_size
        row = self._rows[seq_id]
        old = int(self._lens[row])
        keys = self._keys.get(seq_id)
        published = len(keys) if keys is not None else old // bs
        need = cdiv(old + num_tokens, bs)
        ref = self.allocator.ref_count
        plans = []
        for g, w in enumerate(self.windows):
            start, end = int(self._start[g, row]), int(self._end[g, row])
            keep = max(start, min(first_visible_block(old, w, bs), published))
            table = self._tables[g, row]
            shared = [
                k for k in range(max(old // bs, keep), min(end, need)) if ref(int(table[k])) > 1
            ]
            plans.append((range(start, keep), range(max(end, keep), need), shared))
        return plans

    def _in_place(self, row: int, num_tokens: int) -> bool:
        """The fast path, most decode steps without windows: every token lands in one held,
        private block."""
        old = self._lens.item(row)  # (`item`: a Python int, no NumPy scalar made)
        k = old // self.block_size
        return (
            self.windows == (None,)
            and num_tokens > 0
            and (old + num_tokens - 1) // self.block_size == k
            and k < self._end.item(0, row)
            and self.allocator.ref_count(self._tables.item(0, row, k)) == 1
        )

    def _net_blocks(self, row: int, plans: list[tuple[range, range, list[int]]]) -> int:
        """Blocks the plans take from the allocator, less those they give back."""
        ref = self.allocator.ref_count
        gone = sum(
            ref(int(b)) == 1
            for g, (passed, _, _) in enumerate(plans)
            for b in self._tables[g, row, passed.start : passed.stop]
            if b
        )
        return sum(len(grow) + len(shared) for _, grow, shared in plans) - gone

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        row = self._row(seq_id)
        old = int(self._lens[row])
        if self._in_place(row, num_tokens):
            self._lens[row] = old + num_tokens
            return []
        plans = self._plan(seq_id, num_tokens)
        if not any(len(passed) or len(grow) or shared for passed, grow, shared in plans):
            self._lens[row] = old + num_tokens
            return []
        net = self._net_blocks(row, plans)
        if net > self.allocator.num_free:
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {net} blocks, {self.allocator.num_free} free"
            )
        self._ensure_cols(max(grow.stop for _, grow, _ in plans))
        filled = cdiv(old, self.block_size)
        copies = []
        # Every group gives back first: any group's allocation below may reuse them.
        for g, (passed, _, _) in enumerate(plans):
            table = self._tables[g, row]
            for k in passed:
                if table[k]:
                    self.num_window_frees += self.allocator.free(int(table[k]))
                    table[k] = 0
        for g, (passed, grow, shared) in enumerate(plans):
            table = self._tables[g, row]
            for k in shared:
                src = int(table[k])
                dst = self.allocator.allocate(owner=seq_id)
                self.allocator.free(src)  # still held by the other sharers, so its data survives
                table[k] = dst
                if k < filled:  # only a block holding this sequence's tokens needs its data
                    copies.append((src, dst))
            table[grow.start : grow.stop] = self.allocator.allocate_many(len(grow), owner=seq_id)
            self._start[g, row] = passed.stop if len(passed) else self._start[g, row]
            self._end[g, row] = max(int(self._end[g, row]), grow.stop)
        self._lens[row] = old + num_tokens
        self.num_cow_copies += len(copies)
        return copies

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        row = self._row(seq_id)
        if not 0 <= num_tokens <= self._lens[row]:
            raise ValueError(
                f"sequence {seq_id}: cannot truncate {self._lens[row]} tokens to {num_tokens}"
            )
        keep = cdiv(num_tokens, self.block_size)
        for g in range(self.num_groups):
            end = int(self._end[g, row])
            if end > keep:  # blocks the rejected tokens took (never published, never shared)
                table = self._tables[g, row]
                for b in table[keep:end].tolist():
                    if b:
                        self.allocator.free(b)
                table[keep:end] = 0
                self._end[g, row] = max(keep, int(self._start[g, row]))
        self._lens[row] = num_tokens

    # -- page tables ---------------------------------------------------------

    def page_tables(self, seq_ids: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.fromiter((self._row(s) for s in seq_ids), np.int64, len(seq_ids))
        return page_tables(self._tables[:, rows, :width], self._lens[rows], width)

    # -- accounting ----------------------------------------------------------

    def stats(self) -> dict[str, float]:
        a = self.allocator
        rows = np.fromiter(self._rows.values(), np.int64, len(self._rows))
        tables = self._tables[:, rows]  # [G, n, cols]
        cols = np.arange(tables.shape[2])
        held = tables > 0
        fill = np.clip(self._lens[rows][:, None] - cols * self.block_size, 0, self.block_size)
        fill = np.broadcast_to(fill, tables.shape)
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
            window_frees=self.num_window_frees,
            group_blocks=[len(np.unique(t[t > 0])) for t in tables],
        )
        s["num_seqs"] = len(self._rows)
        return s

    def audit(self) -> list[int]:
        rows = np.fromiter(self._rows.values(), np.int64, len(self._rows))
        tables = self._tables[:, rows]
        return self.allocator.audit(tables[tables > 0].tolist())

    # -- internals -----------------------------------------------------------

    def _admission(
        self, initial_tokens: int, token_ids: Sequence[int] | None, num_new_tokens: int
    ) -> tuple[int, int, list[bytes], list[list[int]], int]:
        """A new sequence of `initial_tokens`: its pages, its cached prefix (`_match`), and
        the blocks it takes once its first `num_new_tokens` are appended (cached blocks
        revived from the evictable list included)."""
        if initial_tokens < 0:
            raise ValueError(f"initial_tokens must be >= 0, got {initial_tokens}")
        if token_ids is not None and len(token_ids) != initial_tokens:
            raise ValueError(f"{len(token_ids)} token_ids given for {initial_tokens} tokens")
        n = cdiv(initial_tokens, self.block_size)
        hit, keys, hits = self._match(token_ids)
        need = cdiv(hit * self.block_size + num_new_tokens, self.block_size)
        fresh = sum(max(n if w is None else hit, need) - hit for w in self.windows)
        revive = sum(self.allocator.is_evictable(b) for blocks in hits for b in blocks)
        return n, hit, keys, hits, fresh + revive

    def _match(self, token_ids: Sequence[int] | None) -> tuple[int, list[bytes], list[list[int]]]:
        """The longest cached prefix, in full blocks, leaving at least the last token to
        compute: its length, its keys, and per group the cached blocks it needs (vLLM's
        rule: a full group every block of it, a sliding group only those the first new
        token's window sees)."""
        none: list[list[int]] = [[] for _ in self.windows]
        if not self.enable_prefix_caching or not token_ids:
            return 0, [], none
        bs = self.block_size
        keys: list[bytes] = []
        found: list[list[int | None]] = [[] for _ in self.windows]  # per group, per block
        parent = salt_of(token_ids)
        for k in range((len(token_ids) - 1) // bs):
            tokens = token_ids[k * bs : (k + 1) * bs]
            parent = block_key(parent + block_salt(token_ids, k * bs, (k + 1) * bs), tokens)
            blocks = [
                self.allocator.lookup(_group_key(parent, g), tokens) for g in range(self.num_groups)
            ]
            if any(b is None for b, w in zip(blocks, self.windows, strict=True) if w is None):
                break
            keys.append(parent)
            for g, b in enumerate(blocks):
                found[g].append(b)
        for hit in range(len(keys), 0, -1):
            need = [range(first_visible_block(hit * bs, w, bs), hit) for w in self.windows]
            if all(found[g][k] is not None for g, cols in enumerate(need) for k in cols):
                return (
                    hit,
                    keys[:hit],
                    [
                        [found[g][k] for k in cols]  # type: ignore[misc]
                        for g, cols in enumerate(need)
                    ],
                )
        return 0, [], none

    def _row(self, seq_id: int) -> int:
        try:
            return self._rows[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r} (never allocated or freed)") from None

    def _new_row(self, seq: int) -> int:
        if not self._free_rows:
            cap = len(self._lens)
            self._tables = np.concatenate([self._tables, np.zeros_like(self._tables)], axis=1)
            self._lens = np.concatenate([self._lens, np.zeros_like(self._lens)])
            self._start = np.concatenate([self._start, np.zeros_like(self._start)], axis=1)
            self._end = np.concatenate([self._end, np.zeros_like(self._end)], axis=1)
            self._free_rows = list(range(2 * cap - 1, cap - 1, -1))
        row = self._free_rows.pop()
        self._rows[seq] = row
        return row

    def _ensure_cols(self, n: int) -> None:
        g, rows, cols = self._tables.shape
        if n > cols:
            grown = np.zeros((g, rows, max(n, 2 * cols)), np.int32)
            grown[:, :, :cols] = self._tables
            self._tables = grown


def _group_key(key: bytes, group: int) -> bytes:
    """A prefix's key in one group: each group caches its own blocks of the prefix."""
    return key + group.to_bytes(2, "little")
