"""PagedKVCache: eager prompts, lazy decode growth, fork + copy-on-write, page tables,
stats."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.cache.groups import KVGroups
from jpaged.cache.paged import PagedKVCache
from jpaged.cache.protocol import CacheProtocol, OutOfBlocksError


def test_satisfies_protocol():
    pool = PagedKVCache(8, 4)
    assert isinstance(pool, CacheProtocol)
    assert pool.num_blocks == 8 and pool.block_size == 4
    assert pool.free_block_capacity() == 7


def test_prompt_blocks_are_allocated_eagerly():
    pool = PagedKVCache(10, 16)
    seq = pool.allocate_seq(33)
    assert pool.get_seq_len(seq) == 0
    assert pool.allocator.num_free == 6
    assert pool.append(seq, 33) == []
    assert pool.allocator.num_free == 6 and pool.get_seq_len(seq) == 33
    assert pool.page_tables([seq], 3)[0][0].tolist() == [[1, 2, 3]]


def test_prompt_that_does_not_fit_leaves_no_state(pages_of):
    pool = PagedKVCache(5, 16)  # 4 usable blocks
    keep = pool.allocate_seq(16)
    pool.append(keep, 16)
    before = pool.stats()
    with pytest.raises(OutOfBlocksError):
        pool.allocate_seq(16 * 3 + 1)
    after = pool.stats()
    for key in ("blocks_used", "allocations", "frees", "num_seqs"):
        assert after[key] == before[key], key
    assert pool.audit() == [] and pages_of(pool, keep) == [1]
    seq = pool.allocate_seq(48)  # exactly fits
    assert pool.append(seq, 48) == [] and pages_of(pool, seq) == [2, 3, 4]


def test_decode_grows_one_block_exactly_at_block_boundaries(pages_of):
    bs = 4
    pool = PagedKVCache(32, bs)
    seq = pool.allocate_seq(3)
    pool.append(seq, 3)
    for length in range(4, 30):
        pool.append(seq, 1)
        assert pool.get_seq_len(seq) == length
        assert pages_of(pool, seq) == list(range(1, -(-length // bs) + 1)), length
        assert pool.allocator.num_used == -(-length // bs)
    # The 29th token opened block 8; tokens 30..32 fit in it.
    used = pool.allocator.num_used
    pool.append(seq, 3)
    assert pool.allocator.num_used == used
    pool.append(seq, 1)
    assert pool.allocator.num_used == used + 1


def test_append_out_of_blocks_is_atomic(pages_of):
    pool = PagedKVCache(3, 4)  # 2 usable blocks
    seq = pool.allocate_seq(4)
    pool.append(seq, 4)
    assert pool.allocate_slots(seq, 5) is None
    with pytest.raises(OutOfBlocksError):
        pool.append(seq, 5)
    assert pool.get_seq_len(seq) == 4 and pages_of(pool, seq) == [1]
    assert pool.append(seq, 4) == [] and pages_of(pool, seq) == [1, 2]
    with pytest.raises(ValueError):
        pool.append(seq, -1)


def test_fork_copies_a_shared_partial_last_block_on_write(pages_of):
    pool = PagedKVCache(10, 4)
    a = pool.allocate_seq(6)
    pool.append(a, 6)  # blocks [1, 2], block 2 half full
    b = pool.fork(a)
    ref = pool.allocator.ref_count
    assert pages_of(pool, b) == [1, 2] and pool.get_seq_len(b) == 6
    assert ref(1) == ref(2) == 2
    assert pool.append(b, 1) == [(2, 3)]  # b gets a private copy of block 2
    assert pages_of(pool, b) == [1, 3] and pages_of(pool, a) == [1, 2]
    assert (ref(1), ref(2), ref(3)) == (2, 1, 1)
    assert pool.append(a, 1) == []  # block 2 is a's alone now: write in place
    assert pool.append(b, 2) == [] and pages_of(pool, b) == [1, 3, 4]
    assert pool.stats()["cow_copies"] == 1
    pool.free_seq(a)
    assert (ref(1), pool.allocator.num_used) == (1, 3)
    pool.free_seq(b)
    assert pool.allocator.num_used == 0 and pool.audit() == []


def test_fork_at_a_block_boundary_copies_nothing(pages_of):
    pool = PagedKVCache(10, 4)
    a = pool.allocate_seq(8)
    pool.append(a, 8)
    b = pool.fork(a)
    assert pool.append(b, 1) == [] and pages_of(pool, b) == [1, 2, 3]
    assert pool.append(a, 1) == [] and pages_of(pool, a) == [1, 2, 4]


def test_fork_before_the_prompt_is_written_swaps_blocks_without_copies(pages_of):
    pool = PagedKVCache(10, 4)
    a = pool.allocate_seq(8)  # reserved, nothing stored yet
    b = pool.fork(a)
    assert pool.append(a, 8) == []  # nothing of a's is in the shared blocks to copy
    assert pool.allocator.ref_count(1) == 1
    assert pool.append(b, 8) == []  # b alone holds the blocks it was forked with
    assert pages_of(pool, a) == [3, 4] and pages_of(pool, b) == [1, 2]


def test_copy_on_write_out_of_blocks_is_atomic(pages_of):
    pool = PagedKVCache(3, 4)
    a = pool.allocate_seq(2)
    pool.append(a, 2)
    b = pool.fork(a)
    c = pool.allocate_seq(1)  # takes the last free block
    assert pool.allocate_slots(b, 1) is None
    with pytest.raises(OutOfBlocksError):
        pool.append(b, 1)
    assert pages_of(pool, b) == [1] and pool.allocator.ref_count(1) == 2
    pool.free_seq(c)
    assert pool.append(b, 1) == [(1, 2)]


def test_page_tables_hand_checked():
    pool = PagedKVCache(16, 4)
    x = pool.allocate_seq(4)  # block 1
    a = pool.allocate_seq(6)  # blocks 2, 3
    pool.free_seq(x)
    b = pool.allocate_seq(5)  # blocks 1 (reused), 4: not contiguous, not increasing
    c = pool.allocate_seq(9)  # blocks 5, 6, 7 reserved, only 1 used below
    pool.append(a, 6)  # prefill 6
    pool.append(b, 5)
    pool.append(b, 1)  # decode token at position 5
    pool.append(c, 3)
    (tables,), lens = pool.page_tables([a, b, c], width=4)
    # every block a sequence holds, reserved ones too (the step's plan masks them)
    np.testing.assert_array_equal(tables, [[2, 3, 0, 0], [1, 4, 0, 0], [5, 6, 7, 0]])
    np.testing.assert_array_equal(lens, [6, 6, 3])
    assert tables.dtype == lens.dtype == np.int32


def test_page_tables_reject_bad_input():
    pool = PagedKVCache(16, 4)
    a = pool.allocate_seq(9)
    pool.append(a, 9)
    with pytest.raises(KeyError):
        pool.page_tables([a + 1], width=4)


def test_page_tables_match_each_sequence_alone_under_random_churn(pages_of):
    rng = np.random.default_rng(0)
    bs = 4
    pool = PagedKVCache(200, bs)
    live: list[int] = []
    for _ in range(300):
        op = rng.integers(4)
        if op == 0 or not live:
            try:
                seq = pool.allocate_seq(int(rng.integers(0, 30)))
            except OutOfBlocksError:
                continue
            live.append(seq)
        elif op == 1:
            pool.free_seq(live.pop(int(rng.integers(len(live)))))
        elif op == 2 and len(live) < 30:
            try:
                live.append(pool.fork(live[int(rng.integers(len(live)))]))
            except OutOfBlocksError:
                continue
        seqs = []
        for s in live:
            q = int(rng.integers(1, 4))
            if pool.allocate_slots(s, q) is not None:
                seqs.append(s)
        if not seqs:
            continue
        width = max(-(-pool.get_seq_len(s) // bs) for s in seqs)
        (tables,), lens = pool.page_tables(seqs, width)
        for i, s in enumerate(seqs):
            n = pool.get_seq_len(s)
            pages = -(-n // bs)
            assert tables[i, :pages].tolist() == pages_of(pool, s)
            assert all(pool.allocator.ref_count(b) > 0 for b in tables[i, :pages])
            assert lens[i] == n
        assert pool.audit() == []
    assert pool.stats()["num_seqs"] == len(live) > 8  # the row arrays grew
    assert max(len(pages_of(pool, s)) for s in live) > 8  # and the columns
    assert pool.stats()["cow_copies"] > 0


def test_stats_numbers():
    pool = PagedKVCache(11, 4)  # 10 usable blocks
    s = pool.stats()
    assert (s["blocks_total"], s["blocks_used"], s["blocks_free"]) == (10, 0, 10)
    assert s["utilization"] == 0.0 and s["fragmentation"] == 0.0
    a = pool.allocate_seq(6)
    pool.append(a, 6)
    b = pool.fork(a)
    pool.append(b, 1)  # blocks: 1 shared (4 tokens), 2 a's (2 tokens), 3 b's copy (3 tokens)
    s = pool.stats()
    assert (s["blocks_total"], s["blocks_used"], s["blocks_free"]) == (10, 3, 7)
    assert s["tokens_stored"] == 9
    assert s["utilization"] == pytest.approx(9 / 12)
    assert s["fragmentation_slots"] == 3
    assert s["fragmentation"] == pytest.approx(3 / 12)
    assert (s["allocations"], s["frees"]) == (3, 0)
    pool.free_seq(a)
    s = pool.stats()
    assert (s["blocks_used"], s["tokens_stored"], s["frees"]) == (2, 7, 1)
    assert s["utilization"] == pytest.approx(7 / 8)
    assert s["allocations_per_s"] * s["uptime_s"] == pytest.approx(3)
    assert s["frees_per_s"] * s["uptime_s"] == pytest.approx(1)
    assert pool.free_block_capacity() == 8


def test_reserved_prompt_blocks_count_as_fragmentation():
    pool = PagedKVCache(11, 4)
    pool.allocate_seq(8)
    s = pool.stats()
    assert (s["blocks_used"], s["tokens_stored"], s["fragmentation"]) == (2, 0, 1.0)


def test_audit_finds_a_leaked_block(pages_of):
    pool = PagedKVCache(8, 4)
    a = pool.allocate_seq(5)
    pool.append(a, 5)
    leaked = pool.allocator.allocate(owner=99)  # held by no page table
    assert pool.audit() == [leaked]
    assert pool.allocator.owner(leaked) == 99
    pool.allocator.reclaim(pool.audit())
    assert pool.audit() == [] and pages_of(pool, a) == [1, 2]


def test_unknown_sequence_ids_raise():
    pool = PagedKVCache(8, 4)
    a = pool.allocate_seq(1)
    pool.free_seq(a)
    for op in (pool.free_seq, pool.get_seq_len, pool.fork):
        with pytest.raises(KeyError, match="unknown sequence"):
            op(a)


def _decode_mix(pool: PagedKVCache) -> list[int]:
    """Sequences whose next token lands: in a held private block, across a block's end,
    in a block reserved for the prompt, in a block shared with a fork (twice)."""
    inside = pool.allocate_seq(5)
    pool.append(inside, 5)
    boundary = pool.allocate_seq(8)
    pool.append(boundary, 8)
    reserved = pool.allocate_seq(7)  # length 0, its prompt's two blocks held
    parent = pool.allocate_seq(6)
    pool.append(parent, 6)
    child = pool.fork(parent)
    return [inside, boundary, reserved, parent, child]


def test_grow_decodes_matches_allocate_slots_row_by_row():
    fast, slow = PagedKVCache(64, 4), PagedKVCache(64, 4)
    seqs = [s for _ in range(4) for s in _decode_mix(fast)]  # (enough to take them at once)
    assert seqs == [s for _ in range(4) for s in _decode_mix(slow)]
    assert fast.grow_decodes(seqs[:5]) == [False] * 5  # (a few: row by row is cheaper)
    grown = fast.grow_decodes(seqs)
    assert grown == [True, False, True, False, False] * 4
    fast_copies = [fast.allocate_slots(s, 1) for s, g in zip(seqs, grown, strict=True) if not g]
    slow_copies = [slow.allocate_slots(s, 1) for s in seqs]
    assert fast_copies == [c for c, g in zip(slow_copies, grown, strict=True) if not g]
    np.testing.assert_array_equal(*(p.page_tables(seqs, 4)[0] for p in (fast, slow)))
    assert [fast.get_seq_len(s) for s in seqs] == [slow.get_seq_len(s) for s in seqs]
    assert fast.allocator.ref_counts(list(range(64))) == slow.allocator.ref_counts(list(range(64)))


def test_grow_decodes_leaves_windowed_pools_to_allocate_slots():
    pool = PagedKVCache(80, 4, groups=KVGroups.of(2, [True, False], 8))
    seqs = [pool.allocate_seq(5) for _ in range(16)]
    for seq in seqs:
        pool.append(seq, 5)
    assert pool.grow_decodes(seqs) == [False] * 16
    assert {pool.get_seq_len(s) for s in seqs} == {5}
