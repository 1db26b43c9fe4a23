"""What the runner and engine may call on a host KV cache, whichever backend is behind it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


class SaltedIds(list[int]):
    """Token ids whose cached blocks match only ids of the same `salt`: a request served
    with a LoRA adapter computes other K/V than the base model for the same tokens. A
    prefix cache starts its chain of block keys from the salt (plain ids: from b"").

    `images`: (start, end, key) of each image's tokens: a block holding some of them is
    keyed by the image's `key` too (a hash of its pixels), so the same tokens with another
    image never match."""

    def __init__(
        self, ids: Sequence[int], salt: bytes, images: Sequence[tuple[int, int, bytes]] = ()
    ) -> None:
        super().__init__(ids)
        self.salt = salt
        self.images = tuple(images)

    def block_salt(self, start: int, end: int) -> bytes:
        """The keys of the images with tokens in positions [start, end)."""
        return b"".join(key for a, b, key in self.images if a < end and start < b)

    def with_ids(self, ids: Sequence[int]) -> SaltedIds:
        return SaltedIds(ids, self.salt, self.images)


def salt_of(token_ids: Sequence[int]) -> bytes:
    return token_ids.salt if isinstance(token_ids, SaltedIds) else b""


def block_salt(token_ids: Sequence[int], start: int, end: int) -> bytes:
    """What keys a block of positions [start, end) besides its tokens (its images')."""
    return token_ids.block_salt(start, end) if isinstance(token_ids, SaltedIds) else b""


class OutOfBlocksError(Exception):
    """The pool has too few free blocks (or slots) for the request; the scheduler catches this."""


@runtime_checkable
class CacheProtocol(Protocol):
    """Host-side KV memory management: sequences, their pages and their lengths.

    A sequence id comes from `allocate_seq`. Its length counts the tokens whose
    K/V is stored, including those a step is about to write: the scheduler grows it with
    `allocate_slots(seq, n)` before a step that writes `n` tokens, the engine then reads
    `page_tables(...)`.

    Prefix caching: `allocate_seq(n, token_ids)` may start a sequence with the
    cached K/V of a prefix of `token_ids` (its length is then that prefix's
    length, never all of `token_ids`), and `cache_blocks` publishes a sequence's
    computed full blocks for later requests. A backend without a prefix cache
    reports no hits and ignores `cache_blocks`.
    """

    block_size: int
    num_blocks: int  # device pool size, null block included
    num_groups: int  # KV-cache groups: page tables per sequence (`jpaged.cache.groups`)
    max_seq_tokens: int  # the most tokens one sequence can ever hold

    def allocate_seq(self, initial_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Reserve room for `initial_tokens`; raises OutOfBlocksError.

        The length starts at 0, or, given the `token_ids` (`initial_tokens` of them)
        and a prefix cache, at the tokens of the longest cached run of full blocks
        matching them, at most `initial_tokens - 1` (the last token is always computed).
        """
        ...

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """What `allocate_seq(len(token_ids), token_ids)` would start the length at now
        (no side effects: for admission accounting)."""
        ...

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """The first `num_computed` of the sequence's `token_ids` now have their K/V in
        the pool: make its full blocks among them findable by later prefix lookups."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the device pool's contents were lost)."""
        ...

    def free_seq(self, seq_id: int) -> None: ...

    def get_seq_len(self, seq_id: int) -> int: ...

    def free_seq_count(self) -> int:
        """How many more sequences may be allocated (slots or, for paged, a large number)."""
        ...

    def free_block_capacity(self) -> int | None:
        """Free blocks (evictable cached ones included); None when memory is reserved
        per slot."""
        ...

    def allocate_slots(
        self,
        seq_id: int | None,
        num_new_tokens: int,
        *,
        num_tokens: int = 0,
        token_ids: Sequence[int] | None = None,
        reserve: int = 0,
    ) -> tuple[int, list[tuple[int, int]]] | None:
        """Room for a step that computes `num_new_tokens` more tokens of sequence `seq_id`,
        or of a new one (`seq_id` None: `allocate_seq(num_tokens, token_ids)`, its first
        `num_new_tokens` after the cached prefix), all or nothing: the sequence id and the
        block copies `append` returns, or None, changing nothing, when the pool cannot hold
        what the step holds with `reserve` blocks to spare.

        What the step holds counts a prompt chunk's peak (a sliding group holds the whole
        chunk's blocks while it is computed), the blocks windows give back and the
        copy-on-write of shared blocks; the one question the scheduler asks.
        """
        ...

    def grow_decodes(self, seq_ids: Sequence[int], n: int = 1) -> list[bool]:
        """`allocate_slots(seq, n)` for each of these distinct sequences (a step's decodes,
        `n` tokens each: several decode steps a call) that it would grant without touching
        the pool: no block allocated, copied or given back. Whether each one grew; the rest
        are left as they were (for `allocate_slots`)."""
        ...

    def grow_all(self, seq_ids: Sequence[int]) -> bool:
        """`allocate_slots(seq, 1)` for every one of these distinct sequences (a steady
        decode step's), all or nothing, where each would take at most one fresh block of
        its own, in their order: nothing copied, shared or given back. Whether they grew;
        if not, nothing changed (`allocate_slots` row by row decides)."""
        ...

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Grow the length by `num_tokens`, allocating blocks lazily; raises OutOfBlocksError.

        Returns `(src, dst)` block copies the device pool must do before the
        write (copy-on-write of a shared last block).
        """
        ...

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink the length back to `num_tokens` (a step's rejected speculative tokens):
        blocks held only for the tokens past it go back to the allocator."""
        ...

    def fork(self, seq_id: int) -> int:
        """A new sequence holding the K/V of `seq_id`: sharing its blocks (ref counts,
        copy-on-write), or, without sharing, a copy of them that its first `append` returns;
        raises OutOfBlocksError."""
        ...

    def page_tables(self, seq_ids: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's page table in every group, the blocks it holds cut or padded
        with the null block 0 to `width` columns, and its length: int32
        [num_groups, n, width], int32 [n]. Columns past the pages its length covers are
        not for reading (`ragged_plan.plan` masks them), nor those a sliding
        group's window has passed (null). KeyError for an unknown sequence."""
        ...

    def stats(self) -> dict[str, float]:
        """Memory statistics: blocks total/used/free, utilization, fragmentation, counters,
        prefix cache and sharing figures (the same keys for every backend)."""
        ...

    def audit(self) -> list[int]:
        """Block ids held by the allocator that no sequence references (leaks)."""
        ...
