"""What the runner and engine may call on a cache pool, whichever backend is behind it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import jax
import numpy as np


class OutOfBlocksError(Exception):
    """The pool has too few free blocks (or slots) for the request; the scheduler catches this."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Per-step attention metadata for a batch of B rows with up to Lq new tokens each.

    Row b holds `query_lens[b]` new tokens at positions
    `context_lens[b] - query_lens[b] + i` for `i < query_lens[b]`; the rest of the
    row is padding. Decode is `Lq == 1`. Arrays are NumPy on the host and jax
    Arrays inside the jitted step (the dataclass is a pytree).
    """

    slot_mapping: np.ndarray | jax.Array  # int32 [B, Lq] flat slot per new token, 0 for padding
    block_tables: np.ndarray | jax.Array  # int32 [B, W] page table, padded with null block 0
    context_lens: np.ndarray | jax.Array  # int32 [B] tokens visible incl. this step's, 0 = pad row
    query_lens: np.ndarray | jax.Array  # int32 [B] new tokens in this row, 0 = pad row
    # Decode on the XLA path reads K/V through a page list instead of the page tables:
    # int32 [3, P] (block, row, first position) per page of each row, see `ragged_attention`.
    pages: np.ndarray | jax.Array | None = None


@runtime_checkable
class CachePoolProtocol(Protocol):
    """Host-side KV memory management: sequences, their pages and their lengths.

    A sequence id comes from `allocate_slot`. Its length counts the tokens whose
    K/V is stored, including those a step is about to write: the engine calls
    `append(seq, n)` before a step that writes `n` tokens, then `metadata(...)`.

    Prefix caching: `allocate_slot(n, token_ids)` may start a sequence with the
    cached K/V of a prefix of `token_ids` (its length is then that prefix's
    length, never all of `token_ids`), and `cache_blocks` publishes a sequence's
    computed full blocks for later requests. A backend without a prefix cache
    reports no hits and ignores `cache_blocks`.
    """

    is_paged: bool
    supports_fork: bool  # whether `fork` works (parallel sampling needs it)
    block_size: int
    num_blocks: int  # device pool size, null block included

    def allocate_slot(self, initial_tokens: int, token_ids: Sequence[int] | None = None) -> int:
        """Reserve room for `initial_tokens`; raises OutOfBlocksError.

        The length starts at 0, or, given the `token_ids` (`initial_tokens` of them)
        and a prefix cache, at the tokens of the longest cached run of full blocks
        matching them, at most `initial_tokens - 1` (the last token is always computed).
        """
        ...

    def num_cached_tokens(self, token_ids: Sequence[int]) -> int:
        """What `allocate_slot(len(token_ids), token_ids)` would start the length at now
        (no side effects: for admission accounting)."""
        ...

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """The first `num_computed` of the sequence's `token_ids` now have their K/V in
        the pool: make its full blocks among them findable by later prefix lookups."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the device pool's contents were lost)."""
        ...

    def free_slot(self, seq_id: int) -> None: ...

    def get_seq_len(self, seq_id: int) -> int: ...

    def free_slot_count(self) -> int:
        """How many more sequences may be allocated (slots or, for paged, a large number)."""
        ...

    def free_token_capacity(self) -> int | None:
        """Tokens the free blocks (evictable cached ones included) can still hold; None
        when memory is reserved per slot."""
        ...

    def can_append(self, seq_id: int, num_tokens: int) -> bool: ...

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Grow the length by `num_tokens`, allocating blocks lazily; raises OutOfBlocksError.

        Returns `(src, dst)` block copies the device pool must do before the
        write (copy-on-write of a shared last block).
        """
        ...

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block of `seq_id` (ref counts, copy-on-write);
        NotImplementedError where `supports_fork` is False."""
        ...

    def metadata(
        self, seq_ids: Sequence[int], query_lens: Sequence[int], batch: int, width: int, lq: int
    ) -> StepMetadata:
        """Step arrays for `seq_ids` (each writing its last `query_lens[i]` tokens), padded
        to `batch` rows, `width` page-table columns and `lq` tokens per row."""
        ...

    def num_blocks_needed(self, seq_id: int) -> int:
        """Page-table columns this sequence needs now (for bucketing the width)."""
        ...

    def stats(self) -> dict[str, float]:
        """Memory statistics: blocks total/used/free, utilization, fragmentation, counters,
        prefix cache and sharing figures (the same keys for every backend)."""
        ...

    def audit(self) -> list[int]:
        """Block ids held by the allocator that no sequence references (leaks)."""
        ...
