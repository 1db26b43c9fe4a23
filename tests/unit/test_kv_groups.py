"""KV-cache groups: the partition of layers, and a paged cache whose sliding groups give
back the blocks their windows have passed."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.cache.groups import KVGroups, window_blocks
from jpaged.cache.paged import PagedKVCache
from jpaged.cache.protocol import OutOfBlocksError


def gemma_pattern(num_layers: int) -> list[bool]:
    return [(i + 1) % 6 != 0 for i in range(num_layers)]  # every sixth layer is global


def test_partitions_of_the_real_models():
    g270 = KVGroups.of(18, gemma_pattern(18), 512)
    assert g270.size == 3 and g270.num_groups == 6
    assert g270.layers[0] == (5, 11, 17) and g270.windows == (None,) + (512,) * 5
    assert g270.layers[1] == (0, 1, 2) and g270.layers[2] == (3, 4, 6)
    g1b = KVGroups.of(26, gemma_pattern(26), 512)
    assert g1b.size == 2 and g1b.windows.count(None) == 2 and g1b.num_groups == 13
    group, slot = g1b.layer_index()
    for g, members in enumerate(g1b.layers):  # every layer once, in its group's place
        assert group[list(members)].tolist() == [g] * 2 and slot[list(members)].tolist() == [0, 1]
    assert sorted(i for m in g1b.layers for i in m) == list(range(26))
    # nothing slides (Llama, Qwen3), or the hybrid cache is off: one group of every layer
    for one, n in (
        (KVGroups.of(16), 16),
        (KVGroups.of(4, [False] * 4, 512), 4),
        (KVGroups.of(18, gemma_pattern(18), 512, hybrid=False), 18),
    ):
        assert one.layers == (tuple(range(n)),) and one.windows == (None,)


def test_blocks_a_long_sequence_holds():
    """Gemma 3 1B at 8k tokens, blocks of 16: 2 full groups hold every block, 11 sliding
    groups the 33 blocks of their 512-token window (vs 13 groups x 512 blocks)."""
    g = KVGroups.of(26, gemma_pattern(26), 512)
    assert window_blocks(512, 16) == 33
    assert g.blocks_for(8192, 16) == 2 * 512 + 11 * 33
    assert g.blocks_for(100, 16) == 13 * 7  # shorter than the window: every group alike
    assert g.max_tokens(2 * 512 + 11 * 33, 16) == 8192
    assert KVGroups.of(26).max_tokens(100, 16) == 1600


# one full group and two sliding groups of window 8 over blocks of 4
GROUPS = KVGroups(((0,), (1,), (2,)), (None, 8, 8))
BS = 4


def held(pool: PagedKVCache, seq: int) -> list[list[int]]:
    tables, _ = pool.page_tables([seq], 64)
    return [[int(b) for b in t[0] if b] for t in tables]


def test_sliding_groups_keep_only_their_window():
    pool = PagedKVCache(64, BS, enable_prefix_caching=False, groups=GROUPS)
    seq = pool.allocate_seq(10)
    assert [len(h) for h in held(pool, seq)] == [3, 0, 0]  # full: eager; sliding: lazy
    pool.append(seq, 10)
    assert [len(h) for h in held(pool, seq)] == [3, 3, 3]
    for length in range(11, 60):
        pool.append(seq, 1)
        pages = -(-length // BS)
        tables, lens = pool.page_tables([seq], pages)
        assert lens[0] == length and (tables[0, 0] > 0).all()  # the full group: every page
        # a sliding group: the pages the newest token's window sees, null before them
        first = max(0, length - 1 - 8 + 1) // BS
        for t in tables[1:, 0]:
            assert (t[first:] > 0).all() and (t[:first] == 0).all(), (length, t)
        assert pool.audit() == []
    stats = pool.stats()
    assert stats["group0_blocks"] == 15 and stats["group1_blocks"] == stats["group2_blocks"] == 3
    assert stats["window_frees"] == 2 * 12 and stats["blocks_used"] == 15 + 2 * 3
    pool.free_seq(seq)
    assert pool.allocator.num_used == 0 and pool.audit() == []


def test_allocate_slots_grants_a_chunk_by_its_peak_all_or_nothing():
    """12 blocks: a new 20-token prompt holds its 5 pages in the full group at once, and
    in each sliding group the pages of the chunk being computed (what it gives back
    only counts once it has passed them)."""
    pool = PagedKVCache(1 + 12, BS, groups=GROUPS)
    ids = list(range(20))
    assert pool.allocate_slots(None, 20, num_tokens=20, token_ids=ids) is None  # 5 + 2 x 5
    assert pool.allocator.num_used == 0 and pool.stats()["prefix_cache_queries"] == 0
    seq, copies = pool.allocate_slots(None, 8, num_tokens=20, token_ids=ids)  # 5 + 2 x 2
    assert copies == [] and pool.get_seq_len(seq) == 8 and pool.allocator.num_used == 9
    assert pool.allocate_slots(seq, 8) is None  # 2 x 2 more, 3 free
    assert pool.allocate_slots(seq, 4) == (seq, []) and pool.allocator.num_used == 11
    # 12 tokens computed: the next 4 see from token 5 on, so each window gives block 0
    # back (once published: prefix caching keeps it findable until then)
    pool.cache_blocks(seq, ids, 12)
    assert pool.allocate_slots(seq, 4, reserve=2) is None
    assert pool.allocate_slots(seq, 4, reserve=1) == (seq, [])
    assert pool.allocator.num_used == 11 and pool.get_seq_len(seq) == 16
    assert pool.audit() == []


def test_windows_give_back_before_any_group_grows():
    """A full pool: one more token takes a block in every group, and each window gives
    two back, so it fits whichever group's turn comes first."""
    pool = PagedKVCache(1 + 12, BS, enable_prefix_caching=False, groups=GROUPS)
    seq = pool.allocate_seq(16)
    pool.append(seq, 16)  # 4 blocks in each group
    assert pool.allocator.num_free == 0
    assert pool.allocate_slots(seq, 1) == (seq, [])
    assert [len(h) for h in held(pool, seq)] == [5, 3, 3] and pool.allocator.num_free == 1
    assert pool.audit() == []


def test_growth_counts_the_blocks_a_window_gives_back():
    """12 blocks: 24 tokens would need 18 pages in 3 groups; with the windows giving back
    what they passed, a prompt prefilled in chunks of 4 and its decode reach 24 tokens,
    the `max_seq_tokens` of that pool, and stop there without leaking."""
    pool = PagedKVCache(1 + 12, BS, enable_prefix_caching=False, groups=GROUPS)
    assert pool.max_seq_tokens == 24
    seq = pool.allocate_seq(20)
    for _ in range(5):
        pool.append(seq, 4)
    while pool.allocate_slots(seq, 1) is not None:
        pass
    assert pool.get_seq_len(seq) == 24
    with pytest.raises(OutOfBlocksError):
        pool.append(seq, 1)
    assert pool.get_seq_len(seq) == 24 and pool.audit() == []


def test_fork_shares_every_group_and_copies_on_write():
    pool = PagedKVCache(64, BS, enable_prefix_caching=False, groups=GROUPS)
    a = pool.allocate_seq(14)
    pool.append(a, 14)
    b = pool.fork(a)
    assert held(pool, a) == held(pool, b)
    copies = pool.append(b, 1)  # the shared partial last block, in each group
    assert len(copies) == 3 and held(pool, a) != held(pool, b)
    for _ in range(12):
        pool.append(a, 1)
        pool.append(b, 1)
    for s in (a, b):
        pool.free_seq(s)
    assert pool.allocator.num_used == 0 and pool.audit() == []


def test_prefix_hits_need_the_window_blocks_of_the_first_new_token():
    """vLLM's rule: a cached prefix is reused only where every group still has what the
    first new token sees; a sliding group's passed block that was evicted means the
    prefix is recomputed (in part or whole), never read as garbage."""
    pool = PagedKVCache(1 + 3 * 8, BS, groups=GROUPS)
    ids = list(range(100, 130))  # 30 tokens: 7 full blocks
    a = pool.allocate_seq(30, ids)
    pool.append(a, 30)
    pool.cache_blocks(a, ids, 30)
    for _ in range(2):
        pool.append(a, 1)  # the window passes the first blocks: given back, still cached
    assert pool.num_cached_tokens(ids) == 28  # 7 blocks: full group all, sliding 2 each
    pool.free_seq(a)
    assert pool.num_cached_tokens(ids) == 28
    assert pool.num_cached_tokens(ids[:13]) == 12
    # Another prompt takes blocks: the least recently used cached ones go first, the
    # sliding groups' early blocks (passed first) among them.
    other = pool.allocate_seq(24)
    pool.append(other, 24)
    pool.free_seq(other)
    hit = pool.num_cached_tokens(ids)
    assert hit < 28
    seq = pool.allocate_seq(30, ids)
    assert pool.get_seq_len(seq) == hit
    tables, _ = pool.page_tables([seq], 8)
    pages = hit // BS
    assert (tables[0, 0, :pages] > 0).all()  # the full group: the whole prefix
    first = max(0, hit - 8 + 1) // BS
    for t in tables[1:, 0]:
        assert (t[first:pages] > 0).all()  # every block the first new token sees
    pool.free_seq(seq)
    assert pool.audit() == [] and pool.allocator.num_used == 0


def test_window_blocks_wait_until_published():
    """With prefix caching, a passed block goes back only once `cache_blocks` published
    it (async scheduling grows a sequence before the step that wrote it returns)."""
    pool = PagedKVCache(64, BS, groups=GROUPS)
    ids = list(range(20))
    seq = pool.allocate_seq(20, ids)
    pool.append(seq, 20)
    pool.append(seq, 1)  # before any publication: nothing given back
    assert [len(h) for h in held(pool, seq)] == [6, 6, 6]
    pool.cache_blocks(seq, ids + [0], 20)
    pool.append(seq, 1)
    assert [len(h) for h in held(pool, seq)] == [6, 3, 3]
    assert np.asarray(pool.stats()["window_frees"]) == 6
