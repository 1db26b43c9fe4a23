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


@runtime_checkable
class CachePoolProtocol(Protocol):
    """Host-side KV memory management: sequences, their pages and their lengths.

    A sequence id comes from `allocate_slot`. Its length counts the tokens whose
    K/V is stored, including those a step is about to write: the engine calls
    `append(seq, n)` before a step that writes `n` tokens, then `metadata(...)`.
    """

    is_paged: bool
    block_size: int
    num_blocks: int  # device pool size, null block included

    def allocate_slot(self, initial_tokens: int) -> int:
        """Reserve room for `initial_tokens` (length starts at 0); raises OutOfBlocksError."""
        ...

    def free_slot(self, seq_id: int) -> None: ...

    def get_seq_len(self, seq_id: int) -> int: ...

    def free_slot_count(self) -> int:
        """How many more sequences may be allocated (slots or, for paged, a large number)."""
        ...

    def free_token_capacity(self) -> int | None:
        """Tokens the free blocks can still hold; None when memory is reserved per slot."""
        ...

    def can_append(self, seq_id: int, num_tokens: int) -> bool: ...

    def append(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Grow the length by `num_tokens`, allocating blocks lazily; raises OutOfBlocksError.

        Returns `(src, dst)` block copies the device pool must do before the
        write (copy-on-write of a shared last block).
        """
        ...

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block of `seq_id` (ref counts, copy-on-write)."""
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
        """Memory statistics: blocks total/used/free, utilization, fragmentation, counters."""
        ...

    def audit(self) -> list[int]:
        """Block ids held by the allocator that no sequence references (leaks)."""
        ...
