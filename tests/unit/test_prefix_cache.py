"""Prefix caching in the allocator and the paged pool: keys, hits, LRU eviction, accounting."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged.cache.allocator import BlockAllocator
from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.paged import PagedKVCache, block_key
from jpaged.cache.protocol import CacheProtocol, OutOfBlocksError

BS = 4


def key(i: int) -> bytes:
    return block_key(b"", [i])


def computed(pool: PagedKVCache, ids: list[int], hit_ok: bool = True) -> int:
    """Admit `ids` as a prompt, 'compute' it, publish its blocks; returns the sequence."""
    seq = pool.allocate_seq(len(ids), ids)
    start = pool.get_seq_len(seq)
    assert hit_ok or start == 0
    pool.append(seq, len(ids) - start)
    pool.cache_blocks(seq, ids, len(ids))
    return seq


# -- allocator ---------------------------------------------------------------------------


def test_freed_cached_block_is_evictable_and_revivable():
    a = BlockAllocator(4)
    b = a.allocate(owner=1)
    assert a.cache(b, key(1), [1, 2]) and a.num_cached == 1
    assert a.free(b) and a.is_evictable(b) and a.key(b) == key(1)
    assert (a.num_free, a.num_used, a.num_evictable) == (3, 0, 1)  # evictable counts as free
    assert a.lookup(key(1), [1, 2]) == b
    a.acquire(b, owner=2)
    assert a.ref_count(b) == 1 and not a.is_evictable(b) and a.owner(b) == 2
    assert a.num_revived == 1 and a.num_used == 1
    a.acquire(b)  # a second holder of a held cached block
    assert a.ref_count(b) == 2 and a.num_shared == 1


def test_never_cached_blocks_go_first_then_lru_eviction_drops_the_key():
    a = BlockAllocator(5)
    blocks = a.allocate_many(4)
    for i, b in enumerate(blocks[:3]):
        a.cache(b, key(i), [i])
    for b in [blocks[1], blocks[0], blocks[3], blocks[2]]:
        a.free(b)
    # free list: blocks[3]; LRU order of evictable: blocks[1], blocks[0], blocks[2]
    assert a.allocate() == blocks[3] and a.num_evictions == 0
    assert a.allocate() == blocks[1]
    assert (a.num_evictions, a.num_evicted_blocks) == (1, 1)
    assert a.lookup(key(1), [1]) is None and a.key(blocks[1]) is None  # no stale key
    assert a.allocate_many(2) == [blocks[0], blocks[2]]
    assert (a.num_evictions, a.num_evicted_blocks, a.num_cached) == (2, 3, 0)
    with pytest.raises(OutOfBlocksError):
        a.allocate()


def test_held_cached_blocks_are_never_evicted():
    a = BlockAllocator(3)
    held, other = a.allocate_many(2)
    a.cache(held, key(0), [0])
    a.cache(other, key(1), [1])
    a.free(other)
    assert a.allocate() == other  # the evictable one, not the held one
    assert not a.can_allocate(1)
    with pytest.raises(OutOfBlocksError):
        a.allocate_many(1)
    assert a.lookup(key(0), [0]) == held and a.ref_count(held) == 1


def test_key_collisions_and_duplicates_are_refused():
    a = BlockAllocator(4)
    b, c = a.allocate_many(2)
    assert a.cache(b, key(7), [1, 2, 3])
    assert a.lookup(key(7), [1, 2, 4]) is None  # same key, other tokens: not a hit
    assert not a.cache(c, key(7), [1, 2, 3])  # another block holds this content already
    assert not a.cache(b, key(8), [5])  # a block keeps its first key
    a.free(c)
    assert not a.is_evictable(c) and a.num_evictable == 0  # uncached: plain free list
    with pytest.raises(ValueError, match="not cached"):
        a.acquire(c)


def test_drop_cache_turns_evictable_blocks_free():
    a = BlockAllocator(4)
    b, c = a.allocate_many(2)
    a.cache(b, key(0), [0])
    a.cache(c, key(1), [1])
    a.free(b)
    assert a.drop_cache() == 2
    assert a.num_cached == a.num_evictable == 0 and a.lookup(key(1), [1]) is None
    assert a.num_free == 2 and a.key(c) is None
    a.free(c)
    assert a.num_free == 3


class CachingAllocatorMachine(RuleBasedStateMachine):
    """Random allocate / cache / free / hit / evict against a model of who holds what."""

    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(2)
        self.held: list[int] = []  # one entry per reference
        self.content: dict[int, int] = {}  # model: block -> content id it was cached with
        self.next_content = 0

    @initialize(num_blocks=st.integers(2, 12))
    def init(self, num_blocks: int) -> None:
        self.a = BlockAllocator(num_blocks)

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        fits = self.a.can_allocate(n)
        if not fits:
            with pytest.raises(OutOfBlocksError):
                self.a.allocate_many(n)
            return
        evictable = {b for b in self.content if self.a.is_evictable(b)}
        blocks = self.a.allocate_many(n)
        assert not set(blocks) & set(self.held), "handed out a block somebody holds"
        for b in blocks:
            if b in self.content:
                assert b in evictable
                del self.content[b]  # evicted: its content is gone
            assert self.a.key(b) is None
        self.held += blocks

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self.held))
        c = self.next_content
        self.next_content += 1
        if self.a.cache(b, key(c), [c]):
            assert b not in self.content
            self.content[b] = c

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        b = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.a.free(b)

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        b, c = data.draw(st.sampled_from(sorted(self.content.items())))
        assert self.a.lookup(key(c), [c]) == b
        self.a.acquire(b)
        self.held.append(b)

    @invariant()
    def consistent(self) -> None:
        a = self.a
        refs = {b: self.held.count(b) for b in set(self.held)}
        for b in range(1, a.num_blocks):
            assert a.ref_count(b) == refs.get(b, 0)
            assert a.is_evictable(b) == (b in self.content and b not in refs)
            assert (a.key(b) is not None) == (b in self.content)
        assert a.num_used == len(refs) and a.num_cached == len(self.content)
        assert a.num_free + a.num_used == a.num_blocks - 1
        assert not set(a._free) & set(a._evictable), "a block is free twice"
        for b, c in self.content.items():  # every key finds its block: none is stale
            assert a.lookup(key(c), [c]) == b


TestCachingAllocatorMachine = CachingAllocatorMachine.TestCase
TestCachingAllocatorMachine.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- paged pool --------------------------------------------------------------------------


def test_both_backends_satisfy_the_extended_protocol():
    paged = PagedKVCache(8, BS)
    contiguous = ContiguousKVCache(2, 16, BS)
    for pool in (paged, contiguous):
        assert isinstance(pool, CacheProtocol)
    seq = contiguous.allocate_seq(8, list(range(8)))
    contiguous.append(seq, 8)
    contiguous.cache_blocks(seq, list(range(8)), 8)
    assert contiguous.num_cached_tokens(list(range(8))) == 0
    assert contiguous.allocate_seq(8, list(range(8))) != seq
    s = contiguous.stats()
    assert s["prefix_cache_hits"] == s["shared_blocks"] == s["cow_copies"] == 0
    assert s["blocks_used_peak"] == 2 * 4
    with pytest.raises(OutOfBlocksError):  # a fork needs a region of its own: none is left
        contiguous.fork(seq)


@pytest.mark.parametrize(
    ("length", "hit_blocks"),
    [(1, 0), (3, 0), (4, 0), (5, 1), (7, 1), (8, 1), (9, 2), (12, 2), (13, 3)],
)
def test_hits_at_block_boundaries_always_leave_the_last_token(length, hit_blocks, pages_of):
    pool = PagedKVCache(32, BS)
    ids = list(range(100, 100 + length))
    first = computed(pool, ids, hit_ok=False)
    owned = pages_of(pool, first)
    assert pool.num_cached_tokens(ids) == hit_blocks * BS
    second = pool.allocate_seq(length, ids)
    assert pool.get_seq_len(second) == hit_blocks * BS < length  # the last token is computed
    assert pool.append(second, length - hit_blocks * BS) == []  # into blocks reserved for it
    table = pages_of(pool, second)
    assert len(table) == -(-length // BS)
    assert table[:hit_blocks] == owned[:hit_blocks]
    assert not set(table[hit_blocks:]) & set(owned)
    assert all(pool.allocator.ref_count(b) == 2 for b in owned[:hit_blocks])
    assert pool.allocator.num_used == len(owned) + len(table) - hit_blocks
    s = pool.stats()
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"]) == (2 * length, hit_blocks * BS)
    assert s["shared_blocks"] == hit_blocks


def test_partial_matches_stop_at_the_first_differing_block():
    pool = PagedKVCache(32, BS)
    base = list(range(20))
    computed(pool, base)
    assert pool.num_cached_tokens(base[:8] + [99] + base[9:]) == 8
    assert pool.num_cached_tokens([99] + base[1:]) == 0
    # the same block content after a different prefix is a different key
    assert pool.num_cached_tokens([0, 1, 2, 99] + base[4:]) == 0
    assert pool.num_cached_tokens(base[:12] + [7, 7, 7]) == 12
    assert pool.num_cached_tokens(base + [5]) == 20


def test_freed_prefix_is_revived_then_evicted_lru_and_never_stale(pages_of):
    pool = PagedKVCache(9, BS)  # 8 usable blocks
    a_ids = list(range(13))  # 3 full blocks + 1 token
    a = computed(pool, a_ids)
    a_blocks = pages_of(pool, a)
    pool.free_seq(a)
    s = pool.stats()
    assert (s["blocks_used"], s["prefix_cache_evictable_blocks"], s["prefix_cache_blocks"]) == (
        0,
        3,
        3,
    )
    assert pool.free_block_capacity() == 8  # evictable blocks are capacity
    again = pool.allocate_seq(13, a_ids)  # revives all three
    assert pages_of(pool, again) == a_blocks[:3]
    assert pool.stats()["prefix_cache_evictable_blocks"] == 0
    pool.free_seq(again)
    # 8 fresh tokens x 3 sequences: 2 + 2 + 2 never-cached blocks first, then evictions
    others = [computed(pool, list(range(50 + 10 * i, 58 + 10 * i)), hit_ok=False) for i in range(3)]
    s = pool.stats()
    assert s["prefix_cache_evicted_blocks"] == 1 and s["prefix_cache_evictions"] == 1
    # the tail block went first (freed last-block-first): the prefix is still a hit
    assert pool.num_cached_tokens(a_ids) == 2 * BS
    for seq in others:
        pool.free_seq(seq)
    filler = pool.allocate_seq(8 * BS)  # the whole pool: every cached block is evicted
    pool.append(filler, 8 * BS)
    assert pool.stats()["prefix_cache_blocks"] == 0 and pool.num_cached_tokens(a_ids) == 0
    # reused blocks carry no key of their former content
    assert all(pool.allocator.key(b) is None for b in pages_of(pool, filler))
    pool.free_seq(filler)
    refill = computed(pool, a_ids, hit_ok=False)  # recomputed, cached again
    pool.free_seq(refill)
    assert pool.num_cached_tokens(a_ids) == 3 * BS


def test_admission_with_hits_revives_before_it_evicts(pages_of):
    pool = PagedKVCache(6, BS)  # 5 usable blocks
    ids = list(range(9))
    pool.free_seq(computed(pool, ids))  # blocks 1, 2 cached, 3 plain
    pool.free_seq(computed(pool, [70, 71, 72, 73, 74]))  # block 3 cached, 4 plain
    hog = pool.allocate_seq(2 * BS)  # the never-cached free blocks 4 and 5
    # LRU order of the evictable blocks: 2, 1 (freed last block first), then 3
    before = pool.stats()
    with pytest.raises(OutOfBlocksError):
        pool.allocate_seq(5 * BS, list(range(5 * BS)))
    assert pool.stats()["prefix_cache_blocks"] == before["prefix_cache_blocks"] == 3
    # 2 hits revived + 1 new block = everything left; the new block must come from
    # evicting block 3, not the LRU head that is being revived
    seq = pool.allocate_seq(9, ids)
    assert pool.get_seq_len(seq) == 2 * BS
    assert pool.append(seq, 1) == [] and pages_of(pool, seq) == [1, 2, 3]
    assert pool.allocator.num_free == 0 and pool.num_cached_tokens(ids) == 2 * BS
    assert pool.stats()["prefix_cache_evicted_blocks"] == 1
    assert pool.audit() == []
    pool.free_seq(hog)
    pool.free_seq(seq)
    assert pool.allocator.num_used == 0


def test_only_computed_full_blocks_are_published():
    pool = PagedKVCache(16, BS)
    ids = list(range(11))
    seq = pool.allocate_seq(11, ids)
    pool.append(seq, 6)
    pool.cache_blocks(seq, ids, 6)  # 1 full block computed
    assert pool.num_cached_tokens(ids) == BS
    pool.cache_blocks(seq, ids, 6)  # idempotent
    pool.append(seq, 5)
    pool.cache_blocks(seq, ids, 11)
    assert pool.num_cached_tokens(ids) == 2 * BS
    assert pool.stats()["prefix_cache_blocks"] == 2


def test_decoded_tokens_fill_cacheable_blocks_too():
    pool = PagedKVCache(16, BS)
    ids = list(range(6))
    seq = computed(pool, ids)
    for t in (40, 41, 42):  # decode: the sampled tokens' K/V lands in block 2
        ids = ids + [t]
        pool.append(seq, 1)
        pool.cache_blocks(seq, ids, len(ids))
    assert pool.num_cached_tokens(ids + [0]) == 2 * BS


def test_prefix_caching_off_never_hits():
    pool = PagedKVCache(16, BS, enable_prefix_caching=False)
    ids = list(range(12))
    pool.free_seq(computed(pool, ids))
    assert pool.num_cached_tokens(ids) == 0
    seq = pool.allocate_seq(12, ids)
    assert pool.get_seq_len(seq) == 0
    s = pool.stats()
    assert s["prefix_cache_queries"] == s["prefix_cache_blocks"] == 0
    assert pool.allocator.num_evictable == 0


def test_fork_shares_the_key_chain_and_duplicates_stay_private():
    pool = PagedKVCache(16, BS)
    ids = list(range(6))
    a = computed(pool, ids)
    b = pool.fork(a)
    ta = ids + [7, 8]
    tb = ids + [7, 8]
    assert pool.append(b, 2) == [(2, 3)]  # copy-on-write of the half-full block
    pool.append(a, 2)
    pool.cache_blocks(a, ta, 8)
    pool.cache_blocks(b, tb, 8)  # same content: a's block is the cached one
    assert pool.num_cached_tokens(ta + [0]) == 8
    assert pool.allocator.key(3) is None and pool.allocator.key(2) is not None
    s = pool.stats()
    assert (s["shared_blocks"], s["cow_copies"], s["prefix_cache_blocks"]) == (1, 1, 2)
    pool.free_seq(b)
    assert pool.allocator.num_evictable == 0  # b's private copy is plain free
    pool.free_seq(a)
    assert pool.allocator.num_evictable == 2


def test_reset_prefix_cache_forgets_everything():
    pool = PagedKVCache(16, BS)
    ids = list(range(9))
    seq = computed(pool, ids)
    pool.free_seq(computed(pool, list(range(50, 59))))
    pool.reset_prefix_cache()
    assert pool.num_cached_tokens(ids) == 0 and pool.stats()["prefix_cache_blocks"] == 0
    assert pool.allocator.num_evictable == 0
    pool.free_seq(seq)
    assert pool.allocator.num_used == 0 and pool.allocator.num_evictable == 0
