"""Block allocator: integer block ids, ref counts, owners. No tensors live here.

Block 0 is the null block (padding reads and writes go there) and is never
handed out. In the spirit of vLLM v1 `block_pool.py`, minus prefix hashing.
"""

from __future__ import annotations

from collections.abc import Iterable

from jpaged.cache.protocol import OutOfBlocksError

NULL_BLOCK = 0


class BlockAllocator:
    """O(1) allocate/free over ids `1 .. num_blocks-1` with ref counts for sharing."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        # Plain lists: per-element access is several times cheaper than NumPy scalars.
        self._ref = [0] * num_blocks
        self._owner: list[int | None] = [None] * num_blocks
        # A stack reversed so ids come out 1, 2, 3, ... (recently freed ids are reused first).
        self._free = list(range(num_blocks - 1, 0, -1))
        self.num_allocations = 0  # blocks taken off the free list
        self.num_frees = 0  # blocks returned to the free list

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: int | None = None) -> int:
        """One fresh block with ref count 1; raises OutOfBlocksError when none is free."""
        if not self._free:
            raise OutOfBlocksError(f"no free blocks (all {self.num_blocks - 1} in use)")
        block = self._free.pop()
        self._ref[block] = 1
        self._owner[block] = owner
        self.num_allocations += 1
        return block

    def allocate_many(self, n: int, owner: int | None = None) -> list[int]:
        """`n` fresh blocks, all or nothing."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} blocks, {len(self._free)} free")
        return [self.allocate(owner) for _ in range(n)]

    def share(self, block: int) -> None:
        """One more holder of an allocated block (fork, prefix sharing)."""
        self._check_held(block, "share")
        self._ref[block] += 1

    def free(self, block: int) -> bool:
        """Drop one reference; True when the block went back to the free list."""
        self._check_held(block, "free")
        self._ref[block] -= 1
        if self._ref[block]:
            return False
        self._owner[block] = None
        self._free.append(block)
        self.num_frees += 1
        return True

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def owner(self, block: int) -> int | None:
        """Who allocated the block (kept while shared; None once free)."""
        self._check_id(block)
        return self._owner[block]

    def audit(self, referenced: Iterable[int]) -> list[int]:
        """Allocated blocks not in `referenced`: leaks, e.g. a sequence freed without its pages."""
        seen = set(referenced)
        return [b for b in range(1, self.num_blocks) if self._ref[b] and b not in seen]

    def reclaim(self, blocks: Iterable[int]) -> int:
        """Force leaked blocks back to the free list whatever their ref count; returns how many."""
        blocks = list(blocks)
        for b in blocks:
            self._check_held(b, "reclaim")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot reclaim a block twice: {blocks}")
        for b in blocks:
            self._ref[b] = 1
            self.free(b)
        return len(blocks)

    def _check_id(self, block: int) -> None:
        if not 0 < block < self.num_blocks:
            raise ValueError(
                f"invalid block id {block!r}: valid ids are 1..{self.num_blocks - 1} "
                f"(0 is the null block)"
            )

    def _check_held(self, block: int, verb: str) -> None:
        self._check_id(block)
        if not self._ref[block]:
            raise ValueError(f"cannot {verb} block {block}: it is free (double free?)")
