"""Contiguous baseline: each sequence reserves a whole `max_seq_len` region up front.

Expressed in the paged device layout (region i owns blocks `1 + i*bps ..
(i+1)*bps`) so one jitted model step serves both backends; only the host
policy differs, and `stats()` shows the memory it reserves but does not use.
It has no prefix cache (no hits, `cache_blocks` is a no-op), and a fork shares
nothing: it takes a region of its own, into which the parent's blocks are copied
before the fork's first write (where the paged backend copies one block).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from jpaged.cache.paged import cdiv, memory_stats, page_tables
from jpaged.cache.protocol import OutOfBlocksError


class ContiguousKVCache:
    """Contiguous backend of CacheProtocol: `max_batch_size` regions of `max_seq_len` tokens."""

    num_groups = 1  # a region keeps every layer's whole context (for comparison)

    @staticmethod
    def total_blocks(max_batch_size: int, max_seq_len: int, block_size: int) -> int:
        """The device pool's blocks: the null block and every region's."""
        return 1 + max_batch_size * cdiv(max_seq_len, block_size)

    def __init__(self, max_batch_size: int, max_seq_len: int, block_size: int) -> None:
        for name, value in [
            ("max_batch_size", max_batch_size),
            ("max_seq_len", max_seq_len),
            ("block_size", block_size),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_batch_size = max_batch_size
        self.max_seq_len = self.max_seq_tokens = max_seq_len
        self.block_size = block_size
        self.blocks_per_region = cdiv(max_seq_len, block_size)
        self.num_blocks = self.total_blocks(max_batch_size, max_seq_len, block_size)
        self._regions: dict[int, int] = {}  # seq id -> region
        self._free = list(range(max_batch_size - 1, -1, -1))  # lowest region first
        self._lens = np.zeros(max_batch_size, np.int64)
        self._copies: dict[int, list[tuple[int, int]]] = {}  # a fork's, due at its first append
        self._next_seq = 0
        self._t0 = time.perf_counter()
        self.num_allocations = 0  # blocks reserved, a whole region at a time
        self.num_frees = 0
        self.peak_regions = 0

    def allocate_seq(self, initial_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        if not 0 <= initial_tokens <= self.max_seq_len:
            raise ValueError(
                f"initial_tokens must be in [0, max_seq_len={self.max_seq_len}], "
                f"got {initial_tokens}"
            )
        if not self._free:
            raise OutOfBlocksError(f"all {self.max_batch_size} regions are in use")
        seq = self._next_seq
        self._next_seq += 1
        self._regions[seq] = self._free.pop()
        self.num_allocations += self.blocks_per_region
        self.peak_regions = max(self.peak_regions, len(self._regions))
        return seq

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        return 0  # no prefix cache

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        self._region(seq_id)

    def reset_prefix_cache(self) -> None:
        pass

    def free_seq(self, seq_id: int) -> None:
        region = self._region(seq_id)
        del self._regions[seq_id]
        self._copies.pop(seq_id, None)
        self._lens[region] = 0
        self._free.append(region)
        self.num_frees += self.blocks_per_region

    def fork(self, seq_id: int) -> int:
        parent = self._region(seq_id)
        seq = self.allocate_seq(0)
        region = self._regions[seq]
        self._lens[region] = length = self._lens[parent]
        first = 1 + np.array([parent, region]) * self.blocks_per_region
        self._copies[seq] = [
            (int(first[0]) + c, int(first[1]) + c)
            for c in range(cdiv(int(length), self.block_size))
        ]
        return seq

    def get_seq_len(self, seq_id: int) -> int:
        return int(self._lens[self._region(seq_id)])

    def free_seq_count(self) -> int:
        return len(self._free)

    def free_block_capacity(self) -> int | None:
        return None  # memory is reserved per region, not per token

    def allocate_slots(
        self,
        seq_id: int | None,
        num_new_tokens: int,
        *,
        num_tokens: int = 0,
        token_ids: Sequence[int] | None = None,
        reserve: int = 0,
    ) -> tuple[int, list[tuple[int, int]]] | None:
        # A region is the most a sequence ever holds: a step fits when its sequence gets a
        # region and stays inside it (so `reserve`, in blocks, has nothing to keep).
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if seq_id is None:
            if not self._free or num_new_tokens > self.max_seq_len:
                return None
            seq_id = self.allocate_seq(num_tokens, token_ids)
        elif self.get_seq_len(seq_id) + num_new_tokens > self.max_seq_len:
            return None
        return seq_id, self.append(seq_id, num_new_tokens)

    def grow_decodes(self, seq_ids: Sequence[int], n: int = 1) -> list[bool]:
        # (a fork's first growth returns its copy: `allocate_slots` hands that on)
        regions = np.fromiter(map(self._region, seq_ids), np.int64, len(seq_ids))
        ok = (self._lens[regions] + n <= self.max_seq_len) & np.array(
            [s not in self._copies for s in seq_ids], bool
        )
        self._lens[regions[ok]] += n
        return ok.tolist()

    def grow_all(self, seq_ids: Sequence[int]) -> bool:
        regions = np.fromiter(map(self._region, seq_ids), np.int64, len(seq_ids))
        # (a fork's first growth returns its copy: `allocate_slots` hands that on)
        full = (self._lens[regions] + 1 > self.max_seq_len).any()
        if full or not self._copies.keys().isdisjoint(seq_ids):
            return False
        self._lens[regions] += 1
        return True

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        region = self._region(seq_id)
        new = int(self._lens[region]) + num_tokens
        if num_tokens < 0 or new > self.max_seq_len:
            raise ValueError(
                f"sequence {seq_id}: {self._lens[region]} + {num_tokens} tokens is outside "
                f"[0, max_seq_len={self.max_seq_len}]"
            )
        self._lens[region] = new
        return self._copies.pop(seq_id, [])  # a fork's copy of its parent, else nothing

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        region = self._region(seq_id)
        if not 0 <= num_tokens <= self._lens[region]:
            raise ValueError(
                f"sequence {seq_id}: cannot truncate {self._lens[region]} tokens to {num_tokens}"
            )
        self._lens[region] = num_tokens

    def page_tables(self, seq_ids: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        regions = np.fromiter((self._region(s) for s in seq_ids), np.int64, len(seq_ids))
        # A region's blocks are consecutive, so its page table is arithmetic, not stored.
        cols = np.arange(min(width, self.blocks_per_region))
        tables = 1 + regions[:, None] * self.blocks_per_region + cols
        return page_tables(tables[None], self._lens[regions], width)

    def stats(self) -> dict[str, float]:
        s = memory_stats(
            blocks_total=self.num_blocks - 1,
            blocks_used=len(self._regions) * self.blocks_per_region,
            tokens_stored=int(self._lens.sum()),
            block_size=self.block_size,
            allocations=self.num_allocations,
            frees=self.num_frees,
            elapsed=time.perf_counter() - self._t0,
            blocks_used_peak=self.peak_regions * self.blocks_per_region,
        )
        s["num_seqs"] = len(self._regions)
        return s

    def audit(self) -> list[int]:
        return []  # blocks belong to regions by construction: nothing can leak

    def _region(self, seq_id: int) -> int:
        try:
            return self._regions[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r} (never allocated or freed)") from None
