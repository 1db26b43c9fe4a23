"""Block allocator: integer block ids, ref counts, owners, the prefix-cache index.

Block 0 is the null block (padding reads and writes go there) and is never
handed out. In the spirit of vLLM v1 `block_pool.py`: a full block may carry a
content key (its chained prefix hash, see `paged.block_key`) together with its
token ids. When its last holder lets go, a keyed block is not wiped but joins
an LRU list of *evictable* blocks that a later prefix hit can revive.
Allocation takes never-cached free blocks first, then evicts the least recently
used evictable block, dropping its key. A block with a holder is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from jpaged.cache.protocol import OutOfBlocksError


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
        self._free = list(range(num_blocks - 1, 0, -1))  # never cached (or key dropped)
        # Unreferenced blocks that keep a cached key, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._key: list[bytes | None] = [None] * num_blocks  # content key of a cached block
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # its token ids
        self._cached: dict[bytes, int] = {}  # content key -> block
        self.num_allocations = 0  # blocks handed out fresh (off the free or evictable list)
        self.num_frees = 0  # blocks whose last reference was dropped
        self.num_revived = 0  # evictable blocks taken back by a prefix hit
        self.num_evictions = 0  # allocation calls that had to evict cached blocks
        self.num_evicted_blocks = 0  # cached blocks reclaimed by those evictions
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-cached free ones plus evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with at least one holder."""
        return self.num_blocks - 1 - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_shared(self) -> int:
        """Blocks with more than one holder (forks, prefix hits)."""
        return sum(r > 1 for r in self._ref)

    @property
    def num_cached(self) -> int:
        """Blocks carrying a content key, held or evictable."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, owner: int | None = None) -> int:
        """One fresh block with ref count 1; raises OutOfBlocksError when none is free."""
        block = self._take(owner)
        self._note_used()
        return block

    def allocate_many(self, n: int, owner: int | None = None) -> list[int]:
        """`n` fresh blocks, all or nothing."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks, {self.num_free} free")
        evicted = self.num_evicted_blocks
        blocks = [self._take(owner, count_event=False) for _ in range(n)]
        if self.num_evicted_blocks > evicted:
            self.num_evictions += 1
        self._note_used()
        return blocks

    def share(self, block: int) -> None:
        """One more holder of an allocated block (fork, prefix sharing)."""
        self._check_held(block, "share")
        self._ref[block] += 1

    def free(self, block: int) -> bool:
        """Drop one reference; True when it was the last (the block is free or evictable)."""
        self._check_held(block, "free")
        self._ref[block] -= 1
        if self._ref[block]:
            return False
        self._owner[block] = None
        if self._key[block] is not None:
            self._evictable[block] = None  # most recently used end
        else:
            self._free.append(block)
        self.num_frees += 1
        return True

    # -- prefix cache ------------------------------------------------------------------

    def cache(self, block: int, key: bytes, tokens: Sequence[int]) -> bool:
        """Give a held, full block its content key. False (and nothing changes) when the
        key already names another block (two sequences computed the same prefix) or the
        block has a key already."""
        self._check_held(block, "cache")
        if key in self._cached or self._key[block] is not None:
            return False
        self._cached[key] = block
        self._key[block] = key
        self._tokens[block] = tuple(tokens)
        return True

    def lookup(self, key: bytes, tokens: Sequence[int]) -> int | None:
        """The cached block with this key and exactly these token ids, held or evictable."""
        block = self._cached.get(key)
        if block is None or self._tokens[block] != tuple(tokens):
            return None  # a hash collision never aliases different tokens
        return block

    def acquire(self, block: int, owner: int | None = None) -> None:
        """One more holder of a cached block; an evictable one is revived (ref 0 -> 1)."""
        self._check_id(block)
        if self._key[block] is None:
            raise ValueError(f"cannot acquire block {block}: it is not cached")
        if self._ref[block] == 0:
            del self._evictable[block]
            self._owner[block] = owner
            self.num_revived += 1
        self._ref[block] += 1
        self._note_used()

    def key(self, block: int) -> bytes | None:
        self._check_id(block)
        return self._key[block]

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def drop_cache(self) -> int:
        """Forget every content key (the device pool was lost); evictable blocks become
        plain free blocks. Returns how many keys were dropped."""
        dropped = len(self._cached)
        for block in self._cached.values():
            self._key[block] = None
            self._tokens[block] = None
        self._cached.clear()
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        return dropped

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def ref_counts(self, blocks: list[int]) -> list[int]:
        """`ref_count` of each block, unchecked (the ids come from page tables)."""
        return list(map(self._ref.__getitem__, blocks))

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

    def _take(self, owner: int | None = None, count_event: bool = True) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            key = self._key[block]
            assert key is not None
            del self._cached[key]
            self._key[block] = None
            self._tokens[block] = None
            self.num_evicted_blocks += 1
            self.num_evictions += count_event
        else:
            raise OutOfBlocksError(f"no free blocks (all {self.num_blocks - 1} in use)")
        self._ref[block] = 1
        self._owner[block] = owner
        self.num_allocations += 1
        return block

    def _note_used(self) -> None:
        used = self.num_used
        if used > self.peak_used:
            self.peak_used = used

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
