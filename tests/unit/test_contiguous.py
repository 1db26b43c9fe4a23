"""ContiguousKVCache, and the one device step serving both backends."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.cache import kv_pool
from jpaged.cache.contiguous import ContiguousKVCache
from jpaged.cache.paged import PagedKVCache
from jpaged.cache.protocol import CacheProtocol, OutOfBlocksError
from jpaged.kernels import ragged_plan


def test_layout_and_protocol(pages_of):
    cache = ContiguousKVCache(max_batch_size=3, max_seq_len=10, block_size=4)
    assert isinstance(cache, CacheProtocol)
    assert cache.free_block_capacity() is None
    assert cache.blocks_per_region == 3 and cache.num_blocks == 10
    a, b = cache.allocate_seq(5), cache.allocate_seq(0)
    assert cache.get_seq_len(a) == 0 and cache.free_seq_count() == 1
    cache.append(a, 10)
    cache.append(b, 10)
    assert pages_of(cache, a) == [1, 2, 3] and pages_of(cache, b) == [4, 5, 6]


def test_out_of_slots_and_reuse(pages_of):
    cache = ContiguousKVCache(2, 8, 4)
    a = cache.allocate_seq(8)
    cache.allocate_seq(1)
    with pytest.raises(OutOfBlocksError):
        cache.allocate_seq(1)
    cache.free_seq(a)
    c = cache.allocate_seq(3)
    assert c != a and cache.get_seq_len(c) == 0
    cache.append(c, 8)
    assert pages_of(cache, c) == [1, 2]
    with pytest.raises(KeyError, match="unknown sequence"):
        cache.get_seq_len(a)


def test_max_seq_len_is_enforced():
    cache = ContiguousKVCache(2, 10, 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        cache.allocate_seq(11)
    a = cache.allocate_seq(10)
    assert cache.append(a, 9) == []
    assert cache.allocate_slots(a, 2) is None
    with pytest.raises(ValueError, match="max_seq_len"):
        cache.append(a, 2)
    assert cache.get_seq_len(a) == 9
    assert cache.allocate_slots(a, 1) == (a, [])
    assert cache.page_tables([a], 3)[0][0].tolist() == [[1, 2, 3]]


def test_fork_copies_the_parent_at_its_first_append():
    cache = ContiguousKVCache(3, 12, 4)  # regions of blocks 1-3, 4-6, 7-9
    a = cache.allocate_seq(6)
    cache.append(a, 6)
    b = cache.fork(a)  # the second region
    assert cache.get_seq_len(b) == 6 and cache.free_seq_count() == 1
    assert cache.append(b, 1) == [(1, 4), (2, 5)]  # both written blocks, once
    assert cache.append(b, 1) == [] and cache.append(a, 1) == []
    c = cache.fork(a)
    cache.free_seq(c)  # a fork freed before writing copies nothing
    assert cache.fork(a) == c + 1 and cache.free_seq_count() == 0
    with pytest.raises(OutOfBlocksError):
        cache.fork(a)


@pytest.mark.parametrize("bad", [{"max_batch_size": 0}, {"max_seq_len": -1}, {"block_size": 0}])
def test_bad_sizes_raise(bad):
    args = {"max_batch_size": 2, "max_seq_len": 8, "block_size": 4} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        ContiguousKVCache(**args)


def test_page_tables_hand_checked():
    cache = ContiguousKVCache(3, 10, 4)
    a, b = cache.allocate_seq(7), cache.allocate_seq(5)
    cache.append(a, 7)
    cache.append(b, 5)
    (tables,), lens = cache.page_tables([b, a], width=4)
    # each region's blocks are consecutive; past the region, the null block
    np.testing.assert_array_equal(tables, [[4, 5, 6, 0], [1, 2, 3, 0]])
    np.testing.assert_array_equal(lens, [5, 7])


def test_stats_show_the_reserved_waste():
    cache = ContiguousKVCache(4, 10, 4)  # 12 blocks of 4 slots
    a = cache.allocate_seq(5)
    cache.append(a, 5)
    s = cache.stats()
    assert (s["blocks_total"], s["blocks_used"], s["blocks_free"]) == (12, 3, 9)
    assert s["tokens_stored"] == 5
    assert s["utilization"] == pytest.approx(5 / 12)
    assert s["fragmentation_slots"] == 7
    assert s["fragmentation"] == pytest.approx(7 / 12)
    cache.free_seq(a)
    s = cache.stats()
    assert (s["allocations"], s["frees"], s["blocks_used"]) == (3, 3, 0)
    assert cache.audit() == []
    assert set(s) == set(PagedKVCache(4, 4).stats())


def _make(backend: str) -> CacheProtocol:
    if backend == "paged":
        return PagedKVCache(num_blocks=40, block_size=4)
    return ContiguousKVCache(max_batch_size=4, max_seq_len=24, block_size=4)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_one_jitted_step_serves_both_backends(backend):
    """Write a prefill then a decode step through the page tables; read every token back."""
    cache = _make(backend)
    hkv, d, rng = 2, 8, np.random.default_rng(1)
    kv = kv_pool.create(
        num_layers=1,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=4,
        num_blocks=cache.num_blocks,
        dtype="float32",
    )

    @jax.jit
    def step(kv, slots, tables, k):
        kv = kv_pool.write(kv, 0, slots, k, k + 1000)
        b, w = tables.shape  # each sequence's pages, token-major
        pages = [
            x[0, tables].transpose(0, 1, 3, 2, 4).reshape(b, w * 4, hkv, d) for x in (kv.k, kv.v)
        ]
        return kv, pages

    lens = [9, 3, 14]
    seqs = [cache.allocate_seq(n) for n in lens]
    stored = {s: np.zeros((0, hkv, d), np.float32) for s in seqs}
    for query in (lens, [1, 1, 1]):
        for s, q in zip(seqs, query, strict=True):
            cache.append(s, q)
        (tables,), context = cache.page_tables(seqs, width=8)
        # the step's flat tokens (and 4 padding ones) and the slot each writes
        meta = ragged_plan.plan(
            np.array(query),
            context,
            tables,
            num_tokens=sum(query) + 4,
            num_seqs=4,
            width=8,
            block_size=4,
            impl="xla",
        )
        slots = kv_pool.slot_mapping(meta.block_tables, meta.seq_of, meta.positions, 4)
        k = rng.standard_normal((len(slots), hkv, d)).astype(np.float32)
        kv, (gk, gv) = step(kv, jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(k))
        for i, s in enumerate(seqs):
            stored[s] = np.concatenate([stored[s], k[meta.seq_of == i]])
            n = cache.get_seq_len(s)
            np.testing.assert_array_equal(np.asarray(gk[i, :n]), stored[s])
            np.testing.assert_array_equal(np.asarray(gv[i, :n]), stored[s] + 1000)


def test_grow_decodes_leaves_full_regions_and_fresh_forks_to_allocate_slots():
    cache = ContiguousKVCache(3, 8, 4)
    a, full = cache.allocate_seq(6), cache.allocate_seq(8)
    cache.append(a, 6)
    cache.append(full, 8)
    fork = cache.fork(a)  # its first growth returns the copy of a's blocks
    assert cache.grow_decodes([a, full, fork]) == [True, False, False]
    assert [cache.get_seq_len(s) for s in (a, full, fork)] == [7, 8, 6]
    assert cache.allocate_slots(fork, 1) == (fork, [(1, 5), (2, 6)])
    assert cache.allocate_slots(full, 1) is None
